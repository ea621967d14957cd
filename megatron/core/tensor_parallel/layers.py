"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Weights are split over the tensor-parallel group and tagged with ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride`` so optimizers, gradient clipping and checkpointing know how to treat them. With
``config.use_cpu_initialization`` every rank builds the full ("master") weight on the CPU from the default
generator and keeps its own slice, so a model has the same weights for every TP size; otherwise each rank
initialises its shard directly, drawing from the tensor-parallel RNG stream.

Parameters whose gradient is only partial on each rank under sequence parallelism (the row-parallel output bias)
carry ``sequence_parallel=True``; gradient finalisation all-reduces those across the TP group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core.fusions.fused_weight_gradient import wgrad_gemm_accum
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.comm_overlap import ColumnParallelLinearWithCommOverlap as _ColumnWithOverlap
from megatron.core.tensor_parallel.comm_overlap import RowParallelLinearWithCommOverlap as _RowWithOverlap
from megatron.core.tensor_parallel.comm_overlap import tp_comm_overlap_for
from megatron.core.fp8.recipe import delayed_scaling_state_for
from megatron.core.tensor_parallel.fp8_linear import fp8_extra_state, fp8_linear_for, load_fp8_extra_state
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _start_gather_along_first_dim,
    _start_reduce_scatter_along_first_dim,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    _EXPERT_PARALLEL_RNG_TRACKER_NAME,
    _MODEL_PARALLEL_RNG_TRACKER_NAME,
    get_cuda_rng_tracker,
)
from megatron.core.tensor_parallel.sharded_state import (
    make_sharded_tensors_for_checkpoint,
    make_tp_sharded_tensor_for_checkpoint,
)
from megatron.core.tensor_parallel.utils import VocabUtility, group_rank, group_size, resolve_tp_group
from megatron.core.utils import get_current_device, warn_once

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict

# Megatron's set: how a parameter is split, plus the tags optimizers that treat expert or fused-QKV weights apart
# (Muon-style ones split a QKV weight into its q/k/v blocks) read, so a copy of a parameter keeps them all.
_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
    "expert_tp": False,
    "is_qkv": False,
    "qkv_split_shapes": None,
}


# ---- tensor-parallel attributes on parameters ----------------------------------------------------------------------


def param_is_not_tensor_parallel_duplicate(param, tp_group=None, expert_tp_group=None):
    """True for a split parameter, or for a replicated one on TP rank 0 (count each replicated value once).

    Expert parameters (``allreduce=False``) are replicated over the expert tensor-parallel group instead; both
    groups default to parallel_state's.
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    is_expert = not getattr(param, "allreduce", True)
    group = expert_tp_group if is_expert else tp_group
    if group is not None:
        return group.rank() == 0  # the given group's own answer, as in Megatron (any object with rank() will do)
    return group_rank(resolve_tp_group(None, is_expert=is_expert)) == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Tag ``tensor`` as split (or not) along ``dim`` with ``stride``; a tensor is tagged once."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(
                f"tensor already has the tensor-parallel attribute {attribute!r}; "
                "use copy_tensor_model_parallel_attributes to copy them between tensors"
            )
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the 'not split' defaults for any tensor-parallel attribute it lacks."""
    for attribute, default in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, default)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Copy the tensor-parallel attributes present on ``source_tensor`` to ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


# ---- initialisation ------------------------------------------------------------------------------------------------


def _initialize_affine_weight_gpu(
    weight: torch.Tensor, init_method: Callable, partition_dim: int, stride: int = 1, is_expert: bool = False
) -> None:
    """Initialise this rank's shard in place, drawing from the (expert) tensor-parallel RNG stream."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    stream = _EXPERT_PARALLEL_RNG_TRACKER_NAME if is_expert else _MODEL_PARALLEL_RNG_TRACKER_NAME
    # The TP stream is seeded per TP rank, so the shards draw independent values.
    with get_cuda_rng_tracker().fork(stream):
        init_method(weight)


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: int,
    world_size: int,
) -> Optional[torch.Tensor]:
    """Build the full ``[output_size, input_size]`` weight on the CPU (fp32, default generator); keep this rank's part.

    The partition dimension is cut into ``stride * world_size`` equal blocks and rank r (of ``world_size``) keeps
    blocks r, r + world_size, r + 2 * world_size, ... in order. With ``stride=2`` on a fused ``[gate; up]`` weight this
    gives rank r ``[gate_r; up_r]``, so each rank can split its own output in two.
    """
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    # Drawn in fp32 whatever params_dtype is, so every dtype starts from the same values (then rounded).
    master_weight = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)

    block_size = per_partition_size // stride
    blocks = torch.split(master_weight, block_size, dim=partition_dim)
    my_blocks = blocks[rank::world_size]
    with torch.no_grad():
        weight.copy_(torch.cat(my_blocks, dim=partition_dim))
    return master_weight if return_master_weight else None


def _check_divisible(layer: str, name: str, size: int, world_size: int, stride: int = 1) -> None:
    if size % (world_size * stride) != 0:
        stride_note = f" x stride {stride}" if stride != 1 else ""
        raise ValueError(
            f"{layer}: {name}={size} is not divisible by the tensor-parallel size {world_size}{stride_note}; "
            f"choose sizes that split evenly over the TP ranks"
        )


class _TensorParallelModule(torch.nn.Module):
    """What the three layers share: group resolution, parameter creation and initialisation."""

    def _setup_group(self, config: ModelParallelConfig, tp_group, is_expert: bool) -> None:
        self.config = config
        self.is_expert = is_expert
        self.tp_group = resolve_tp_group(tp_group, is_expert=is_expert)
        self.tp_size = group_size(self.tp_group)
        self.tp_rank = group_rank(self.tp_group)
        self.sequence_parallel = config.sequence_parallel and self.tp_size > 1
        # An expert layer whose tokens the MoE dispatcher moves explicitly does no TP communication itself.
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)

    def _new_weight(
        self,
        full_shape,
        partition_dim: int,
        init_method: Callable,
        stride: int,
        keep_master_weight_for_test: bool,
    ) -> Parameter:
        local_shape = list(full_shape)
        local_shape[partition_dim] //= self.tp_size
        weight = Parameter(torch.empty(local_shape, dtype=self.config.params_dtype, device=get_current_device()))
        if not self.config.perform_initialization:
            # Tagged even uninitialised: optimizers, clipping and checkpoints read these attributes.
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
        elif self.config.use_cpu_initialization:
            self.master_weight = _initialize_affine_weight_cpu(
                weight,
                full_shape[0],
                full_shape[1],
                local_shape[partition_dim],
                partition_dim,
                init_method,
                stride=stride,
                return_master_weight=keep_master_weight_for_test,
                params_dtype=self.config.params_dtype,
                rank=self.tp_rank,
                world_size=self.tp_size,
            )
        else:
            _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=stride, is_expert=self.is_expert)
        # allreduce=False sends the parameter to DDP's expert buffers, reduced over the expert-DP group.
        weight.allreduce = not (self.is_expert and self.expert_parallel)
        return weight

    def _new_bias(self, size: int) -> Parameter:
        bias = Parameter(torch.zeros(size, dtype=self.config.params_dtype, device=get_current_device()))
        bias.allreduce = not (self.is_expert and self.expert_parallel)
        return bias


# ---- the linear autograd function ----------------------------------------------------------------------------------


def _weight_grad(ctx, weight, grad_output_2d, total_input):
    """The weight gradient ``grad_output^T @ input``, or, with gradient-accumulation fusion, that GEMM accumulated
    straight into ``weight.main_grad`` (DDP's buffer; no temporary) and a placeholder handed to autograd.

    The placeholder keeps autograd's gradient-ready hooks firing (DDP launches its bucket reductions from them). As in
    Megatron, DDP's hook skips ``weight.grad`` once ``grad_added_to_main_grad`` is set, so the placeholder is left
    uninitialised (no pass over the weight to fill it, none to add it). A tied embedding (``shared_embedding``) and
    a weight outside DDP get a zero placeholder instead: other uses of the same weight (the embedding lookup) reach
    ``main_grad`` through ``weight.grad``, to which the zero adds nothing.
    """
    total_input_2d = total_input.reshape(-1, total_input.size(-1))
    if not (ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return grad_output_2d.t().matmul(total_input_2d)
    wgrad_gemm_accum(total_input_2d, grad_output_2d, weight.main_grad)
    return _placeholder_grad(weight)


def _accumulate_weight_grad(ctx, weight, grad_weight):
    """The fusion's step for a weight gradient computed elsewhere (the FP8 GEMM): added into ``main_grad``."""
    if grad_weight is None or not (ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad")):
        return grad_weight
    weight.main_grad.add_(grad_weight.to(weight.main_grad.dtype))
    return _placeholder_grad(weight)


def _placeholder_grad(weight):
    if getattr(weight, "shared_embedding", False) or not hasattr(weight, "grad_added_to_main_grad"):
        return torch.zeros_like(weight)
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``input @ weight.T + bias`` with the column-parallel layer's input communication folded in.

    Forward: under sequence parallelism the ``[s/tp, b, h]`` input is all-gathered along dim 0 first. Only the local
    slice is saved; backward all-gathers it again for the weight gradient (saving ``tp - 1`` slices of activation
    memory, as Megatron does).
    Backward: the input gradient is reduce-scattered (sequence parallel) or all-reduced (``allreduce_dgrad``); the
    collective runs asynchronously while the weight gradient is computed. With ``gradient_accumulation_fusion`` the
    weight gradient goes straight into ``weight.main_grad``. With ``grad_output_buffer`` the output gradient is
    appended to the buffer instead of computing the weight gradient (at most ``wgrad_deferral_limit`` deferrals,
    0 = no limit), for ``drain_embedding_wgrad_compute`` to finish later.
    """

    @staticmethod
    def forward(
        ctx,
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        tp_group,
        gtp_remat_size,
    ):
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.group = tp_group
        # Only the local slice is saved; backward re-gathers it (see the class docstring).
        ctx.save_for_backward(input, weight)
        total_input = _gather_along_first_dim(input, tp_group) if sequence_parallel else input
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        group = ctx.group
        # False for a weight that does not require grad: skip its GEMM.
        wgrad_compute = ctx.needs_input_grad[1]
        buffer = ctx.grad_output_buffer
        if wgrad_compute and buffer is not None:
            if not ctx.wgrad_deferral_limit or len(buffer) < ctx.wgrad_deferral_limit:
                buffer.append(grad_output)
                wgrad_compute = False
        total_input, gather_work = input_, None
        if ctx.sequence_parallel and wgrad_compute:
            # Started before the input-gradient GEMM so the two overlap.
            total_input, gather_work = _start_gather_along_first_dim(input_, group)
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if gather_work is not None:
            gather_work.wait()  # the re-gather of the input overlapped the input-gradient GEMM

        reduce_work = None
        # Forward gathered the sequence, so its gradient is summed and split back to this rank's [s/tp] slice.
        if grad_input is not None and ctx.sequence_parallel:
            grad_input, reduce_work = _start_reduce_scatter_along_first_dim(grad_input, group)
        # Each rank's input gradient is partial (its output columns only): sum them over TP.
        elif grad_input is not None and ctx.allreduce_dgrad:
            reduce_work = dist.all_reduce(grad_input, group=group, async_op=True)

        grad_weight = grad_bias = None
        grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))
        if wgrad_compute:
            grad_weight = _weight_grad(ctx, weight, grad_output_2d, total_input)
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output_2d.sum(dim=0)
        if reduce_work is not None:
            reduce_work.wait()  # the input-gradient reduction overlapped the weight-gradient GEMM
        # None for the non-tensor arguments of forward.
        return (grad_input, grad_weight, grad_bias) + (None,) * 8


def _refuse_gtp(gtp_remat_size: int) -> None:
    if gtp_remat_size != 1:
        raise ValueError(f"not supported yet: GTP weight rematerialisation (gtp_remat_size={gtp_remat_size})")


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: Optional[int] = 0,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """Linear layer with the column-parallel input communication (see the autograd function above).

    ``tp_group`` defaults to this rank's tensor-parallel group. When nothing needs communicating, fusing or
    deferring, PyTorch's own linear (and backward) is used.
    """
    _refuse_gtp(gtp_remat_size)
    group = resolve_tp_group(tp_group)
    communicates = group_size(group) > 1 and (allreduce_dgrad or sequence_parallel)
    fuses = gradient_accumulation_fusion and hasattr(weight, "main_grad")
    # Nothing special to do: let PyTorch's linear and its autograd handle it.
    if not (communicates or fuses or grad_output_buffer is not None):
        return F.linear(input, weight, bias)
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad and group_size(group) > 1,
        sequence_parallel and group_size(group) > 1,
        grad_output_buffer,
        wgrad_deferral_limit,
        group,
        gtp_remat_size,
    )


class LinearWithFrozenWeight(torch.autograd.Function):
    """``input @ weight.T + bias`` for a weight that is not trained: backward computes only the input gradient
    (all-reduced over ``tp_group`` with ``allreduce_dgrad``) and never a weight or bias gradient."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.group = tp_group
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad and group_size(ctx.group) > 1:
            dist.all_reduce(grad_input, group=ctx.group)
        return grad_input, None, None, None, None


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: Optional[torch.distributed.ProcessGroup],
    grad_output_buffer: Optional[List[torch.Tensor]] = None,
    wgrad_deferral_limit: None = None,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """Drop-in for :func:`linear_with_grad_accumulation_and_async_allreduce` when the weight is frozen: no weight
    gradient is computed (saving its GEMM), so ``gradient_accumulation_fusion`` has nothing to fuse.

    Under ``sequence_parallel`` the input is all-gathered along the sequence first (its gradient reduce-scattered
    back), and the input gradient needs no all-reduce. Deferred weight gradients make no sense here:
    ``grad_output_buffer`` and ``wgrad_deferral_limit`` must be None.
    """
    _refuse_gtp(gtp_remat_size)
    if grad_output_buffer is not None or wgrad_deferral_limit is not None:
        raise ValueError(
            "linear_with_frozen_weight computes no weight gradient, so grad_output_buffer and wgrad_deferral_limit "
            "must be None"
        )
    group = resolve_tp_group(tp_group)
    if sequence_parallel and group_size(group) > 1:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=group)
        # The gather's backward reduce-scatters the input gradient, which already sums it over TP.
        allreduce_dgrad = False
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, group)


# ---- layers --------------------------------------------------------------------------------------------------------


class _EmptyExtraState:
    """An ``_extra_state`` entry, as Megatron's linear layers have, so state dicts and checkpoints carry the same
    keys as Transformer Engine layers: None, or the delayed FP8 scaling state. Checkpoints written without the entry
    still load strictly."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.setdefault(f"{prefix}_extra_state", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _ParallelLinearBase(_EmptyExtraState, _TensorParallelModule):
    """What ColumnParallelLinear and RowParallelLinear share: the FP8 extra state, no deferred weight
    gradients, their repr and their checkpoint layout. A subclass sets ``_sharded_axes`` (the TP-split axis of each
    parameter; a parameter not named is replicated) and ``_layout_flag`` (the attribute its repr shows last)."""

    _sharded_axes: dict[str, int]
    _layout_flag: str

    def __init__(self, input_size, output_size, skip_bias_add, *, config, tp_group, is_expert, stride, name):
        super().__init__()
        self.name = name
        self._setup_group(config, tp_group, is_expert)
        # Refused before any weight is allocated: the split side must divide evenly over the TP ranks.
        if self._sharded_axes["weight"] == 0:
            _check_divisible(type(self).__name__, "output_size", output_size, self.tp_size, stride)
        else:
            _check_divisible(type(self).__name__, "input_size", input_size, self.tp_size, stride)
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        self.fp8_scaling_state = delayed_scaling_state_for(config)

    def backward_dw(self) -> None:
        """Compute deferred weight gradients: none are deferred here (``delay_wgrad_compute`` is not used by these
        layers), since backward computes the weight gradient at once."""

    def get_extra_state(self) -> Optional[dict]:
        return fp8_extra_state(self)

    def set_extra_state(self, state: Any):
        """Restore the delayed FP8 scaling state, if the layer keeps one and ``state`` holds it."""
        load_fp8_extra_state(self, state)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, "
            f"tp_size={self.tp_size}, bias={self.bias is not None}, "
            f"{self._layout_flag}={getattr(self, self._layout_flag)}"
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Weight (and bias) split along ``_sharded_axes`` over the tensor-parallel group."""
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            self._sharded_axes,
            sharded_offsets,
            tp_group=self.tp_group,
        )


class ColumnParallelLinear(_ParallelLinearBase):
    """``Y = X A + b`` with ``A`` split by columns: rank r computes ``Y_r = X A_r + b_r``.

    The weight is ``[output_size / tp, input_size]`` (``partition_dim=0``). The input must be the same on every TP
    rank (its gradient is all-reduced), or, under ``config.sequence_parallel``, this rank's ``[s/tp, b, h]`` slice
    (all-gathered in forward, gradient reduce-scattered). The output is ``[..., output_size / tp]``, or the full
    ``[..., output_size]`` with ``gather_output``.

    ``forward(input_, weight=None, runtime_gather_output=None)`` returns ``(output, bias)``: ``bias`` is the bias
    parameter when ``skip_bias_add`` (the caller fuses the add) and ``None`` otherwise. With
    ``skip_weight_param_allocation`` the layer owns no weight and ``forward`` must be given one (tied output
    embeddings). ``stride`` is the number of interleaved sub-matrices the output dimension holds (2 for a fused
    SwiGLU ``[gate; up]``), so each rank keeps matching slices of each. ``disable_grad_reduce`` skips the
    input-gradient all-reduce (the caller reduces it). ``is_expert`` uses the expert tensor-parallel group and RNG
    stream; when experts are parallelised the MoE dispatcher does the communication, so the layer does none.
    ``embedding_activation_buffer`` and ``grad_output_buffer`` (deferred embedding weight gradients) are accepted
    for compatibility and unused. ``tp_comm_buffer_name`` (``qkv``, ``fc1``) names the layer for
    ``config.tp_comm_overlap`` (tensor_parallel/comm_overlap.py), which overlaps the sequence-parallel gather with
    the GEMM.
    """

    _sharded_axes = {"weight": 0, "bias": 0}
    _layout_flag = "gather_output"

    def __init__(
        self,
        input_size,
        output_size,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias=True,
        gather_output=False,
        stride=1,
        keep_master_weight_for_test=False,
        skip_bias_add=False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[List[torch.Tensor]] = None,
        grad_output_buffer: Optional[List[torch.Tensor]] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: str | None = None,
    ):
        super().__init__(
            input_size,
            output_size,
            skip_bias_add,
            config=config,
            tp_group=tp_group,
            is_expert=is_expert,
            stride=stride,
            name=name,
        )
        self.output_size_per_partition = output_size // self.tp_size
        self.gather_output = gather_output
        self.disable_grad_reduce = disable_grad_reduce
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.embedding_activation_buffer = embedding_activation_buffer
        self.grad_output_buffer = grad_output_buffer
        self.tp_comm_overlap = tp_comm_overlap_for(self, tp_comm_buffer_name, _weight_grad)
        if config.defer_embedding_wgrad_compute:
            warn_once("defer_embedding_wgrad_compute is not implemented; weight gradients are computed immediately")

        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = self._new_weight(
                (output_size, input_size), 0, init_method, stride, keep_master_weight_for_test
            )
        if bias:
            self.bias = self._new_bias(self.output_size_per_partition)
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        input_: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        runtime_gather_output: Optional[bool] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if weight is None:
            if self.weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True, "
                    "so forward() needs the weight argument"
                )
            weight = self.weight
        elif tuple(weight.shape) != (self.output_size_per_partition, self.input_size):
            raise ValueError(
                f"ColumnParallelLinear: the weight passed to forward() has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)} (output_size / tp, input_size)"
            )
        bias = None if self.skip_bias_add else self.bias

        communicates = not self.explicit_expert_comm
        if self.tp_comm_overlap is not None:
            output_parallel = _ColumnWithOverlap.apply(input_, weight, bias, self.tp_comm_overlap)
        else:
            linear = fp8_linear_for(self, _accumulate_weight_grad) or linear_with_grad_accumulation_and_async_allreduce
            output_parallel = linear(
                input_,
                weight,
                bias,
                gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                # Under sequence parallelism the reduce-scatter in backward does this reduction.
                allreduce_dgrad=communicates and not self.sequence_parallel and not self.disable_grad_reduce,
                sequence_parallel=communicates and self.sequence_parallel,
                tp_group=self.tp_group,
            )

        gather_output = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output and not self.explicit_expert_comm:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    # The methods live in _ParallelLinearBase; they are also bound here because Megatron's API lists them on
    # the class itself.
    backward_dw = _ParallelLinearBase.backward_dw
    get_extra_state = _ParallelLinearBase.get_extra_state
    set_extra_state = _ParallelLinearBase.set_extra_state
    extra_repr = _ParallelLinearBase.extra_repr
    sharded_state_dict = _ParallelLinearBase.sharded_state_dict


class RowParallelLinear(_ParallelLinearBase):
    """``Y = X A + b`` with ``A`` split by rows: rank r computes ``X_r A_r`` and the partial results are summed.

    The weight is ``[output_size, input_size / tp]`` (``partition_dim=1``). The input is this rank's
    ``[..., input_size / tp]`` slice when ``input_is_parallel`` (the output of a ColumnParallelLinear), else the full
    input, which is split here. The partial outputs are all-reduced, or, under ``config.sequence_parallel``,
    reduce-scattered along dim 0 to ``[s/tp, b, h]``. The bias (not split) is added after the reduction, or returned
    for the caller to add when ``skip_bias_add``. ``forward(input_)`` returns ``(output, bias)``.
    """

    _sharded_axes = {"weight": 1}  # the bias is not split: replicated
    _layout_flag = "input_is_parallel"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: str | None = None,
    ):
        super().__init__(
            input_size,
            output_size,
            skip_bias_add,
            config=config,
            tp_group=tp_group,
            is_expert=is_expert,
            stride=stride,
            name=name,
        )
        self.input_size_per_partition = input_size // self.tp_size
        self.input_is_parallel = input_is_parallel
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                "(the input must already be split over the tensor-parallel ranks)"
            )

        self.weight = self._new_weight((output_size, input_size), 1, init_method, stride, keep_master_weight_for_test)
        # tp_comm_buffer_name ("proj", "fc2") names the layer for config.tp_comm_overlap (comm_overlap.py).
        self.tp_comm_overlap = tp_comm_overlap_for(self, tp_comm_buffer_name, _weight_grad)
        if bias:
            self.bias = self._new_bias(output_size)
            # Under SP each rank adds the bias to its own sequence slice only, so its gradient is partial.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_is_parallel or self.explicit_expert_comm:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # No bias here: added after the reduction, it is counted once rather than tp times.
        if self.tp_comm_overlap is not None:
            output = _RowWithOverlap.apply(input_parallel, self.weight, self.tp_comm_overlap)
            return self._add_bias(output)
        # No communication in the linear itself (the reduction follows); it is plain F.linear unless the weight
        # gradient is fused.
        linear = fp8_linear_for(self, _accumulate_weight_grad) or linear_with_grad_accumulation_and_async_allreduce
        output_parallel = linear(
            input_parallel,
            self.weight,
            None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
        )
        if self.explicit_expert_comm:
            output = output_parallel
        elif self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        return self._add_bias(output)

    def _add_bias(self, output):
        if self.skip_bias_add or self.bias is None:
            return output, (self.bias if self.skip_bias_add else None)
        return output + self.bias, None

    # The methods live in _ParallelLinearBase; they are also bound here because Megatron's API lists them on
    # the class itself.
    backward_dw = _ParallelLinearBase.backward_dw
    get_extra_state = _ParallelLinearBase.get_extra_state
    set_extra_state = _ParallelLinearBase.set_extra_state
    extra_repr = _ParallelLinearBase.extra_repr
    sharded_state_dict = _ParallelLinearBase.sharded_state_dict


class VocabParallelEmbedding(_TensorParallelModule):
    """Embedding table split by vocabulary rows: rank r holds rows ``[r * V/tp, (r + 1) * V/tp)``.

    ``forward(input_)`` takes token ids ``[b, s]``. Each rank looks up the ids it owns (zeros elsewhere) and the
    partial results are all-reduced to ``[b, s, h]``; with ``reduce_scatter_embeddings`` they are instead
    reduce-scattered into the sequence-parallel layout ``[s/tp, b, h]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: Callable,
        reduce_scatter_embeddings: bool = False,
        config: ModelParallelConfig,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__()
        self._setup_group(config, tp_group, is_expert=False)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, self.tp_rank, self.tp_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = self._new_weight((num_embeddings, embedding_dim), 0, init_method, 1, False)

    def forward(self, input_):
        if self.tp_size > 1:
            not_here = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            # Ids owned elsewhere look up row 0 and are zeroed, so the sum over TP keeps only the owner's row.
            local_ids = (input_ - self.vocab_start_index).masked_fill(not_here, 0)
            output_parallel = F.embedding(local_ids, self.weight).masked_fill(not_here.unsqueeze(-1), 0.0)
        else:
            output_parallel = F.embedding(input_, self.weight)

        if self.reduce_scatter_embeddings:
            # [b, s, h] -> [s, b, h], then each rank keeps the summed rows of its slice of the sequence.
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp_size={self.tp_size}"

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: Tuple[Tuple[int, int, int]] = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """The table split along the vocabulary axis (0); a checkpoint with a differently padded vocabulary still
        loads (``allow_shape_mismatch``)."""
        key = f"{prefix}weight"
        return {
            key: make_tp_sharded_tensor_for_checkpoint(
                self.weight,
                key,
                allow_shape_mismatch=True,
                prepend_offsets=sharded_offsets,
                tp_group=self.tp_group,
            )
        }

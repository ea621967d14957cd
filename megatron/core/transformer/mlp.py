"""The transformer MLP: column-parallel fc1, activation (optionally gated: SwiGLU), row-parallel fc2."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.fusions.kernel_dispatch import fallback_notice
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import sharded_state_dict_default


class LinearFc1Interface(Protocol):
    """What MLP needs of its fc1: ``(output, bias)`` from the input, and ``backward_dw`` for deferred wgrad."""

    def forward(self, hidden_states: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def backward_dw(self) -> None: ...


class LinearFc1Builder(Protocol):
    """How MLP builds fc1 (ColumnParallelLinear fits)."""

    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        tp_group: torch.distributed.ProcessGroup | None,
        stride: int = 1,
    ) -> LinearFc1Interface: ...


class LinearFc2Interface(Protocol):
    """What MLP needs of its fc2."""

    def forward(self, hidden_states: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def backward_dw(self) -> None: ...


class LinearFc2Builder(Protocol):
    """How MLP builds fc2 (RowParallelLinear fits)."""

    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        tp_group: torch.distributed.ProcessGroup | None,
    ) -> LinearFc2Interface: ...


class TEActivationFunctionInterface(Protocol):
    """An activation module (Transformer Engine's fused activations)."""

    def forward(self, input_: torch.Tensor, /) -> torch.Tensor: ...


class TEActivationFunctionBuilder(Protocol):
    """How MLP builds ``submodules.activation_func`` when ``config.use_te_activation_func`` is set."""

    def __call__(self, *, config: TransformerConfig) -> TEActivationFunctionInterface: ...


@dataclass
class MLPSubmodules:
    """fc1 and fc2 builders, and an optional activation module (used only with ``config.use_te_activation_func``;
    otherwise ``config.activation_func`` is applied)."""

    linear_fc1: LinearFc1Builder
    linear_fc2: LinearFc2Builder
    activation_func: TEActivationFunctionBuilder | None = None


class MLP(MegatronModule):
    """``fc2(act(fc1(x)))``, or ``fc2(act(a) * b)`` with ``[a; b] = fc1(x)`` for a gated linear unit.

    Returns ``(output, bias)`` with fc2's bias unapplied (for the bias-dropout-add). For a gated unit fc1 is
    built with ``stride=2``, so tensor-parallel rank r holds ``[a_r; b_r]`` while the full weight is ``[a; b]``:
    the same model for every tensor-parallel size. ``tp_group`` defaults to parallel_state's tensor-parallel group;
    ``name`` is the module's dotted name in the model, handed down for logging.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
        name: str | None = None,
    ):
        super().__init__(config)
        self.name = name
        self.input_size = input_size or config.hidden_size
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        gated = config.gated_linear_unit
        self.tp_group = tp_group if tp_group is not None else tp_group_or_default(None)
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            self.input_size,
            ffn_hidden_size * 2 if gated else ffn_hidden_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            stride=2 if gated else 1,
            is_expert=is_expert,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        if config.use_te_activation_func and submodules.activation_func is not None:
            self.activation_func = submodules.activation_func(config=config)
        else:
            self.activation_func = config.activation_func
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            ffn_hidden_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=is_expert,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )
        self.checkpoint_mlp = config.recompute_granularity == "selective" and "mlp" in config.recompute_modules
        self.fused_activation = self._select_fused_activation(config) if config.bias_activation_fusion else None

    def _select_fused_activation(self, config: TransformerConfig):
        """The fused bias + activation for ``bias_activation_fusion``: SwiGLU (gated SiLU) or GeLU; None, with one
        notice, for an activation that has no fused kernel (the unfused code computes it)."""
        if isinstance(self.activation_func, torch.nn.Module):
            return None  # Transformer Engine's activation module fuses on its own
        if config.gated_linear_unit and self.activation_func is F.silu:
            return bias_swiglu_impl
        if not config.gated_linear_unit and self.activation_func is F.gelu:
            return bias_gelu_impl
        name = getattr(self.activation_func, "__name__", repr(self.activation_func))
        kind = "gated " if config.gated_linear_unit else ""
        fallback_notice(
            "bias_activation_fusion",
            f"no fused kernel for the {kind}activation {name} (only SwiGLU and GeLU have one); running the unfused "
            "activation. Pass --no-bias-gelu-fusion (bias_activation_fusion=False) to silence this",
        )
        return None

    @classmethod
    def as_mlp_submodule(
        cls,
        submodules: MLPSubmodules,
        config: TransformerConfig,
        pg_collection: ProcessGroupCollection,
        is_mtp_layer: bool,
        is_expert: bool = False,
        input_size: int | None = None,
        ffn_hidden_size: int | None = None,
        name: str | None = None,
    ) -> MLP:
        """Build the MLP of a TransformerLayer from the layer's process groups (its tensor-parallel group).
        ``is_mtp_layer`` makes no difference to a dense MLP."""
        return cls(
            config,
            submodules,
            is_expert=is_expert,
            input_size=input_size,
            ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group_or_default(pg_collection),
            name=name,
        )

    def _activation(self, intermediate: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fused_activation is not None:
            return self.fused_activation(intermediate, bias)
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.gated_linear_unit and not isinstance(self.activation_func, torch.nn.Module):
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.activation_func(gate) * up
        # An activation module (Transformer Engine's) applies the gate itself.
        return self.activation_func(intermediate)

    def _forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None):
        intermediate, bias = self.linear_fc1(hidden_states)
        intermediate = self._activation(intermediate, bias)
        if per_token_scale is None:
            return self.linear_fc2(intermediate)
        # Expert MLPs weight each token by its routing probability; fc2 is linear, so scaling its input scales the
        # output, and its bias is added here, scaled the same way, instead of by the bias-dropout-add.
        intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(intermediate.dtype)
        output, output_bias = self.linear_fc2(intermediate)
        if output_bias is not None:
            output_bias = bias_on_first_tensor_parallel_rank(output_bias, self.linear_fc2)
            output = output + (output_bias * per_token_scale.unsqueeze(-1)).to(output.dtype)
        return output, None

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        """``(output, bias)``; ``per_token_scale [tokens]`` weights each token's activation (MoE experts).
        Other keyword arguments a layer hands every MLP (such as ``padding_mask``) do not affect a dense MLP."""
        if self.checkpoint_mlp and self.training:
            # Recompute only what is computed from the input: fc2's bias is a parameter and a checkpointed function
            # must not hand a parameter back as its output, so the bias goes back outside the checkpoint.
            output = tensor_parallel.checkpoint(lambda x: self._forward(x, per_token_scale)[0], False, hidden_states)
            return output, (self.linear_fc2.bias if per_token_scale is None else None)
        return self._forward(hidden_states, per_token_scale)

    def backward_dw(self):
        """Run the weight-gradient computations fc2 and fc1 deferred (``delay_wgrad_compute``), in that order;
        layers that never defer them (this project's) have nothing to run."""
        for linear in (self.linear_fc2, self.linear_fc1):
            if hasattr(linear, "backward_dw"):
                linear.backward_dw()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """fc1 split by columns, fc2 by rows; a gated fc1 is stored as its two global halves ``[gate; up]`` (or as
        two tensors ``<key>_w`` / ``<key>_v`` with ``metadata['singleton_local_shards']``)."""
        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        sharded_state_dict = {}
        for name, module in self.named_children():
            module_state = sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
            if name == "linear_fc1" and self.config.gated_linear_unit:
                for key in (f"{prefix}{name}.weight", f"{prefix}{name}.bias"):
                    if key in module_state:
                        module_state[key] = apply_swiglu_sharded_factory(
                            module_state[key], sharded_offsets, singleton_local_shards, tp_group=self.tp_group
                        )
            sharded_state_dict.update(module_state)
        return sharded_state_dict


def bias_on_first_tensor_parallel_rank(bias: torch.Tensor, linear) -> torch.Tensor:
    """The bias of a row-parallel expert linear whose partial outputs the MoE dispatcher sums over the expert
    tensor-parallel group: only rank 0 adds its value (or it would be counted once per rank), while every rank
    still receives the bias's full gradient, so the replicated copies stay equal."""
    if getattr(linear, "tp_size", 1) > 1 and getattr(linear, "tp_rank", 0) != 0:
        return bias - bias.detach()
    return bias


def apply_swiglu_sharded_factory(
    original_sh_ten,
    sharded_offsets,
    singleton_local_shards: bool = False,
    tp_group: torch.distributed.ProcessGroup | None = None,
    dp_group: torch.distributed.ProcessGroup | None = None,
):
    """Store a gated fc1 weight or bias as the global ``[gate; up]`` rather than as tensor-parallel pieces.

    TP rank r of t holds ``[gate_r; up_r]`` (fc1 is built with stride 2), which is not one contiguous piece of the
    global tensor: it is pieces r and t + r of 2t along axis 0. The factory saves the two halves as those pieces and
    concatenates them again on load, so the checkpoint reshards to any TP size. With ``singleton_local_shards`` the
    halves are instead two tensors of their own, ``<key>_w`` (gate) and ``<key>_v`` (up), each split over TP. With a
    ``flattened_range`` (the distributed optimizer's flat shard of the local tensor) the range is split where the
    gate half ends. The TP rank comes from the ShardedTensor's offsets; ``tp_group`` and ``dp_group`` only matter to
    Megatron for FSDP-sharded parameters, which this project does not build.
    """
    axis = len(sharded_offsets)
    local_shape = tuple(original_sh_ten.local_shape)
    tp_rank = original_sh_ten.global_offset[axis] // local_shape[0]
    tp_size = original_sh_ten.axis_fragmentations[axis]
    half_shape = (local_shape[0] // 2, *local_shape[1:])
    half_numel = math.prod(half_shape)
    if singleton_local_shards:
        gate_offset = up_offset = (axis, tp_rank, tp_size)
    else:
        gate_offset = (axis, tp_rank, 2 * tp_size)
        up_offset = (axis, tp_size + tp_rank, 2 * tp_size)

    def half_keys(key):
        return (f"{key}_w", f"{key}_v") if singleton_local_shards else (key, key)

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        common = dict(replica_id=replica_id, prepend_axis_num=axis)
        gate_key, up_key = half_keys(key)
        if flattened_range is None:
            gate, up = torch.chunk(data, 2, dim=0)
            return {
                "gate": ShardedTensor.from_rank_offsets(gate_key, gate, *sharded_offsets, gate_offset, **common),
                "up": ShardedTensor.from_rank_offsets(up_key, up, *sharded_offsets, up_offset, **common),
            }
        start, stop = flattened_range.start, flattened_range.stop
        pieces = {}
        if start < half_numel:
            gate_stop = min(stop, half_numel)
            pieces["gate"] = ShardedTensor.from_rank_offsets_flat(
                gate_key,
                data[: gate_stop - start],
                half_shape,
                *sharded_offsets,
                gate_offset,
                flattened_range=slice(start, gate_stop),
                **common,
            )
        if stop > half_numel:
            up_start = max(start, half_numel)
            pieces["up"] = ShardedTensor.from_rank_offsets_flat(
                up_key,
                data[up_start - start :],
                half_shape,
                *sharded_offsets,
                up_offset,
                flattened_range=slice(up_start - half_numel, stop - half_numel),
                **common,
            )
        return pieces

    @torch.no_grad()
    def merge(loaded_pieces):
        return torch.cat([loaded_pieces[half] for half in ("gate", "up") if half in loaded_pieces])

    return ShardedTensorFactory(
        original_sh_ten.key,
        original_sh_ten.data,
        build,
        merge,
        original_sh_ten.replica_id,
        flattened_range=original_sh_ten.flattened_range,
    )

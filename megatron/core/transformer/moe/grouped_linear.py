"""Grouped linear layers for the grouped-GEMM experts: one weight per local expert (``weight0``, ``weight1``, ...,
the parameter names of Transformer Engine's GroupedLinear), applied to each expert's contiguous rows of the input.

The GEMMs run as one ``torch._grouped_mm`` where the build has it and the shapes meet its alignment rules (16-byte
row strides, fp32/bf16/fp16), else as one batched matmul over the rows padded to the busiest expert; both give the
same result as running each expert's linear separately. Weights are split over the expert tensor-parallel group
like ColumnParallelLinear / RowParallelLinear, and the MoE dispatcher does all communication (the layers do none).
"""

from __future__ import annotations

import re
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parameter import Parameter

from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import group_rank, group_size, resolve_tp_group
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.tensor_parallel.sharded_state import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_current_device

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EXTRA_STATE_OF_EXPERT = re.compile(r"_extra_state\d+$")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (``_grouped_mm``'s backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _grouped_mm_fits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in _GROUPED_MM_DTYPES or weights.dtype != x.dtype:
        return False
    alignment = 16 // x.element_size()
    return x.shape[-1] % alignment == 0 and weights.shape[-1] % alignment == 0


def grouped_matmul(x: torch.Tensor, weights: List[torch.Tensor], tokens_per_expert: List[int]) -> torch.Tensor:
    """``cat_i(x_i @ weights[i].T)`` where ``x_i`` are consecutive blocks of ``tokens_per_expert[i]`` rows."""
    stacked = torch.stack([w.t() for w in weights])  # [experts, in, out]
    if x.shape[0] == 0:
        return x.new_zeros((0, stacked.shape[-1])) + 0 * stacked.sum()
    if _grouped_mm_fits(x, stacked):
        offsets = torch.tensor(tokens_per_expert, device=x.device, dtype=torch.int64).cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), stacked.contiguous(), offs=offsets))
    blocks = torch.split(x, tokens_per_expert, dim=0)
    padded = torch.nn.utils.rnn.pad_sequence(list(blocks), batch_first=True)  # [experts, busiest, in]
    products = torch.bmm(padded, stacked)
    return torch.cat([products[i, :count] for i, count in enumerate(tokens_per_expert)], dim=0)


class _GroupedLinear(torch.nn.Module):
    """``num_gemms`` weights ``[output / tp, input]`` (column) or ``[output, input / tp]`` (row) and optional biases.

    ``forward(x, tokens_per_expert)`` returns ``(output, per-row bias)``: the bias of each row's expert, for the
    caller to add (the experts weigh fc2's bias by the routing probability). Parameters carry ``allreduce=False``:
    their gradients are reduced over the expert data-parallel group.
    """

    partition_dim = 0

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool = True,
        is_expert: bool = True,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group: Optional[dist.ProcessGroup] = None,
        stride: int = 1,
    ):
        super().__init__()
        self.config = config
        self.num_gemms = num_gemms
        self.input_size, self.output_size = input_size, output_size
        self.init_method = init_method
        self.stride = stride
        self.is_expert = is_expert
        self.skip_bias_add = skip_bias_add
        self.tp_group = resolve_tp_group(tp_group, is_expert=True)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        split = input_size if self.partition_dim == 1 else output_size
        if split % (self.tp_size * stride) != 0:
            raise ValueError(
                f"{type(self).__name__}: {'input' if self.partition_dim else 'output'}_size={split} is not divisible "
                f"by the expert tensor-parallel size {self.tp_size} x stride {stride}; choose moe_ffn_hidden_size "
                "divisible by expert_tensor_parallel_size"
            )
        local_shape = [output_size, input_size]
        local_shape[self.partition_dim] //= self.tp_size
        device = get_current_device()
        self.use_bias = bias
        for i in range(num_gemms):
            weight = Parameter(torch.empty(local_shape, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(weight, True, self.partition_dim, stride)
            weight.allreduce = False
            self.register_parameter(f"weight{i}", weight)
            if bias:
                bias_param = Parameter(torch.zeros(local_shape[0], dtype=config.params_dtype, device=device))
                set_tensor_model_parallel_attributes(bias_param, self.partition_dim == 0, 0, stride)
                bias_param.allreduce = False
                self.register_parameter(f"bias{i}", bias_param)

    def weights(self) -> List[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> List[torch.Tensor]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int]):
        output = grouped_matmul(x, self.weights(), tokens_per_expert)
        if not self.use_bias:
            return output, None
        counts = torch.tensor(tokens_per_expert, device=x.device)
        per_row_bias = torch.repeat_interleave(torch.stack(self.biases()), counts, dim=0)
        return output, per_row_bias

    def backward_dw(self) -> None:
        """No weight gradient is deferred (``delay_wgrad_compute`` is not built)."""

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        """The extra state is always empty."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Experts 1.. have their own (empty) extra-state entries in checkpoints, as Transformer Engine writes them.
        for key in [k for k in state_dict if k.startswith(prefix) and _EXTRA_STATE_OF_EXPERT.match(k[len(prefix) :])]:
            state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(
        self,
        prefix="",
        sharded_offsets=(),
        metadata=None,
        *,
        expert_offset: int = 0,
        num_global_experts: Optional[int] = None,
        gated: bool = False,
    ):
        """Each local expert's weight (bias, extra state) under the single key ``{prefix}weight`` with an expert
        axis in front of the tensor axes, at the expert's global index ``expert_offset + i``; dict keys stay the
        parameter names (``weight{i}``; ``_extra_state``, ``_extra_state1``, ...)."""
        num_global_experts = num_global_experts or self.num_gemms
        axis_map = {"weight": self.partition_dim}
        if self.partition_dim == 0:
            axis_map["bias"] = 0
        singleton = (metadata or {}).get("singleton_local_shards", False)
        result = {}
        for i in range(self.num_gemms):
            offsets = (*sharded_offsets, (len(sharded_offsets), expert_offset + i, num_global_experts))
            local = {"weight": getattr(self, f"weight{i}"), "_extra_state": self.get_extra_state()}
            if self.use_bias:
                local["bias"] = getattr(self, f"bias{i}")
            pieces = make_sharded_tensors_for_checkpoint(local, prefix, axis_map, offsets, tp_group=self.tp_group)
            if gated:
                for name in ("weight", "bias"):
                    if f"{prefix}{name}" in pieces:
                        pieces[f"{prefix}{name}"] = apply_swiglu_sharded_factory(
                            pieces[f"{prefix}{name}"], offsets, singleton, tp_group=self.tp_group
                        )
            result[f"{prefix}weight{i}"] = pieces[f"{prefix}weight"]
            if self.use_bias:
                result[f"{prefix}bias{i}"] = pieces[f"{prefix}bias"]
            result[f"{prefix}_extra_state{'' if i == 0 else i}"] = pieces[f"{prefix}_extra_state"]
        return result


class ColumnParallelGroupedLinear(_GroupedLinear):
    """Grouped fc1: each expert's weight split by output rows over the expert tensor-parallel group."""

    partition_dim = 0


class RowParallelGroupedLinear(_GroupedLinear):
    """Grouped fc2: each expert's weight split by input columns; outputs are partial sums the dispatcher adds up.
    The bias is not split (every expert tensor-parallel rank holds it)."""

    partition_dim = 1

"""The transformer MLP: column-parallel fc1, activation (optionally gated: SwiGLU), row-parallel fc2."""

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.process_groups_config import ProcessGroupCollection, tp_group_or_default
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import sharded_state_dict_default


@dataclass
class MLPSubmodules:
    linear_fc1: Union[ModuleSpec, type] = None
    linear_fc2: Union[ModuleSpec, type] = None


class MLP(MegatronModule):
    """``fc2(act(fc1(x)))``, or ``fc2(act(a) * b)`` with ``[a; b] = fc1(x)`` for a gated linear unit.

    Returns ``(output, bias)`` with fc2's bias unapplied (for the bias-dropout-add). For a gated unit fc1 is
    built with ``stride=2``, so tensor-parallel rank r holds ``[a_r; b_r]`` while the full weight is ``[a; b]``:
    the same model for every tensor-parallel size.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        is_expert: bool = False,
        input_size: Optional[int] = None,
        ffn_hidden_size: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config)
        self.input_size = input_size or config.hidden_size
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        gated = config.gated_linear_unit
        tp_group = tp_group_or_default(pg_collection)
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
            tp_group=tp_group,
        )
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
            tp_group=tp_group,
        )
        self.checkpoint_mlp = config.recompute_granularity == "selective" and "mlp" in config.recompute_modules

    def _activation(self, intermediate: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.config.activation_func(gate) * up
        return self.config.activation_func(intermediate)

    def _forward(self, hidden_states: torch.Tensor):
        intermediate, bias = self.linear_fc1(hidden_states)
        return self.linear_fc2(self._activation(intermediate, bias))

    def forward(self, hidden_states: torch.Tensor, per_token_scale=None):
        if self.checkpoint_mlp and self.training:
            # Recompute only what is computed from the input: fc2's bias is a parameter and a checkpointed function
            # must not hand a parameter back as its output, so the bias goes back outside the checkpoint.
            output = tensor_parallel.checkpoint(lambda x: self._forward(x)[0], False, hidden_states)
            return output, self.linear_fc2.bias
        return self._forward(hidden_states)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """fc1 split by columns, fc2 by rows; a gated fc1 is stored as its two global halves ``[gate; up]``."""
        sharded_state_dict = {}
        for name, module in self.named_children():
            module_state = sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
            if name == "linear_fc1" and self.config.gated_linear_unit:
                for key in (f"{prefix}{name}.weight", f"{prefix}{name}.bias"):
                    if key in module_state:
                        module_state[key] = apply_swiglu_sharded_factory(module_state[key], sharded_offsets)
            sharded_state_dict.update(module_state)
        return sharded_state_dict


def apply_swiglu_sharded_factory(original_sh_ten: ShardedTensor, sharded_offsets: tuple = ()) -> ShardedTensorFactory:
    """Store a gated fc1 weight or bias as the global ``[gate; up]`` rather than as tensor-parallel pieces.

    TP rank r of t holds ``[gate_r; up_r]`` (fc1 is built with stride 2), which is not one contiguous piece of the
    global tensor: it is pieces r and t + r of 2t along axis 0. The factory saves the two halves as those pieces and
    concatenates them again on load, so the checkpoint reshards to any TP size. With a ``flattened_range`` (the
    distributed optimizer's flat shard of the local tensor) the range is split where the gate half ends.
    """
    axis = len(sharded_offsets)
    local_shape = tuple(original_sh_ten.local_shape)
    tp_rank = original_sh_ten.global_offset[axis] // local_shape[0]
    tp_size = original_sh_ten.axis_fragmentations[axis]
    half_shape = (local_shape[0] // 2, *local_shape[1:])
    half_numel = math.prod(half_shape)
    gate_offset = (axis, tp_rank, 2 * tp_size)
    up_offset = (axis, tp_size + tp_rank, 2 * tp_size)

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        common = dict(replica_id=replica_id, prepend_axis_num=axis)
        if flattened_range is None:
            gate, up = torch.chunk(data, 2, dim=0)
            return {
                "gate": ShardedTensor.from_rank_offsets(key, gate, *sharded_offsets, gate_offset, **common),
                "up": ShardedTensor.from_rank_offsets(key, up, *sharded_offsets, up_offset, **common),
            }
        start, stop = flattened_range.start, flattened_range.stop
        pieces = {}
        if start < half_numel:
            gate_stop = min(stop, half_numel)
            pieces["gate"] = ShardedTensor.from_rank_offsets_flat(
                key, data[: gate_stop - start], half_shape, *sharded_offsets, gate_offset,
                flattened_range=slice(start, gate_stop), **common,
            )
        if stop > half_numel:
            up_start = max(start, half_numel)
            pieces["up"] = ShardedTensor.from_rank_offsets_flat(
                key, data[up_start - start :], half_shape, *sharded_offsets, up_offset,
                flattened_range=slice(up_start - half_numel, stop - half_numel), **common,
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

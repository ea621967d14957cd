"""The transformer MLP: column-parallel fc1, activation (optionally gated: SwiGLU), row-parallel fc2."""

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, tp_group_or_default
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


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

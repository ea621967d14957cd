"""Shared experts: a dense MLP every token goes through besides its routed experts (DeepSeek-MoE, Qwen-MoE),
of hidden size ``moe_shared_expert_intermediate_size``, optionally scaled by a learned sigmoid gate per token."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch

from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.tensor_parallel.sharded_state import make_sharded_tensor_for_checkpoint
from megatron.core.utils import get_current_device


class SharedExpertMLP(MLP):
    """An ordinary tensor-parallel MLP (sequence-parallel like the dense MLP) whose output, with ``gate``, is
    multiplied by ``sigmoid(x @ gate_weight.T)``. ``gate_weight`` ``[1, hidden]`` sees only this rank's slice of
    the sequence under SP, so it carries ``sequence_parallel`` like the router."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        gate: bool,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: str | None = None,
    ):
        shared_config = copy.copy(config)
        shared_config.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        super().__init__(
            shared_config,
            submodules,
            ffn_hidden_size=config.moe_shared_expert_intermediate_size,
            tp_group=tp_group_or_default(pg_collection),
            name=name,
        )
        self.use_shared_expert_gate = gate
        if gate:
            weight = torch.empty((1, config.hidden_size), dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(weight)
            self.gate_weight = torch.nn.Parameter(weight.to(device=get_current_device(), dtype=config.params_dtype))
            self.gate_weight.sequence_parallel = config.sequence_parallel
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The shared experts' output for ``hidden_states`` (fc2's bias added, then the gate)."""
        output, bias = super().forward(hidden_states)
        if bias is not None:
            output = output + bias
        if self.use_shared_expert_gate:
            output = output * torch.sigmoid(torch.nn.functional.linear(hidden_states, self.gate_weight))
        return output

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """The MLP's sharded state plus ``gate_weight``, replicated."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.use_shared_expert_gate:
            key = f"{prefix}gate_weight"
            sharded_state_dict[key] = make_sharded_tensor_for_checkpoint(
                self.gate_weight,
                key,
                prepend_offsets=sharded_offsets,
                tp_group=self.tp_group,
                dp_cp_group=(metadata or {}).get("dp_cp_group"),
            )
        return sharded_state_dict

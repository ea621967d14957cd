"""The routed experts of an MoE layer: this rank's ``num_moe_experts / ep`` experts, each an MLP of hidden size
``moe_ffn_hidden_size`` split over the expert tensor-parallel group.

* :class:`SequentialMLP` keeps one :class:`MLP` per local expert (``local_experts.<i>.linear_fc1/fc2``) and runs
  them one after another.
* :class:`TEGroupedMLP` keeps the experts' weights in two grouped linears (``linear_fc1.weight<i>``, the names of
  Transformer Engine's grouped layers) and runs each projection as one grouped GEMM. Same weights, same results,
  same checkpoint keys (``mlp.experts.experts.linear_fc1.weight``).

Both take the dispatcher's ``(tokens grouped by local expert, tokens_per_expert, per-token probs)`` and weigh each
token's output by its probability. Weights are drawn per global expert index (see :func:`expert_init_stream`), so
a model has the same experts whatever the EP layout; checkpoints store each expert at its global index.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import _EXPERT_PARALLEL_RNG_TRACKER_NAME, get_cuda_rng_tracker
from megatron.core.transformer.mlp import MLP, MLPSubmodules, bias_on_first_tensor_parallel_rank
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import layout_independent_init

# Expert e of a layer draws from (the layer's seed + STRIDE * (e + 1)); the stride exceeds any layer count, so no
# two (layer, expert) pairs and no layer share a stream.
_EXPERT_STREAM_STRIDE = 100_003


def expert_init_stream(config: TransformerConfig, global_expert_index: int):
    """With ``use_cpu_initialization``, the weights built inside draw from global expert ``global_expert_index``'s
    own CPU stream (inside the layer's stream), so an expert's weights do not depend on which EP rank builds it."""
    return layout_independent_init(config, stream_offset=_EXPERT_STREAM_STRIDE * (global_expert_index + 1))


def _expert_groups(pg_collection: Optional[ProcessGroupCollection]):
    if pg_collection is None:
        pg_collection = get_default_pg_collection()
    ep_group, expt_tp, expt_dp = pg_collection.ep, pg_collection.expt_tp, getattr(pg_collection, "expt_dp", None)
    ep_size = 1 if ep_group is None else ep_group.size()
    ep_rank = 0 if ep_group is None else ep_group.rank()
    return ep_size, ep_rank, expt_tp, expt_dp


def _mark_expert_parameters(module: torch.nn.Module) -> None:
    """Expert gradients are reduced over the expert data-parallel group (``allreduce=False``), never over TP."""
    for param in module.parameters():
        param.allreduce = False
        param.sequence_parallel = False


def _expert_config(config: TransformerConfig) -> TransformerConfig:
    """The config an expert MLP is built with: ``ffn_hidden_size = moe_ffn_hidden_size``."""
    expert_config = copy.copy(config)
    expert_config.ffn_hidden_size = config.moe_ffn_hidden_size
    return expert_config


def _set_expert_data_parallel_replica(sharded_state_dict: dict, expt_dp_group) -> None:
    """Experts are replicated over the expert data-parallel group, not the dense one: its rank 0 saves them."""
    dp_rank = 0 if expt_dp_group is None else expt_dp_group.rank()
    for value in sharded_state_dict.values():
        if isinstance(value, (ShardedTensor, ShardedObject, ShardedTensorFactory)):
            replica_id = value.replica_id
            value.replica_id = (*replica_id[:2], dp_rank)


class SequentialMLP(MegatronModule):
    """One :class:`MLP` per local expert, run in turn on its block of rows."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: str | None = None,
    ):
        super().__init__(config=config)
        self.name = name
        self.num_local_experts = num_local_experts
        self.ep_size, ep_rank, self.tp_group, self.expt_dp_group = _expert_groups(pg_collection)
        self.local_expert_offset = ep_rank * num_local_experts
        expert_config = _expert_config(config)
        self.local_experts = torch.nn.ModuleList()
        for i in range(num_local_experts):
            with expert_init_stream(config, self.local_expert_offset + i):
                self.local_experts.append(
                    MLP(
                        expert_config,
                        submodules,
                        is_expert=True,
                        ffn_hidden_size=config.moe_ffn_hidden_size,
                        tp_group=self.tp_group,
                    )
                )
        _mark_expert_parameters(self)

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ):
        """``(output, None)``: each expert's rows through its MLP, weighted by their probabilities."""
        hidden, probs = _probs_on_input(self.config, permuted_local_hidden_states, permuted_probs)
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        outputs = []
        for expert, tokens, token_probs in zip(
            self.local_experts, torch.split(hidden, counts), torch.split(probs, counts)
        ):
            output, _ = expert(tokens, per_token_scale=token_probs)
            outputs.append(output)
        return torch.cat(outputs, dim=0), None

    def backward_dw(self):
        """Deferred weight gradients of every expert (none are deferred here)."""
        for expert in self.local_experts:
            expert.backward_dw()

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Every local expert under ``{prefix}experts.`` with an expert axis at its global index (so
        ``mlp.experts.experts.linear_fc1.weight`` is ``[layers, experts, ...]``), saved by expert-DP rank 0."""
        num_global_experts = self.ep_size * self.num_local_experts
        sharded_state_dict = {}
        for i, expert in enumerate(self.local_experts):
            offsets = (*sharded_offsets, (len(sharded_offsets), self.local_expert_offset + i, num_global_experts))
            local_prefix = f"{prefix}local_experts.{i}."
            expert_state = expert.sharded_state_dict(local_prefix, offsets, metadata)
            replace_prefix_for_sharding(expert_state, local_prefix, f"{prefix}experts.")
            _set_expert_data_parallel_replica(expert_state, self.expt_dp_group)
            sharded_state_dict.update(expert_state)
        return sharded_state_dict


def _probs_on_input(config: TransformerConfig, hidden: torch.Tensor, probs: torch.Tensor):
    """With ``moe_apply_probs_on_input`` (top-1 routing) the probability scales the expert's input instead."""
    if not config.moe_apply_probs_on_input:
        return hidden, probs
    return (hidden * probs.unsqueeze(-1)).to(hidden.dtype), torch.ones_like(probs)


class GroupedLinearFc1Interface(Protocol):
    """What TEGroupedMLP needs of its fc1: ``(output, per-row bias)`` from the grouped input."""

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: list[int], /
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def backward_dw(self) -> None: ...


class GroupedLinearFc1Builder(Protocol):
    """How TEGroupedMLP builds fc1 (ColumnParallelGroupedLinear fits)."""

    def __call__(self, num_gemms: int, input_size: int, output_size: int, /, **kwargs) -> GroupedLinearFc1Interface: ...


class GroupedLinearFc2Interface(Protocol):
    """What TEGroupedMLP needs of its fc2."""

    def forward(
        self, intermediate_parallel: torch.Tensor, tokens_per_expert: list[int], /
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def backward_dw(self) -> None: ...


class GroupedLinearFc2Builder(Protocol):
    """How TEGroupedMLP builds fc2 (RowParallelGroupedLinear fits)."""

    def __call__(self, num_gemms: int, input_size: int, output_size: int, /, **kwargs) -> GroupedLinearFc2Interface: ...


@dataclass
class GroupedMLPSubmodules:
    """fc1 and fc2 grouped-linear builders; the activation module is unused (``config.activation_func`` is
    applied)."""

    linear_fc1: GroupedLinearFc1Builder
    linear_fc2: GroupedLinearFc2Builder
    activation_func: object = None


class TEGroupedMLP(MegatronModule):
    """The local experts as two grouped linears: one grouped GEMM per projection for all experts."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: GroupedMLPSubmodules,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: str | None = None,
    ):
        super().__init__(config=config)
        self.name = name
        self.num_local_experts = num_local_experts
        self.ep_size, ep_rank, self.tp_group, self.expt_dp_group = _expert_groups(pg_collection)
        self.local_expert_offset = ep_rank * num_local_experts
        ffn = config.moe_ffn_hidden_size
        self.gated = config.gated_linear_unit
        common = dict(
            config=config, bias=config.add_bias_linear, skip_bias_add=True, is_expert=True, tp_group=self.tp_group
        )
        self.linear_fc1 = build_module(
            submodules.linear_fc1,
            num_local_experts,
            config.hidden_size,
            ffn * 2 if self.gated else ffn,
            init_method=config.init_method,
            stride=2 if self.gated else 1,
            tp_comm_buffer_name="fc1",
            **common,
        )
        self.linear_fc2 = build_module(
            submodules.linear_fc2,
            num_local_experts,
            ffn,
            config.hidden_size,
            init_method=config.output_layer_init_method,
            tp_comm_buffer_name="fc2",
            **common,
        )
        self.activation_func = config.activation_func
        if config.perform_initialization:
            self._initialize_expert_weights()
        _mark_expert_parameters(self)

    @torch.no_grad()
    def _initialize_expert_weights(self) -> None:
        """Draw each expert's fc1 then fc2 exactly as an expert MLP of SequentialMLP does (the full weight on the
        CPU from the expert's stream, then this rank's tensor-parallel slice), so both modules build the same
        experts; without CPU initialisation each rank draws its own slices from the expert-parallel RNG stream."""
        for i in range(self.num_local_experts):
            fc1, fc2 = getattr(self.linear_fc1, f"weight{i}"), getattr(self.linear_fc2, f"weight{i}")
            if self.config.use_cpu_initialization:
                with expert_init_stream(self.config, self.local_expert_offset + i):
                    full_fc1 = _draw(self.linear_fc1)
                    full_fc2 = _draw(self.linear_fc2)
                fc1.copy_(_this_rank_slice(full_fc1, self.linear_fc1))
                fc2.copy_(_this_rank_slice(full_fc2, self.linear_fc2))
            else:
                with get_cuda_rng_tracker().fork(_EXPERT_PARALLEL_RNG_TRACKER_NAME):
                    self.linear_fc1.init_method(fc1)
                    self.linear_fc2.init_method(fc2)

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = torch.chunk(intermediate, 2, dim=-1)
            return self.activation_func(gate) * up
        return self.activation_func(intermediate)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
        output_buffer: Optional[torch.Tensor] = None,
        grad_input_buffer: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output, None)`` for the grouped rows; the buffers (Megatron's preallocated output / gradient
        memory for its fused kernels) are not used."""
        hidden, probs = _probs_on_input(self.config, permuted_local_hidden_states, permuted_probs)
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        intermediate, fc1_bias = self.linear_fc1(hidden, counts)
        if fc1_bias is not None:
            intermediate = intermediate + fc1_bias
        intermediate = self._activation(intermediate)
        scale = probs.unsqueeze(-1)
        intermediate = (intermediate * scale).to(intermediate.dtype)
        output, fc2_bias = self.linear_fc2(intermediate, counts)
        if fc2_bias is not None:
            # fp32 routing probabilities must not promote the expert output (bf16 / fp16 models).
            output = output + (bias_on_first_tensor_parallel_rank(fc2_bias, self.linear_fc2) * scale).to(output.dtype)
        return output, None

    def backward_dw(self):
        """Deferred weight gradients (none are deferred here)."""
        self.linear_fc2.backward_dw()
        self.linear_fc1.backward_dw()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """``{prefix}experts.linear_fc1.weight`` / ``experts.linear_fc2.weight`` with an expert axis at each
        expert's global index, saved by expert-DP rank 0: the keys and shapes of :class:`SequentialMLP`, as Megatron's
        TEGroupedMLP writes them, so grouped and per-expert checkpoints load into each other. Dict keys stay the
        grouped linears' parameter names (``linear_fc1.weight0``, ...)."""
        num_global_experts = self.ep_size * self.num_local_experts
        sharded_state_dict = {}
        for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2)):
            pieces = linear.sharded_state_dict(
                f"{prefix}{name}.",
                sharded_offsets,
                metadata,
                expert_offset=self.local_expert_offset,
                num_global_experts=num_global_experts,
                gated=self.gated and name == "linear_fc1",
            )
            replace_prefix_for_sharding(pieces, f"{prefix}{name}.", f"{prefix}experts.{name}.")
            _set_expert_data_parallel_replica(pieces, self.expt_dp_group)
            sharded_state_dict.update(pieces)
        return sharded_state_dict


def _draw(linear) -> torch.Tensor:
    master = torch.empty(linear.output_size, linear.input_size, dtype=torch.float32)
    linear.init_method(master)
    return master


def _this_rank_slice(master: torch.Tensor, linear) -> torch.Tensor:
    """Rank r's blocks r, r + tp, ... of the partition dimension cut into ``stride * tp`` blocks (the layout
    ColumnParallelLinear / RowParallelLinear give a full weight)."""
    dim, tp = linear.partition_dim, linear.tp_size
    blocks = torch.chunk(master, linear.stride * tp, dim=dim)
    return torch.cat(blocks[linear.tp_rank :: tp], dim=dim).to(linear.config.params_dtype)


class InferenceGroupedMLP(TEGroupedMLP):
    """The grouped experts for inference: the same computation, also accepting a dense routing map (unused)."""

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: Optional[torch.Tensor],
        permuted_probs: torch.Tensor,
        routing_map: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)

"""MoELayer: the mixture-of-experts MLP of a transformer layer.

``route -> dispatch -> routed experts -> combine`` (plus the shared experts), with input and output
``[s(/tp), b, hidden]`` like the dense MLP, so a layer spec swaps one for the other. The experts apply their biases
and routing probabilities themselves, so the returned bias is always None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoEFlexTokenDispatcher,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

_MOE_GROUPS = ("ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp")


class RouterInterface(Protocol):
    """What MoELayer needs of its router: ``(probs, routing_map)`` ``[tokens, experts]`` for the input."""

    def forward(self, input: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]: ...

    def set_layer_number(self, layer_number: int) -> None: ...


class RouterBuilder(Protocol):
    """How MoELayer builds its router (TopKRouter fits)."""

    def __call__(
        self, *, config: TransformerConfig, pg_collection: ProcessGroupCollection | None, is_mtp_layer: bool
    ) -> RouterInterface: ...


class ExpertsInterface(Protocol):
    """What MoELayer needs of its experts: ``(output, bias)`` for the grouped tokens."""

    def forward(
        self, dispatched_input: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, /
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def backward_dw(self) -> None: ...


class ExpertsBuilder(Protocol):
    """How MoELayer builds its experts (SequentialMLP / TEGroupedMLP fit)."""

    def __call__(
        self, num_local_experts: int, /, *, config: TransformerConfig, pg_collection: ProcessGroupCollection | None
    ) -> ExpertsInterface: ...


class SharedExpertsInterface(Protocol):
    """What MoELayer needs of its shared experts: their output for the layer's input."""

    def forward(self, hidden_states: torch.Tensor, /) -> torch.Tensor: ...

    def backward_dw(self) -> None: ...


class SharedExpertsBuilder(Protocol):
    """How MoELayer builds its shared experts (SharedExpertMLP fits)."""

    def __call__(
        self, *, config: TransformerConfig, pg_collection: ProcessGroupCollection | None, gate: bool
    ) -> SharedExpertsInterface: ...


@dataclass
class MoESubmodules:
    """The MoE layer's experts (required), shared experts (optional) and router."""

    experts: Union[ModuleSpec, type, ExpertsBuilder]
    shared_experts: Union[ModuleSpec, type, SharedExpertsBuilder, None] = None
    router: Union[ModuleSpec, type, RouterBuilder] = TopKRouter


def _complete_pg_collection(pg_collection: Optional[ProcessGroupCollection]) -> ProcessGroupCollection:
    """``pg_collection`` with every group an MoE layer uses; missing ones come from parallel_state."""
    if pg_collection is None:
        return get_default_pg_collection()
    if all(getattr(pg_collection, name) is not None for name in _MOE_GROUPS):
        return pg_collection
    defaults = get_default_pg_collection()
    present = {name: getattr(pg_collection, name) for name in (*_MOE_GROUPS, "pp", "dp", "dp_cp")}
    present = {name: group for name, group in present.items() if group is not None}
    return ProcessGroupCollection(**{**{n: getattr(defaults, n) for n in _MOE_GROUPS}, **present})


class BaseMoELayer(MegatronModule):
    """What every MoE layer has: its process groups, the experts this expert-parallel rank holds
    (``local_expert_indices``: global indices ``ep_rank * n .. ep_rank * n + n - 1``) and its layer number."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
    ):
        super().__init__(config)
        self.pg_collection = _complete_pg_collection(pg_collection)
        self.ep_group = self.pg_collection.ep
        self.tp_group = self.pg_collection.tp
        self.expert_parallel_size = 1 if self.ep_group is None else self.ep_group.size()
        ep_rank = 0 if self.ep_group is None else self.ep_group.rank()
        if config.num_moe_experts % self.expert_parallel_size != 0:
            raise ValueError(
                f"num_moe_experts={config.num_moe_experts} is not divisible by the expert-parallel size "
                f"{self.expert_parallel_size}; choose expert_model_parallel_size dividing the number of experts"
            )
        self.num_local_experts = config.num_moe_experts // self.expert_parallel_size
        first = ep_rank * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.is_mtp_layer = is_mtp_layer
        self.router = None
        self.experts = None
        self.shared_experts = None
        self.token_dispatcher = None
        self.layer_number = layer_number

    def forward(self, hidden_states):
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def set_layer_number(self, layer_number: int):
        """The layer's global 1-based number (the transformer layer sets it; the router logs losses under it)."""
        self.layer_number = layer_number
        if self.router is not None:
            self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    """Router, token dispatcher (``moe_token_dispatcher_type``), routed experts and optional shared experts.

    With ``moe_layer_recompute`` (or ``recompute_modules`` holding ``"moe"`` under selective recompute, Megatron's
    newer spelling) the whole layer is recomputed in backward (its dispatch communication included);
    the router then attaches its losses and counts its tokens during the recomputation only.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
        name: str | None = None,
    ):
        if submodules is None:
            raise ValueError(
                "MoELayer needs submodules (MoESubmodules with at least the experts); use "
                "megatron.core.models.gpt.moe_module_specs.get_moe_module_spec()"
            )
        super().__init__(
            config=config, layer_number=layer_number, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer
        )
        self.name = name
        self.submodules = submodules
        self.moe_layer_recompute = config.moe_layer_recompute or (
            config.recompute_granularity == "selective" and "moe" in config.recompute_modules
        )
        pg = self.pg_collection
        self.router = build_module(submodules.router, config=config, pg_collection=pg, is_mtp_layer=is_mtp_layer)
        self.router.set_layer_number(layer_number)
        dispatcher_class = {
            "allgather": MoEAllGatherTokenDispatcher,
            "alltoall": MoEAlltoAllTokenDispatcher,
            "flex": MoEFlexTokenDispatcher,
        }.get(config.moe_token_dispatcher_type)
        if dispatcher_class is None:
            raise ValueError(
                f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r} is not one of 'allgather', "
                "'alltoall', 'flex'"
            )
        self.token_dispatcher = dispatcher_class(
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg
        )
        self.experts = build_module(submodules.experts, self.num_local_experts, config=config, pg_collection=pg)
        if config.moe_shared_expert_intermediate_size is not None and submodules.shared_experts is not None:
            self.shared_experts = build_module(
                submodules.shared_experts, config=config, pg_collection=pg, gate=config.moe_shared_expert_gate
            )
            self.token_dispatcher.set_shared_experts(self.shared_experts)

    # The steps, in the order forward runs them; each is public as in Megatron, for schedules that interleave them.

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """``(probs, routing_map)`` for ``hidden_states`` ``[s, b, h]``; ``padding_mask`` ``[b, s]`` (True =
        padding, the whole sequence even under sequence parallelism) keeps padding out of the losses."""
        if padding_mask is not None:
            padding_mask = self._local_padding_mask(padding_mask, hidden_states.shape[0])
        return self.router(hidden_states, padding_mask=padding_mask)

    def _local_padding_mask(self, padding_mask: torch.Tensor, local_seq: int) -> torch.Tensor:
        mask = padding_mask.transpose(0, 1).bool()
        if mask.shape[0] != local_seq:  # sequence parallelism: this rank's slice
            rank = self.tp_group.rank()
            mask = mask[rank * local_seq : (rank + 1) * local_seq]
        return mask

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """The dispatcher's local preparation: ``(tokens, probs)`` ready to send."""
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def router_and_preprocess(self, hidden_states: torch.Tensor):
        """Route (without a padding mask) and prepare: ``(tokens, probs, residual)``, the residual being the
        unchanged input."""
        probs, routing_map = self.route(hidden_states)
        tokens, probs = self.preprocess(hidden_states, probs, routing_map)
        return tokens, probs, hidden_states

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send the tokens to their experts' ranks."""
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """The shared experts' output (None without shared experts)."""
        if self.shared_experts is None:
            return None
        return self.shared_experts(hidden_states)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Sort the received tokens by local expert, run the experts, and prepare their output for combining:
        ``(output, bias)``."""
        dispatched_input, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs
        )
        expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert, permuted_probs)
        return self.token_dispatcher.combine_preprocess(expert_output), mlp_bias

    def combine(self, output: torch.Tensor):
        """Bring the experts' outputs back to the ranks that own the tokens."""
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        """Restore ``[s, b, h]`` and add the shared experts' output."""
        output = self.token_dispatcher.combine_postprocess(output)
        if shared_expert_output is not None:
            output = output + shared_expert_output
        return output

    def _forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        tokens, probs = self.preprocess(hidden_states, probs, routing_map)
        tokens, probs = self.dispatch(tokens, probs)
        output, _ = self.routed_experts_compute(tokens, probs)
        return self.postprocess(self.combine(output), shared_expert_output)

    def forward(
        self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output, None)`` for ``hidden_states`` ``[s(/tp), b, h]``. ``intermediate_tensors`` (the partial
        CUDA-graph capture of Megatron) is not supported and must be None."""
        if intermediate_tensors is not None:
            raise ValueError("MoELayer: intermediate_tensors (partial CUDA-graph capture) is not supported")
        # As in Megatron, only training is refused: without SP every TP rank routes and computes the same tokens
        # (the result is right, the work repeated TP times), which evaluation and inference accept.
        if self.training and self.tp_group.size() > 1 and not self.config.sequence_parallel:
            raise ValueError(
                f"MoELayer: training with tensor_model_parallel_size={self.tp_group.size()} needs sequence "
                "parallelism; set sequence_parallel=True (--sequence-parallel), or call model.eval() to evaluate "
                "or generate without it"
            )
        if self.moe_layer_recompute and self.training:
            if padding_mask is None:
                output = tensor_parallel.checkpoint(lambda x: self._forward(x, None), False, hidden_states)
            else:
                output = tensor_parallel.checkpoint(self._forward, False, hidden_states, padding_mask)
        else:
            output = self._forward(hidden_states, padding_mask)
        return output, None

    def backward_dw(self, routed_experts: bool = True, shared_experts: bool = False):
        """Run deferred weight-gradient work of the routed and/or shared experts (none is deferred here)."""
        if routed_experts:
            self.experts.backward_dw()
        if shared_experts and self.shared_experts is not None:
            self.shared_experts.backward_dw()

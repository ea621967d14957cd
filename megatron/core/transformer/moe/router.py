"""The MoE router: a linear gate scoring every expert for every token, top-k selection, capacity, and the
load-balancing losses (aux_loss, seq_aux_loss, global_aux_loss, z-loss) put into the backward pass.

Naming as in Megatron: ``logits`` come out of the gate; ``scores`` are what experts are chosen by and what the
aux losses use; ``probs`` weigh the chosen experts' outputs; ``routing_map`` says which experts each token goes to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Union

import torch

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_random_logits,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_default_pg_collection,
    get_tokens_per_expert_and_token_count,
    router_gating_linear,
    save_to_aux_losses_tracker,
    sinkhorn,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


class Router(ABC, MegatronModule):
    """The gate ``[experts, hidden]`` (fp32 at creation, then ``params_dtype``), replicated on every rank.

    Under sequence parallelism each tensor-parallel rank routes only its slice of the sequence, so the weight is
    marked ``sequence_parallel`` and its gradient is summed over TP by finalize_model_grads.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
    ) -> None:
        super().__init__(config)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self.num_experts = config.num_moe_experts
        self.layer_number = None
        self.is_mtp_layer = is_mtp_layer
        self.tp_group = getattr(pg_collection, "tp", None)
        self.cp_group = getattr(pg_collection, "cp", None)
        self.tp_cp_group = getattr(pg_collection, "tp_cp", None)
        self.tp_dp_cp_group = getattr(pg_collection, "tp_dp_cp", None)
        # Drawn on the CPU (as Megatron does), so the gate is the same whatever device the model is built on.
        self.weight = torch.nn.Parameter(torch.empty((self.num_experts, config.hidden_size), dtype=torch.float32))
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32))
        else:
            self.bias = None
        # With per-token loss the gradients are divided by the global token count, so aux losses are scaled up.
        self.calculate_per_token_loss = config.calculate_per_token_loss
        self.reset_parameters()

    def reset_parameters(self):
        """Draw the gate from ``config.init_method`` (the default stream: the same on every rank), then cast."""
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
            if self.bias is not None:
                self.config.init_method(self.bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.data = param.data.to(device=get_current_device(), dtype=self.config.params_dtype)
                param.sequence_parallel = self.config.sequence_parallel

    def gating(self, input: torch.Tensor):
        """Logits ``[..., experts]``, computed in ``moe_router_dtype`` (the input's dtype when unset)."""
        router_dtype = _ROUTER_DTYPES[self.config.moe_router_dtype] or input.dtype
        return router_gating_linear(input, self.weight, self.bias, router_dtype)

    @abstractmethod
    def routing(self, logits: torch.Tensor):
        """``(probs, routing_map)`` from the logits."""

    @abstractmethod
    def forward(self, input: torch.Tensor):
        """Route ``input``."""

    def set_layer_number(self, layer_number: int):
        """The global (1-based) number of the layer this router belongs to, for loss logging."""
        self.layer_number = layer_number


class TopKRouter(Router):
    """Route each token to its top-k experts.

    (1) logits from the gate (after optional input jitter and z-loss); (2) probs and map from the score function
    (softmax / sigmoid / sqrtsoftplus, pre-softmax, group-limited choice, scaling, expert bias), or Sinkhorn;
    (3) optional capacity and token dropping; (4) in training, the configured load-balancing losses attached to the
    probs through :class:`MoEAuxLossAutoScaler`; (5) with ``moe_router_enable_expert_bias`` the token counts that
    finalize_model_grads turns into the next bias update.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.input_jitter = None
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        device = get_current_device()
        if self.enable_expert_bias:
            # Counts are per step and not saved; the bias is model state (fp32 whatever the params' dtype).
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32, device=device))
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None
        if self.get_aux_loss_coeff("global_aux_loss") > 0:
            self.register_buffer(
                "global_tokens_per_expert",
                torch.zeros(self.num_experts, dtype=torch.float32, device=device),
                persistent=False,
            )
            self.register_buffer("ga_steps", torch.tensor(0.0, device=device), persistent=False)
        else:
            self.global_tokens_per_expert = None
            self.ga_steps = None

    def _maintain_float32_expert_bias(self):
        # A Float16Module casts buffers too; the bias must stay fp32 or small updates are lost.
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)

    def sinkhorn_load_balancing(self, logits: torch.Tensor):
        """Sinkhorn routing: in training the experts are chosen from the Sinkhorn-normalised logits; the
        probabilities are sigmoid (k = 1) or softmax of the logits, kept for the chosen experts."""

        def activation(values):
            if self.topk == 1:
                return torch.sigmoid(values)
            return torch.softmax(values, dim=-1, dtype=torch.float32).type_as(values)

        if self.training:
            # The choice is not differentiated; gradients reach the gate through activation(logits) below.
            with torch.no_grad():
                # In fp32: Sinkhorn exponentiates the logits, and exp() overflows fp16 beyond about 11.
                _, indices = torch.topk(sinkhorn(logits.to(dtype=torch.float32)), k=self.topk, dim=1)
            scores = activation(logits)
        else:
            scores = activation(logits)
            _, indices = torch.topk(scores, k=self.topk, dim=1)
        # Experts not chosen for a token get probability 0.
        routing_map = torch.zeros_like(scores, dtype=torch.int32).scatter(1, indices, 1).bool()
        return scores * routing_map, routing_map

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        """The coefficient of load-balancing type ``aux_loss_type`` (0 when it is not configured);
        ``moe_router_load_balancing_type`` may list several types with one coefficient each."""
        if isinstance(self.routing_type, str):
            return self.config.moe_aux_loss_coeff if self.routing_type == aux_loss_type else 0.0
        if aux_loss_type in self.routing_type:
            return self.config.moe_aux_loss_coeff[self.routing_type.index(aux_loss_type)]
        return 0.0

    def is_aux_loss_enabled(self) -> bool:
        """Whether any of aux_loss / seq_aux_loss / global_aux_loss has a positive coefficient."""
        return any(self.get_aux_loss_coeff(kind) > 0 for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"))

    def _apply_aux_loss(self, probs, scores, routing_map, with_padding_mask):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        # Summed over TP x CP: those ranks hold slices of the same sequences, so the loss sees their whole load.
        tokens_per_expert, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_cp_group, topk=self.topk, with_padding_mask=with_padding_mask
        )
        aux_loss = switch_load_balancing_loss_func(
            scores, tokens_per_expert, total_tokens, self.topk, self.num_experts, coeff
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group, valid_token_count=local_tokens
        )

    def _apply_seq_aux_loss(self, probs, scores, routing_map, seq_length, bsz, with_padding_mask):
        """Per-sequence aux loss: tokens are ``[s, b]``-ordered, so viewing them as ``[s, b * experts]`` makes each
        (sequence, expert) pair its own column; the switch loss of that view is the sum of the per-sequence losses,
        divided by the batch size for their mean."""
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        scores = scores.reshape(seq_length, -1)
        routing_map = routing_map.reshape(seq_length, -1)
        tokens_per_expert, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_cp_group, topk=self.topk * bsz, with_padding_mask=with_padding_mask
        )
        aux_loss = (
            switch_load_balancing_loss_func(scores, tokens_per_expert, total_tokens, self.topk, self.num_experts, coeff)
            / bsz
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group, valid_token_count=local_tokens
        )

    def _apply_global_aux_loss(self, probs, scores, routing_map, with_padding_mask):
        """Global-batch aux loss (arXiv 2501.11873): expert loads counted over TP x DP x CP and averaged over the
        micro-batches of the step so far."""
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert, local_tokens, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_dp_cp_group, topk=self.topk, with_padding_mask=with_padding_mask
        )
        # Accumulated over the step's micro-batches; finalize_model_grads resets it (reset_global_aux_loss_tracker).
        self.global_tokens_per_expert += tokens_per_expert
        self.ga_steps += 1
        averaged = self.global_tokens_per_expert / self.ga_steps
        aux_loss = switch_load_balancing_loss_func(scores, averaged, total_tokens, self.topk, self.num_experts, coeff)
        return self.attach_and_log_load_balancing_loss(
            probs,
            coeff,
            aux_loss,
            "global_load_balancing_loss",
            self.tp_dp_cp_group,
            # The counts already span the DP ranks, so logging must not average over DP again.
            needs_dp_avg=False,
            valid_token_count=local_tokens,
        )

    def _num_layers_for_logging(self) -> int:
        return self.config.num_layers + (self.config.mtp_num_layers or 0)

    def attach_and_log_load_balancing_loss(
        self,
        activation: torch.Tensor,
        aux_loss_coeff: float,
        aux_loss: torch.Tensor,
        aux_loss_name: str,
        reduce_group: torch.distributed.ProcessGroup,
        needs_dp_avg: bool = True,
        valid_token_count: Union[int, torch.Tensor, None] = None,
    ):
        """Record ``aux_loss / coeff`` for logging and return ``activation`` with ``aux_loss`` attached to its
        backward. With per-token loss normalisation the gradients are later divided by the global token count, so
        the loss is multiplied by this rank's tokens times the TP x CP size, which cancels that division."""
        save_to_aux_losses_tracker(
            aux_loss_name,
            aux_loss / aux_loss_coeff,
            self.layer_number,
            self._num_layers_for_logging(),
            reduce_group=reduce_group,
            reduce_group_has_dp=not needs_dp_avg,
        )
        if self.calculate_per_token_loss:
            tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
            tp_cp = 1 if self.tp_cp_group is None else self.tp_cp_group.size()
            return MoEAuxLossAutoScaler.apply(activation, aux_loss * tokens * tp_cp)
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)

    def apply_z_loss(self, logits, padding_mask: Optional[torch.Tensor] = None):
        """In training, attach ST-MoE's z-loss of the logits (coefficient divided by the TP x CP size: each of
        those ranks holds a slice of the sequence and the slices' losses are summed)."""
        # Without gradients (evaluation, inference) there is nothing to attach the loss to.
        if self.config.moe_z_loss_coeff is None or not (self.training and torch.is_grad_enabled()):
            return logits
        tp_cp = 1 if self.tp_cp_group is None else self.tp_cp_group.size()
        coeff = self.config.moe_z_loss_coeff / tp_cp
        z_loss = z_loss_func(logits, coeff, padding_mask=padding_mask)
        if self.calculate_per_token_loss:
            tokens = (~padding_mask).sum() if padding_mask is not None else logits.shape[0]
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss * tokens * tp_cp)
        else:
            logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        # Each TP x CP rank holds the mean over its own equal slice: their average is the whole sequence's z-loss
        # (Megatron logs one rank's slice).
        save_to_aux_losses_tracker(
            "z_loss", z_loss / coeff, self.layer_number, self._num_layers_for_logging(), avg_group=self.tp_cp_group
        )
        return logits

    def apply_input_jitter(self, input: torch.Tensor):
        """Multiply the input by uniform noise in ``[1 - eps, 1 + eps]`` (Switch Transformer), ``eps =
        moe_input_jitter_eps``; unchanged when unset."""
        eps = self.config.moe_input_jitter_eps
        if eps is None:
            return input
        if self.input_jitter is None:
            self.input_jitter = torch.distributions.uniform.Uniform(
                torch.tensor(1.0 - eps, dtype=input.dtype, device=input.device),
                torch.tensor(1.0 + eps, dtype=input.dtype, device=input.device),
            ).rsample
        return input * self.input_jitter(input.shape)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        # Counted only when gradients flow: not in evaluation and not again when a recomputation replays forward.
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask).unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def quantile_balancing(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantile balancing is not built; ``moe_router_load_balancing_type='quantile_balancing'`` is refused by
        the config, so this is never reached from a valid model."""
        raise ValueError("not supported yet: moe_router_load_balancing_type='quantile_balancing'")

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """``(probs, routing_map)``, each ``[tokens, experts]``, from logits ``[s, b, experts]``; ``padding_mask``
        ``[s, b]`` (True = padding) keeps padding out of the losses and counts."""
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.num_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        # On the raw logits, before any scoring or top-k.
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        if self.routing_type == "sinkhorn":
            probs, routing_map = self.sinkhorn_load_balancing(logits)
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits,
                self.topk,
                use_pre_softmax=self.config.moe_router_pre_softmax,
                num_groups=self.config.moe_router_num_groups,
                group_topk=self.config.moe_router_group_topk,
                scaling_factor=self.config.moe_router_topk_scaling_factor,
                score_function=self.score_function,
                expert_bias=self.expert_bias,
                fused=self.config.moe_router_fusion,
            )
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs,
                routing_map,
                router_topk=self.topk,
                capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity,
            )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            # Losses use scores over all experts, free of expert bias and group limits, as in Megatron.
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=self.config.moe_router_fusion, padding_mask=padding_mask
            )
            padded = padding_mask is not None
            probs = self._apply_aux_loss(probs, aux_scores, aux_map, padded)
            probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, padded)
            probs = self._apply_global_aux_loss(probs, aux_scores, aux_map, padded)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map

    def reset_global_aux_loss_tracker(self):
        """Start a new step's global expert-load count (finalize_model_grads calls this)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """``(probs, routing_map)`` ``[tokens, experts]`` for ``input`` ``[s, b, hidden]``."""
        self._maintain_float32_expert_bias()
        input = self.apply_input_jitter(input)
        logits = self.gating(input)
        if self.config.moe_router_force_load_balancing:
            logits = apply_random_logits(logits)
        return self.routing(logits, padding_mask=padding_mask)

    def _load_from_state_dict(self, *args, **kwargs):
        self._maintain_float32_expert_bias()
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args, **kwargs):
        self._maintain_float32_expert_bias()
        return super()._save_to_state_dict(*args, **kwargs)


class InferenceTopKRouter(TopKRouter):
    """A top-k router for inference: no losses, no dropping, no bias counting; returns dense
    ``(probs [tokens, topk], expert indices [tokens, topk])``. In training mode it routes like TopKRouter."""

    def __init__(
        self,
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
        is_mtp_layer: bool = False,
    ) -> None:
        if config.moe_router_num_groups is not None:
            raise ValueError(
                f"InferenceTopKRouter needs moe_router_num_groups=None, got {config.moe_router_num_groups}; use "
                "TopKRouter for group-limited routing"
            )
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        if self.training:
            return super().forward(input, padding_mask)
        logits = self.gating(input).reshape(-1, self.num_experts)
        return topk_routing_with_score_function(
            logits,
            self.topk,
            use_pre_softmax=self.config.moe_router_pre_softmax,
            scaling_factor=self.config.moe_router_topk_scaling_factor,
            score_function=self.score_function,
            expert_bias=self.expert_bias,
            dense_output=True,
        )

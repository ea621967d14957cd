"""Pieces the MoE layer is built from: routing scores and top-k, load-balancing losses, capacity and token dropping,
token permutation, the aux-loss scaler and the aux-loss logging tracker.

Formulas are those of Megatron-Core 0.19 (Switch Transformer's load-balancing loss, ST-MoE's z-loss, DeepSeek's
group-limited routing and aux-loss-free bias update). Everything here is PyTorch and runs on every device. The
``fused`` arguments (Transformer Engine kernels in Megatron) select our own: ``moe_router_fusion`` routes through
``megatron.core.fusions.fused_moe_router`` and ``moe_permute_fusion`` permutes through
``megatron.core.fusions.fused_moe_permute``, Triton kernels where they can run (CUDA) and the PyTorch code below
elsewhere (docs/kernels.md). The load-balancing loss and ``sort_chunks_by_idxs`` have nothing to fuse here (a column
sum and a scale; chunk copies), so ``fused=True`` runs the same PyTorch code.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.transformer_config import TransformerConfig

if TYPE_CHECKING:
    import wandb
    from torch.utils.tensorboard import SummaryWriter


# ---- load-balancing losses -----------------------------------------------------------------------------------


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss ``E * sum_i f_i * P_i`` times the coefficient.

    ``f_i = tokens_per_expert[i] / (T * topk)`` is the share of routed slots expert i received and
    ``P_i = sum_x probs[x, i] / T`` its mean router probability, ``T = total_num_tokens``. ``probs`` may hold only
    this rank's tokens while ``tokens_per_expert`` and ``T`` count the whole sequence (sequence / context
    parallelism): the per-rank losses then add up to the loss of the whole sequence. ``padding_mask`` (True = a
    real token) zeroes the probabilities of padding.
    """
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    summed_probs = probs.sum(dim=0)
    # E * sum_i f_i * P_i with f_i = n_i / (T * k) and P_i = (sum of probs)_i / T, folded into one factor.
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(summed_probs * tokens_per_expert) * scale


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits)^2``, times the coefficient.
    ``padding_mask`` (True = padding) leaves padding tokens out of the mean."""
    # logsumexp, not log(sum(exp)): large logits would overflow exp.
    squared = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        return squared.mean() * z_loss_coeff
    valid = (~padding_mask).to(squared.dtype)
    return (squared * valid).sum() / valid.sum().clamp(min=1.0) * z_loss_coeff


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Sinkhorn normalisation of ``exp(cost)`` ([tokens, experts]) towards uniform row and column sums, iterated
    until the column scaling changes by less than ``tol`` on average (used to pick experts, not as probabilities)."""
    cost = torch.exp(cost)
    row_scale = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    col_scale = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    error = 1e9
    previous = col_scale
    while error > tol:
        row_scale = (1.0 / row_scale.size(0)) / (torch.sum(col_scale * cost, 1) + eps)
        col_scale = (1.0 / col_scale.size(0)) / (torch.sum(row_scale.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(previous - col_scale))
        previous = col_scale
    return col_scale * cost * row_scale.unsqueeze(1)


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None) -> int:
    """Tokens each expert may take: ``ceil(num_tokens / num_experts * capacity_factor)``, at least
    ``min_capacity``."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def get_tokens_per_expert_and_token_count(
    routing_map: torch.Tensor,
    reduce_group: Union[dist.ProcessGroup, List[dist.ProcessGroup]],
    topk: int = None,
    with_padding_mask: bool = False,
) -> torch.Tensor:
    """``(tokens per expert summed over reduce_group, local token count, total token count)``.

    ``reduce_group`` is one group or a list reduced over in turn (the ranks holding pieces of the same sequences:
    TP x CP). With ``with_padding_mask`` the routing map already excludes padding, so the counts are derived from
    it (``routed slots / topk``); otherwise they are the number of rows times the group sizes.
    """
    groups = reduce_group if isinstance(reduce_group, list) else [reduce_group]
    local_tokens_per_expert = routing_map.sum(dim=0)
    global_tokens_per_expert = local_tokens_per_expert
    for group in groups:
        global_tokens_per_expert = reduce_from_tensor_model_parallel_region(global_tokens_per_expert, group)
    if with_padding_mask:
        return global_tokens_per_expert, local_tokens_per_expert.sum() / topk, global_tokens_per_expert.sum() / topk
    local_num_tokens = routing_map.shape[0]
    total_num_tokens = local_num_tokens
    for group in groups:
        # Every rank of a group holds the same number of rows, so the total is local times the group sizes.
        total_num_tokens *= 1 if group is None else group.size()
    return global_tokens_per_expert, local_num_tokens, total_num_tokens


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Put an auxiliary loss into the backward pass without changing the forward value.

    ``MoEAuxLossAutoScaler.apply(activation, aux_loss)`` returns ``activation``; in backward ``aux_loss`` receives
    the gradient ``main_loss_backward_scale`` (what the main loss's gradient was scaled by: the grad scaler's scale
    divided by the number of micro-batches, set by the schedule through :meth:`set_loss_scale`), so the aux loss is
    optimised as if it had been added to the loss.
    """

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            # No schedule set a scale (e.g. a bare forward/backward): the aux loss gets gradient 1.
            scale = torch.tensor(1.0, device=aux_loss.device)
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        # The activation's gradient passes through; the aux loss gets d(scaled loss)/d(aux_loss) = scale.
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.device)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the gradient the aux losses receive (it must match the main loss's backward scale)."""
        # One value, whatever shape it comes in ([] or [1]), so later calls can copy into the stored tensor.
        scale = torch.as_tensor(scale).detach().reshape(())
        if MoEAuxLossAutoScaler.main_loss_backward_scale is None:
            # Own copy: later set_loss_scale calls copy_ into it and must not write into the caller's tensor.
            MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().clone()
        else:
            MoEAuxLossAutoScaler.main_loss_backward_scale.copy_(scale)


# ---- routing -------------------------------------------------------------------------------------------------


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int, group_topk: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k inside the ``group_topk`` best of ``num_groups`` equal groups of experts (device- or node-limited
    routing, DeepSeek-V2/V3): a group's score is the sum of its ``topk // group_topk`` highest expert scores.
    Returns ``(top scores, expert indices)``, each ``[num_tokens, topk]``."""
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
    # -inf keeps experts of unchosen groups out of the final top-k.
    masked_scores = scores.masked_fill(~expert_mask.reshape(num_tokens, -1).bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)


def _score(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits.float()).sqrt()
    raise ValueError(
        f"moe_router_score_function must be 'softmax', 'sigmoid' or 'sqrtsoftplus', got {score_function!r}"
    )


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    score_function: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    fused: bool = False,
    router_replay: Optional["RouterReplay"] = None,  # noqa: F821 (routing replay is not built)
    dense_output: bool = False,
    precomputed_indices: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routing probabilities and map ``[tokens, experts]`` (or ``[tokens, topk]`` probs and indices with
    ``dense_output``) from the router logits ``[tokens, experts]``.

    softmax: top-k of the logits, then softmax over the k (``use_pre_softmax``: softmax over all experts, then
    top-k). sigmoid / sqrtsoftplus: top-k of the scores (plus ``expert_bias`` for the choice only, aux-loss-free
    balancing), normalised to sum 1 when k > 1. ``num_groups`` / ``group_topk`` limit the choice to the best groups;
    ``scaling_factor`` multiplies the probabilities; ``precomputed_indices`` fixes the chosen experts. Scores are
    computed in fp32; probabilities come back in the logits' dtype.
    """
    if router_replay is not None:
        raise ValueError("routing replay (router_replay) is not supported yet; leave moe_enable_routing_replay off")
    if logits.dim() != 2:
        raise ValueError(
            f"topk_routing_with_score_function expects [tokens, experts] logits, got {tuple(logits.shape)}"
        )
    if fused:
        if precomputed_indices is not None:
            raise ValueError("precomputed_indices are not supported with moe_router_fusion (as in Megatron)")
        from megatron.core.fusions import fused_moe_router

        if fused_moe_router.router_kernel_available(logits, group_topk, dense_output):
            return fused_moe_router.fused_topk_with_score_function(
                logits, topk, use_pre_softmax, scaling_factor, score_function, expert_bias
            )
    num_tokens, num_experts = logits.shape

    def choose(scores):
        if precomputed_indices is not None:
            return torch.gather(scores, 1, precomputed_indices), precomputed_indices
        if group_topk:
            return group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            probs, top_indices = choose(torch.softmax(logits, dim=-1, dtype=torch.float32))
        else:
            top_logits, top_indices = choose(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        scores = _score(logits, score_function)
        if expert_bias is not None:
            # The bias only steers which experts are chosen; the weights below use the unbiased scores.
            _, top_indices = choose(scores + expert_bias.float())
            top_scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            top_scores, top_indices = choose(scores)
        # The epsilon guards a row whose chosen scores are all zero.
        probs = top_scores / (top_scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top_scores
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    if dense_output:
        return probs, top_indices
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(
    logits: torch.Tensor,
    topk: int,
    score_function: str,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(routing map, scores)`` the load-balancing losses use: scores normalised over all experts (softmax, or
    sigmoid / sqrtsoftplus divided by their sum) and the top-k map of those scores, without expert bias or groups.
    ``padding_mask`` (True = padding) zeroes padding rows."""
    routing_map = None
    if fused:
        from megatron.core.fusions import fused_moe_router

        if fused_moe_router.router_kernel_available(logits):
            routing_map, scores = fused_moe_router.fused_compute_score_for_moe_aux_loss(logits, topk, score_function)
    if routing_map is None:
        if score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = _score(logits, score_function)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        _, top_indices = torch.topk(scores, k=topk, dim=1)
        routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, top_indices, 1).bool()
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map = routing_map & valid
        scores = scores * valid
    return routing_map, scores


def apply_router_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Enforce each expert's capacity ``get_capacity(tokens * topk, experts, capacity_factor)`` on this rank's
    tokens. ``drop_policy='probs'`` keeps each expert's highest-probability tokens, ``'position'`` its earliest.
    With ``pad_to_capacity`` every expert gets exactly ``capacity`` rows (the kept tokens plus zero-probability
    fillers), so the dispatch has fixed shapes. Returns ``(probs, map)``."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    # An expert can then take every token, so nothing is dropped.
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map, dtype=torch.bool)
    else:
        if drop_policy == "probs":
            # Along dim 0: each expert (column) keeps its own top-capacity tokens.
            _, kept_rows = torch.topk(routing_probs, k=capacity, dim=0, sorted=False)
        elif drop_policy == "position":
            # A stable sort of each 0/1 column keeps the earliest routed tokens (topk leaves ties unordered).
            kept_rows = routing_map.to(torch.int8).argsort(dim=0, descending=True, stable=True)[:capacity]
        else:
            raise ValueError(f"moe_token_drop_policy must be 'probs' or 'position', got {drop_policy!r}")
        keep = torch.zeros_like(routing_map, dtype=torch.bool).scatter(0, kept_rows, True)
    # Padding keeps all capacity rows per expert; rows not routed there have probability 0.
    final_map = keep if pad_to_capacity else routing_map & keep
    return routing_probs * final_map, final_map


def pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """Route extra (zero-probability) tokens to each expert so that its count becomes a multiple of
    ``pad_multiple``: the first unselected tokens of each expert are switched on."""
    per_expert = routing_map.transpose(0, 1)
    needed = (-per_expert.sum(dim=1)) % pad_multiple
    unselected_rank = torch.cumsum((per_expert == 0).int(), dim=1)
    switch_on = (per_expert == 0) & (unselected_rank <= needed.unsqueeze(1))
    return (per_expert.bool() | switch_on).transpose(0, 1).to(routing_map.dtype)


def get_updated_expert_bias(
    tokens_per_expert: torch.Tensor,
    expert_bias: torch.Tensor,
    expert_bias_update_rate: float,
    tp_dp_cp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Aux-loss-free balancing (arXiv 2408.15664): sum the token counts over the TP x DP x CP group (in place),
    then move each expert's bias by ``update_rate`` up when it got fewer tokens than the mean and down when more.
    ``tokens_per_expert`` and ``expert_bias`` are ``[..., experts]`` (several routers may be stacked)."""
    with torch.no_grad():
        if tp_dp_cp_group is None:
            tp_dp_cp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        if tp_dp_cp_group is not None and dist.get_world_size(tp_dp_cp_group) > 1:
            # Every rank must apply the same bias update, so it is computed from the global counts.
            dist.all_reduce(tokens_per_expert, group=tp_dp_cp_group)
        mean_tokens = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        # A fixed step in the direction of balance, whatever the size of the imbalance (sign, as in the paper).
        return expert_bias + torch.sign(mean_tokens - tokens_per_expert) * expert_bias_update_rate


# ---- token permutation ---------------------------------------------------------------------------------------


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    num_out_tokens: Optional[int] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
    tokens_per_expert: Optional[torch.Tensor] = None,
    align_size: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Group the rows of ``tokens`` ``[tokens, hidden]`` by expert: expert 0's tokens first (in token order), then
    expert 1's, ... as ``routing_map`` ``[tokens, experts]`` says. A token routed to k experts appears k times.

    ``num_out_tokens`` is the number of routed slots (``routing_map.sum()``; passing it avoids a host sync). With
    ``drop_and_pad`` every expert has exactly ``num_out_tokens // experts`` rows (the capacity). Returns
    ``(permuted tokens, permuted probs or None, sorted_indices, None, tokens_per_expert)``: ``sorted_indices[j]`` is
    the token row that permuted row j came from. The pad offsets (None) and ``align_size`` belong to Transformer
    Engine's fused pad-to-alignment kernel. ``fused`` (``moe_permute_fusion``) permutes with our kernel where it can
    run; the third value is then a ``row_id_map`` ``[tokens, experts]`` that only ``unpermute(fused=True)`` reads.
    """
    if fused:
        from megatron.core.fusions import fused_moe_permute

        if fused_moe_permute.permute_kernel_available(tokens):
            permuted, permuted_probs, row_id_map = fused_moe_permute.fused_permute(
                tokens, routing_map, probs, num_out_tokens, drop_and_pad
            )
            return permuted, permuted_probs, row_id_map, None, tokens_per_expert
    num_tokens = tokens.shape[0]
    num_experts = routing_map.shape[1]
    # Expert-major, like the permuted rows, so positions in the flat routing map index it directly.
    probs_by_expert = None if probs is None else probs.T.contiguous().reshape(-1)
    if drop_and_pad and num_out_tokens is not None:
        capacity = num_out_tokens // num_experts
        # Stable descending sort of each expert's 0/1 column puts its tokens first, in token order.
        per_expert = routing_map.T.to(torch.int8)
        sorted_indices = per_expert.argsort(dim=-1, descending=True, stable=True)[:, :capacity].reshape(-1)
        flat = (torch.arange(num_experts, device=routing_map.device).unsqueeze(-1) * num_tokens).expand(-1, capacity)
        flat_positions = flat.reshape(-1) + sorted_indices
    else:
        if num_out_tokens is None:
            num_out_tokens = int(routing_map.sum())
        flat_map = routing_map.bool().T.contiguous().reshape(-1)
        flat_positions = flat_map.to(torch.int8).argsort(descending=True, stable=True)[:num_out_tokens]
        # Positions in the expert-major [experts * tokens] map; the token row is the remainder.
        sorted_indices = flat_positions % num_tokens
    permuted_probs = None if probs is None else probs_by_expert.index_select(0, flat_positions)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices, None, tokens_per_expert


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size,
    probs: Optional[torch.Tensor] = None,
    routing_map: Optional[torch.Tensor] = None,
    fused: bool = False,
    drop_and_pad: bool = False,
    pad_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Undo :func:`permute`: add each permuted row back into its token's row of a zero ``restore_shape`` tensor
    (a token's k expert outputs are summed). With ``probs`` (``[tokens, experts]``, needs ``routing_map``) each row
    is first weighted by its routing probability. ``fused``: the kernel's weighted sum where ``permute(fused=True)``
    returned a ``row_id_map``."""
    if fused and sorted_indices.dim() == 2:
        # A row_id_map from the fused permute (which ran its kernel); the 1-D sorted indices of the PyTorch
        # permute (the CPU path of the fusion) take the code below.
        from megatron.core.fusions import fused_moe_permute

        return fused_moe_permute.fused_unpermute(permuted_tokens, sorted_indices, probs)
    if pad_offsets is not None:
        raise ValueError("unpermute: pad_offsets come from Transformer Engine's fused pad kernel, which is not used")
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute: probs need the routing_map they were selected with")
        num_tokens, num_experts = probs.shape
        if drop_and_pad:
            capacity = sorted_indices.numel() // num_experts
            offsets = (torch.arange(num_experts, device=probs.device).unsqueeze(-1) * num_tokens).expand(-1, capacity)
            permuted_probs = probs.T.contiguous().reshape(-1).index_select(0, offsets.reshape(-1) + sorted_indices)
        else:
            # Expert-major selection: the same order in which permute laid out the rows.
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous().bool())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    # index_add_ sums the k expert outputs that belong to the same token.
    output.index_add_(0, sorted_indices, permuted_tokens)
    return output.to(dtype=input_dtype)


def sort_chunks_by_idxs(
    input: torch.Tensor,
    split_sizes: torch.Tensor,
    sorted_idxs: torch.Tensor,
    probs: Optional[torch.Tensor] = None,
    fused: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Cut ``input`` (and ``probs``) into chunks of ``split_sizes`` rows along dim 0 and put them back together in
    the order ``sorted_idxs``. Sizes may be tensors or lists (a tensor costs one host sync)."""
    sizes = split_sizes.tolist() if torch.is_tensor(split_sizes) else list(split_sizes)
    order = sorted_idxs.tolist() if torch.is_tensor(sorted_idxs) else list(sorted_idxs)
    chunks = torch.split(input, sizes, dim=0)
    output = torch.cat([chunks[i] for i in order], dim=0)
    if probs is None:
        return output, None
    prob_chunks = torch.split(probs, sizes, dim=0)
    return output, torch.cat([prob_chunks[i] for i in order], dim=0)


# ---- router helpers ------------------------------------------------------------------------------------------


class RouterGatingLinearFunction(torch.autograd.Function):
    """``input @ weight.T (+ bias)`` computed in ``router_dtype`` (fp32 routing from bf16 activations) while only
    the low-precision input and weight are saved for backward; gradients come back in their own dtypes."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], router_dtype: torch.dtype):
        # The low-precision tensors are saved, not their router_dtype copies, to keep activation memory small.
        ctx.save_for_backward(inp, weight, bias)
        ctx.router_dtype = router_dtype
        flat = inp.reshape(-1, inp.shape[-1]).to(router_dtype)
        if bias is None:
            output = torch.mm(flat, weight.to(router_dtype).t())
        else:
            output = torch.addmm(bias.to(router_dtype), flat, weight.to(router_dtype).t())
        return output.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inp, weight, bias = ctx.saved_tensors
        dtype = ctx.router_dtype
        flat_grad = grad_output.reshape(-1, grad_output.shape[-1]).to(dtype)
        flat_inp = inp.reshape(-1, inp.shape[-1]).to(dtype)
        grad_input = torch.mm(flat_grad, weight.to(dtype)).to(inp.dtype).view(inp.shape)
        grad_weight = torch.mm(flat_grad.t(), flat_inp).to(weight.dtype)
        grad_bias = None if bias is None else flat_grad.sum(dim=0).to(bias.dtype)
        return grad_input, grad_weight, grad_bias, None


def router_gating_linear(
    inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], router_dtype: torch.dtype
) -> torch.Tensor:
    """The router's logits in ``router_dtype`` (see :class:`RouterGatingLinearFunction`)."""
    return RouterGatingLinearFunction.apply(inp, weight, bias, router_dtype)


class RandomSTE(torch.autograd.Function):
    """Random normal logits in forward (from the expert-parallel RNG stream, so they differ per rank), the
    gradient passed straight through: ``moe_router_force_load_balancing`` benchmarks balanced routing."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            # A new tensor of the logits' shape and dtype; the input logits are left untouched.
            return logits.clone().normal_()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


def apply_random_logits(logits: torch.Tensor) -> torch.Tensor:
    """:class:`RandomSTE` applied to ``logits``."""
    return RandomSTE.apply(logits)


def get_align_size_for_quantization(config: TransformerConfig) -> int:
    """Rows each expert's input is padded to a multiple of: only FP8 / FP4 grouped GEMMs need it, and they are not
    built here (the config refuses them), so 0 (no padding)."""
    return 0


def skip_routed_expert_padding(config: TransformerConfig) -> bool:
    """Whether the experts skip quantisation padding because the router already padded: only with
    ``moe_router_padding_for_quantization`` (refused here), so False."""
    return bool(config.moe_router_padding_for_quantization)


def get_default_pg_collection() -> ProcessGroupCollection:
    """The groups an MoE layer uses, from parallel_state: ep, tp, cp, expt_tp, expt_dp, tp_ep, tp_cp, tp_dp_cp."""
    names = ["ep", "tp", "cp", "expt_tp", "expt_dp", "tp_ep", "tp_cp", "tp_dp_cp"]
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=names)


# ---- aux-loss logging tracker ----------------------------------------------------------------------------------

# name -> {"values": [num_layers] tensor, "reduce_group", "avg_group", "reduce_group_has_dp"}
_MOE_LAYER_WISE_LOGGING_TRACKER: dict = {}


def get_moe_layer_wise_logging_tracker():
    """The per-layer aux-loss values recorded since the last log (a dict by loss name)."""
    return _MOE_LAYER_WISE_LOGGING_TRACKER


def save_to_aux_losses_tracker(
    name: str,
    loss: torch.Tensor,
    layer_number: int,
    num_layers: int,
    reduce_group: Optional[dist.ProcessGroup] = None,
    avg_group: Optional[dist.ProcessGroup] = None,
    reduce_group_has_dp: bool = False,
) -> None:
    """Add ``loss`` (detached) to layer ``layer_number``'s entry (1-based) of loss ``name``. At logging time the
    values are summed over ``reduce_group``, averaged over ``avg_group``, and averaged over the data-parallel ranks
    unless ``reduce_group_has_dp``. A layer without a number (not placed in a model) is not recorded."""
    if layer_number is None:
        return
    entry = _MOE_LAYER_WISE_LOGGING_TRACKER.get(name)
    if entry is None:
        entry = {"values": torch.zeros(num_layers, device=loss.device)}
        _MOE_LAYER_WISE_LOGGING_TRACKER[name] = entry
    entry["values"][layer_number - 1] += loss.detach().to(entry["values"].dtype)
    entry["reduce_group"] = reduce_group
    entry["avg_group"] = avg_group
    entry["reduce_group_has_dp"] = reduce_group_has_dp


def clear_aux_losses_tracker() -> None:
    """Zero every recorded value (after logging)."""
    for entry in _MOE_LAYER_WISE_LOGGING_TRACKER.values():
        entry["values"].zero_()


def _all_reduce(values: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is None or dist.get_world_size(group) == 1:
        return
    if op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo":
        # gloo has no AVG reduction.
        dist.all_reduce(values, group=group)
        values.div_(dist.get_world_size(group))
        return
    dist.all_reduce(values, group=group, op=op)


def reduce_aux_losses_tracker_across_ranks(
    track_names: Optional[List[str]] = None, pg_collection: Optional[ProcessGroupCollection] = None
) -> None:
    """Make every rank's tracker hold the model-wide values: summed over pipeline stages (each holds its own
    layers), summed over each entry's reduce group (pieces of the same sequences), averaged over its avg group and
    over the data-parallel ranks (unless the reduce group already spans them). Every rank must call it with the
    same names."""
    if pg_collection is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
    else:
        pp_group, dp_group = pg_collection.pp, pg_collection.dp
    names = list(_MOE_LAYER_WISE_LOGGING_TRACKER) if track_names is None else track_names
    for name in names:
        entry = _MOE_LAYER_WISE_LOGGING_TRACKER[name]
        values = entry["values"]
        # Each stage filled only its own layers' entries (zeros elsewhere), so a sum assembles them.
        _all_reduce(values, pp_group)
        _all_reduce(values, entry.get("reduce_group"))
        _all_reduce(values, entry.get("avg_group"), dist.ReduceOp.AVG)
        if not entry.get("reduce_group_has_dp", False):
            _all_reduce(values, dp_group, dist.ReduceOp.AVG)


def _num_moe_layers(num_layers: Optional[int], moe_layer_freq, mtp_num_layers: Optional[int]) -> int:
    if moe_layer_freq is None:
        count = num_layers
    elif isinstance(moe_layer_freq, int):
        count = sum(1 for i in range(num_layers) if i % moe_layer_freq == 0)
    elif isinstance(moe_layer_freq, list):
        count = sum(moe_layer_freq)
    else:
        raise ValueError(f"moe_layer_freq must be an int or a list of 0/1, got {moe_layer_freq!r}")
    return count + (mtp_num_layers or 0)


def track_moe_metrics(
    loss_scale: float,
    iteration: int,
    writer: Optional["SummaryWriter"] = None,
    wandb_writer: Optional["wandb.Run"] = None,
    total_loss_dict: Optional[dict[str, torch.Tensor]] = None,
    per_layer_logging: bool = False,
    force_initialize: bool = False,
    track_names: Optional[List[str]] = None,
    num_layers: Optional[int] = None,
    moe_layer_freq: Union[int, List[int], None] = None,
    mtp_num_layers: Optional[int] = None,
    pg_collection: Optional[ProcessGroupCollection] = None,
) -> str:
    """Reduce the tracker across ranks and report each loss as Megatron does: the sum over layers times
    ``loss_scale`` (1 / micro-batches) divided by the number of MoE layers, added to ``total_loss_dict``, written to
    TensorBoard / W&B under its name (and per layer as ``moe/<name>_layer_<i>`` with ``per_layer_logging``).
    ``force_initialize`` creates zero entries for ``track_names`` so that ranks without MoE layers (a dense
    pipeline stage) take part in the same collectives. Returns the log-line fragment ``" name: value |"`` per loss,
    then clears the tracker."""
    # Collectives below must run on every rank, including stages whose layers recorded nothing.
    if force_initialize and track_names is not None:
        from megatron.core.utils import get_current_device

        for name in track_names:
            if name not in _MOE_LAYER_WISE_LOGGING_TRACKER:
                _MOE_LAYER_WISE_LOGGING_TRACKER[name] = {
                    "values": torch.zeros(num_layers, device=get_current_device()),
                    "reduce_group": None,
                    "avg_group": None,
                    "reduce_group_has_dp": False,
                }
    reduce_aux_losses_tracker_across_ranks(track_names, pg_collection=pg_collection)
    num_moe_layers = _num_moe_layers(num_layers, moe_layer_freq, mtp_num_layers)
    names = list(_MOE_LAYER_WISE_LOGGING_TRACKER) if track_names is None else track_names
    log_string = ""
    for name in names:
        per_layer = _MOE_LAYER_WISE_LOGGING_TRACKER[name]["values"].float() * loss_scale
        value = per_layer.sum() / num_moe_layers
        if total_loss_dict is not None:
            total_loss_dict[name] = total_loss_dict[name] + value if name in total_loss_dict else value
        if writer is not None:
            writer.add_scalar(name, value.item(), iteration)
            if per_layer_logging:
                for i, layer_value in enumerate(per_layer.tolist()):
                    writer.add_scalar(f"moe/{name}_layer_{i}", layer_value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({name: value.item()}, iteration)
            if per_layer_logging:
                wandb_writer.log({f"moe/{name}_layer_{i}": v for i, v in enumerate(per_layer.tolist())}, iteration)
        log_string += f" {name}: {value.item():.6E} |"
    clear_aux_losses_tracker()
    return log_string

"""Token dispatchers: move each token to the ranks holding its experts and the experts' outputs back.

Expert parallelism places ``num_experts / ep`` experts on each rank of the expert-parallel (EP) group; expert
tensor parallelism (ETP) splits each expert's weights over the expert tensor-parallel group, whose ranks hold
different tokens (different sequence slices or data-parallel batches). Every rank of the ETP x EP group therefore
contributes its own tokens, and each expert sees the tokens of the whole group.

* :class:`MoEAllGatherTokenDispatcher` all-gathers every token over ETP x EP, runs its local experts on the tokens
  routed to them, and reduce-scatters the (expert-summed, ETP-partial) results back.
* :class:`MoEAlltoAllTokenDispatcher` sends each token only to the EP ranks of its experts (all-to-all), gathers
  over ETP, sorts the received chunks by local expert, and reverses each step after the experts.

Both hand the experts ``(tokens grouped by local expert, tokens_per_expert, per-token probs)``; the experts weigh
their outputs by the probs, so combining is a plain sum.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_utils import (
    get_capacity,
    get_default_pg_collection,
    permute,
    sort_chunks_by_idxs,
    unpermute,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class MoETokenDispatcher:
    """What the dispatchers share: the expert groups (``ep``, ``expt_tp``, ``tp_ep`` of ``pg_collection``, the
    parallel_state groups by default) and the six-step interface MoELayer drives."""

    def __init__(self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None) -> None:
        self.config = config
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp  # the expert tensor-parallel group
        self.tp_ep_group = pg_collection.tp_ep
        self.ep_size, self.ep_rank = _size(self.ep_group), _rank(self.ep_group)
        self.tp_size, self.tp_rank = _size(self.tp_group), _rank(self.tp_group)
        self.tp_ep_size = _size(self.tp_ep_group)
        self.shared_experts = None

    def _init_local_experts(self, num_local_experts: int, local_expert_indices: List[int]) -> None:
        """What the all-gather and all-to-all dispatchers keep of this rank's experts, once the groups are checked."""
        self._check_expert_group_layout()
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.router_topk = self.config.moe_router_topk

    def _check_expert_group_layout(self) -> None:
        """The dispatchers index the ETP x EP group as ``ep_rank * etp + etp_rank`` (parallel_state's layout); a
        hand-made ProcessGroupCollection with another layout would silently route tokens to the wrong experts."""
        if self.tp_ep_size == 1 or self.tp_ep_group is None:
            return
        members = dist.get_process_group_ranks(self.tp_ep_group)
        tp, ep = self.tp_size, self.ep_size
        expected_tp = members[self.ep_rank * tp : (self.ep_rank + 1) * tp]
        expected_ep = members[self.tp_rank :: tp]
        actual_tp = dist.get_process_group_ranks(self.tp_group) if tp > 1 else expected_tp
        actual_ep = dist.get_process_group_ranks(self.ep_group) if ep > 1 else expected_ep
        if len(members) != tp * ep or actual_tp != expected_tp or actual_ep != expected_ep:
            raise ValueError(
                f"the expert groups do not nest: tp_ep {members}, expt_tp {actual_tp}, ep {actual_ep}; tp_ep must "
                "list the expert-tensor-parallel ranks of each expert-parallel rank together (parallel_state's "
                "layout)"
            )

    @abstractmethod
    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Local work before the dispatch communication."""

    @abstractmethod
    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The dispatch communication."""

    @abstractmethod
    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Local work after it: returns ``(tokens by local expert, tokens_per_expert, probs)``."""

    @abstractmethod
    def combine_preprocess(self, hidden_states):
        """Local work on the experts' output before the combine communication."""

    @abstractmethod
    def token_combine(self, hidden_states):
        """The combine communication."""

    @abstractmethod
    def combine_postprocess(self, hidden_states):
        """Local work after it: the output in the input's shape."""

    def set_shared_experts(self, shared_experts):
        """Register the shared experts (Megatron overlaps them with the dispatch; here they run before it)."""
        self.shared_experts = shared_experts

    def get_expert_zero_copy_buffers(self):
        """Zero-copy expert buffers exist only for the NCCL-EP backend of the flex dispatcher: none here."""
        return None


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather tokens over ETP x EP, keep those routed to this rank's experts; reduce-scatter the results.

    Simple and without host-side token counts in the communication; each rank receives every token of the group,
    so it moves ``tp_ep`` times more data than the all-to-all dispatcher.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self._init_local_experts(num_local_experts, local_expert_indices)
        self.local_start = self.local_expert_indices[0]

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten ``[s, b, h]`` to ``[tokens, h]`` and keep the routing map for later."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.view(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states, probs):
        """All-gather tokens, probs and the routing map over ETP x EP. The gradients of the gathered tokens and
        probs are partial on each rank (its experts, its ETP slice), so their backward is a reduce-scatter."""
        if self.tp_ep_size > 1:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            self.routing_map = _gather_along_first_dim(self.routing_map.to(torch.int32), self.tp_ep_group).bool()
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """Group the gathered tokens routed to local experts by expert."""
        local_slice = slice(self.local_start, self.local_start + self.num_local_experts)
        self.local_map = self.routing_map[:, local_slice].contiguous()
        local_probs = probs[:, local_slice].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0)
        self.gathered_shape = hidden_states.shape
        permuted, permuted_probs, self.reversed_mapping, _, _ = permute(
            hidden_states,
            self.local_map,
            probs=local_probs,
            num_out_tokens=int(tokens_per_expert.sum()),
            fused=self.config.moe_permute_fusion,
        )
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states):
        """Sum each token's local expert outputs back into its row of the gathered tokens."""
        return unpermute(
            hidden_states,
            self.reversed_mapping,
            restore_shape=self.gathered_shape,
            fused=self.config.moe_permute_fusion,
        )

    def token_combine(self, hidden_states):
        """Reduce-scatter over ETP x EP: adds the other ranks' experts (and ETP partial sums) to this rank's
        tokens."""
        if self.tp_ep_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(hidden_states, group=self.tp_ep_group)
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Send each token to the EP ranks of its experts with one all-to-all, gather over ETP, sort by local expert.

    Received tokens arrive ordered by (ETP rank, EP source rank, local expert); they are re-sorted to (local expert,
    ETP rank, EP source) so each expert's tokens are contiguous, and the order is undone after the experts. The
    split sizes of the all-to-all need the token counts on the host: one device-to-host copy per layer and step.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self._init_local_experts(num_local_experts, local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.drop_and_pad = config.moe_pad_expert_input_to_capacity
        # Chunk j of the received tokens is (source s = j // n, local expert e = j % n), s = etp * ep + ep_source;
        # sorted, expert e's chunks come first, in source order.
        sources = self.tp_size * self.ep_size
        n = num_local_experts
        self.sort_input_by_local_experts = [s * n + e for e in range(n) for s in range(sources)]
        self.restore_output_by_local_experts = [e * sources + s for s in range(sources) for e in range(n)]

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Work out every split size from the routing map: the rows this rank sends to each EP rank, the rows it
        receives from each, the rows each ETP rank contributes, and the chunk sizes for sorting. Returns the
        number of tokens each local expert will process (a host list, ready for the experts)."""
        num_local_tokens_per_expert = routing_map.sum(dim=0)
        if self.drop_and_pad:
            self.num_out_tokens = routing_map.size(1) * get_capacity(
                routing_map.size(0) * self.router_topk, self.num_experts, self.config.moe_expert_capacity_factor
            )
        if self.tp_ep_size > 1:
            counts = _gather_along_first_dim(num_local_tokens_per_expert.view(1, -1), self.tp_ep_group)
        else:
            counts = num_local_tokens_per_expert.view(1, -1)
        # counts[ep_source, etp_rank, expert]; one host copy serves every split below.
        counts = counts.view(self.ep_size, self.tp_size, self.num_experts).tolist()
        first = self.local_expert_indices[0]
        local = slice(first, first + self.num_local_experts)
        mine = counts[self.ep_rank][self.tp_rank]
        n = self.num_local_experts
        self.input_splits = [sum(mine[rank * n : (rank + 1) * n]) for rank in range(self.ep_size)]
        self.num_out_tokens_local = sum(mine)
        self.output_splits = [sum(counts[src][self.tp_rank][local]) for src in range(self.ep_size)]
        self.output_splits_tp = [
            sum(sum(counts[src][etp][local]) for src in range(self.ep_size)) for etp in range(self.tp_size)
        ]
        # Chunk sizes of the received tokens in arrival order (etp, ep source, local expert).
        self.num_global_tokens_per_local_expert = [
            counts[src][etp][first + e] for etp in range(self.tp_size) for src in range(self.ep_size) for e in range(n)
        ]
        sources = self.tp_size * self.ep_size
        return [sum(self.num_global_tokens_per_local_expert[s * n + e] for s in range(sources)) for e in range(n)]

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Flatten to ``[tokens, h]``, compute the splits, and group this rank's tokens by (global) expert, which
        is also by destination EP rank."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.routing_map = routing_map
        self.tokens_per_expert = self.preprocess(routing_map)
        num_out = self.num_out_tokens if self.drop_and_pad else self.num_out_tokens_local
        self.hidden_shape_before_permute = hidden_states.shape
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping, _, _ = permute(
            hidden_states,
            routing_map,
            probs=probs,
            num_out_tokens=num_out,
            fused=self.config.moe_permute_fusion,
            drop_and_pad=self.drop_and_pad,
        )
        return permuted, permuted_probs

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """All-to-all over EP, then all-gather over ETP (backward: reduce-scatter, the ETP ranks' gradients are
        partial)."""
        tokens = (
            all_to_all(self.ep_group, permutated_local_input_tokens, self.output_splits, self.input_splits)
            if self.ep_size > 1
            else permutated_local_input_tokens
        )
        probs = (
            all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
            if self.ep_size > 1
            else permuted_probs
        )
        if self.tp_size > 1:
            tokens = gather_from_sequence_parallel_region(
                tokens, group=self.tp_group, output_split_sizes=self.output_splits_tp
            )
            probs = gather_from_sequence_parallel_region(
                probs, group=self.tp_group, output_split_sizes=self.output_splits_tp
            )
        return tokens, probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """Sort the received chunks so that each local expert's tokens are contiguous."""
        if self.num_local_experts > 1:
            global_input_tokens, global_probs = sort_chunks_by_idxs(
                global_input_tokens,
                self.num_global_tokens_per_local_expert,
                self.sort_input_by_local_experts,
                probs=global_probs,
            )
        tokens_per_expert = torch.tensor(self.tokens_per_expert, dtype=torch.int64)
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """Undo the sort; reduce-scatter the ETP partial results back to the ETP rank that sent each token."""
        if self.num_local_experts > 1:
            sorted_sizes = [self.num_global_tokens_per_local_expert[i] for i in self.sort_input_by_local_experts]
            hidden_states, _ = sort_chunks_by_idxs(hidden_states, sorted_sizes, self.restore_output_by_local_experts)
        if self.tp_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states, group=self.tp_group, input_split_sizes=self.output_splits_tp
            )
        return hidden_states

    def token_combine(
        self, hidden_states: torch.Tensor, async_finish: bool = True, allocate_on_comm_stream: bool = True
    ):
        """The reverse all-to-all over EP (``async_finish`` / ``allocate_on_comm_stream`` are CUDA-stream knobs of
        the overlapped schedule, accepted and not used)."""
        if self.ep_size > 1:
            hidden_states = all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)
        return hidden_states

    def combine_postprocess(self, permutated_local_input_tokens):
        """Sum each token's expert outputs back into its row and restore ``[s, b, h]``."""
        output = unpermute(
            permutated_local_input_tokens,
            self.reversed_local_input_permutation_mapping,
            restore_shape=self.hidden_shape_before_permute,
            fused=self.config.moe_permute_fusion,
            drop_and_pad=self.drop_and_pad,
        )
        return output.view(self.hidden_shape)


class MoEFlexTokenDispatcher(MoETokenDispatcher):
    """The flex dispatcher drives DeepEP / HybridEP / NCCL-EP kernels, which are GPU libraries not built here:
    constructing it raises a ValueError naming the supported dispatchers."""

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: List[int],
        config: TransformerConfig,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        raise ValueError(
            "not supported yet: moe_token_dispatcher_type='flex' (DeepEP / HybridEP kernels); use 'alltoall' or "
            "'allgather'"
        )

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        raise ValueError("not supported yet: the flex token dispatcher")

    def token_dispatch(self, hidden_states, probs=None, async_finish=True, allocate_on_comm_stream=True):
        raise ValueError("not supported yet: the flex token dispatcher")

    def dispatch_postprocess(self, hidden_states, probs):
        raise ValueError("not supported yet: the flex token dispatcher")

    def combine_preprocess(self, hidden_states):
        raise ValueError("not supported yet: the flex token dispatcher")

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        raise ValueError("not supported yet: the flex token dispatcher")

    def combine_postprocess(self, hidden_states):
        raise ValueError("not supported yet: the flex token dispatcher")

    def check_over_budget(self):
        raise ValueError("not supported yet: the flex token dispatcher")

    def reset_over_budget(self):
        raise ValueError("not supported yet: the flex token dispatcher")

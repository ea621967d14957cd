"""The dynamic context: a paged KV cache in fixed-size blocks shared by requests that come and go.

Each layer's keys (and values) live in one preallocated tensor ``[num_blocks * block_size_tokens, groups, d]``.
A request joining is given the blocks for its whole budget (prompt plus the tokens it may generate), so a running
request can never run out of room mid-generation and nothing needs evicting; its blocks return to the free list
when it finishes. One forward runs a flat batch of tokens ``[t, 1, h]``: one token for every decoding request
plus prompt chunks of requests in prefill, in any mix. :meth:`DynamicInferenceContext.prepare_step` turns that
step's plan into index tensors once, on the host's numbers, so the layers do no host synchronisation: each layer
scatters its new keys/values into their slots, gathers every request's blocks through the block table, and runs
one masked attention for the whole step.

A hybrid model's Mamba layers keep no KV cache but a fixed-size conv and SSM state per request: every active
request also owns one of ``max_requests`` state slots, given with its blocks and returned with them, and a Mamba
layer sees the step's tokens regrouped into one row per request (``megatron.core.ssm.mamba_inference``).
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from megatron.core.inference.contexts.base_context import BaseInferenceContext
from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import get_current_device


class ContextOverflowError(ValueError):
    """A request does not fit the context. ``is_transient``: it may fit later, once others finish."""

    def __init__(self, request_id=None, message: Optional[str] = None, *, is_transient: bool = True):
        self.request_id = request_id
        self.message = message or "the request does not fit the inference context"
        self.is_transient = is_transient
        super().__init__(f"request {request_id}: {self.message}" if request_id is not None else self.message)


class RequestOverflowError(ContextOverflowError):
    """More requests than ``max_requests``."""


class ActiveRequestCountOverflowError(ContextOverflowError):
    """More active requests than the context has room for."""


class TokenOverflowError(ContextOverflowError):
    """A request's tokens exceed ``max_sequence_length`` (or a step's token budget)."""


class BlockOverflowError(ContextOverflowError):
    """A request needs more KV-cache blocks than the cache holds (or has free)."""


@dataclass
class _ActiveRequest:
    blocks: List[int]
    mamba_slot: int  # the row of every Mamba layer's conv/SSM state tensors this request owns
    length: int = 0  # tokens whose keys/values are in the cache


@dataclass
class MambaMetadata:
    """Which Mamba state slot each request of the step uses (``megatron.core.ssm.mamba_inference``): decode-only
    steps set ``batch_indices_decode``; other steps run every request as a right-padded prefill row with
    ``prefill_lengths`` tokens, continuing from its stored states where it already has tokens (a later prompt
    chunk, or a decoding request's one token)."""

    batch_indices_decode: Optional[Tensor] = None
    batch_indices_prefill: Optional[Tensor] = None
    prefill_lengths: Optional[Tensor] = None
    prefill_has_initial_states: Optional[Tensor] = None


class DynamicInferenceContext(BaseInferenceContext):
    """Paged KV cache and per-step attention state for continuous batching.

    Args:
        params_dtype: dtype of the cached keys/values (the model's compute dtype).
        num_layers: transformer layers of the whole model (layer numbers are global; a pipeline stage allocates
            memory only for the layers it runs); it only sizes ``buffer_size_gb`` into blocks, so for a hybrid the
            number of attention layers is the accurate value.
        kv_channels: head dimension.
        num_attention_heads: key/value heads of the whole model (``num_query_groups``), split over TP ranks.
        max_sequence_length: longest prompt plus generation of one request.
        buffer_size_gb: KV-cache memory per rank; sets the number of blocks unless ``num_blocks`` is given.
        block_size_tokens: tokens per block.
        max_requests: most requests active at once (default: as many as there are blocks, at most 256).
        max_tokens: most tokens one forward step runs (decode tokens plus prefill chunks; default 2048).
        num_blocks: the number of blocks directly, instead of ``buffer_size_gb``.
        tensor_model_parallel_size: TP size (default: from parallel_state).
        device: where the cache lives (default: the current device).
    """

    def __init__(
        self,
        params_dtype: torch.dtype,
        num_layers: int,
        kv_channels: int,
        num_attention_heads: int,
        max_sequence_length: int,
        buffer_size_gb: Optional[float] = None,
        block_size_tokens: int = 256,
        max_requests: Optional[int] = None,
        max_tokens: Optional[int] = None,
        num_blocks: Optional[int] = None,
        tensor_model_parallel_size: Optional[int] = None,
        materialize_only_last_token_logits: bool = True,
        device: Optional[torch.device] = None,
    ):
        super().__init__(materialize_only_last_token_logits)
        if tensor_model_parallel_size is None:
            from megatron.core import parallel_state

            tensor_model_parallel_size = (
                parallel_state.get_tensor_model_parallel_world_size()
                if parallel_state.model_parallel_is_initialized()
                else 1
            )
        if num_attention_heads % tensor_model_parallel_size:
            raise ValueError(
                f"DynamicInferenceContext: num_attention_heads (key/value heads) {num_attention_heads} is not "
                f"divisible by tensor_model_parallel_size {tensor_model_parallel_size}"
            )
        if block_size_tokens < 1:
            raise ValueError(f"DynamicInferenceContext: block_size_tokens must be >= 1, got {block_size_tokens}")
        if max_sequence_length < 1:
            raise ValueError(f"DynamicInferenceContext: max_sequence_length must be >= 1, got {max_sequence_length}")
        self.params_dtype = params_dtype
        self.num_layers = num_layers
        self.kv_channels = kv_channels
        self.num_kv_heads_per_partition = num_attention_heads // tensor_model_parallel_size
        self._max_sequence_length = max_sequence_length
        self.block_size_tokens = block_size_tokens
        element_size = torch.empty((), dtype=params_dtype).element_size()
        # Keys and values, every layer, this rank's heads: the textbook 2 x L x kv_heads x d x tokens x bytes.
        self.bytes_per_token = 2 * num_layers * self.num_kv_heads_per_partition * kv_channels * element_size
        if num_blocks is None:
            if buffer_size_gb is None:
                raise ValueError("DynamicInferenceContext needs buffer_size_gb or num_blocks to size the KV cache")
            num_blocks = int(buffer_size_gb * 1024**3 // (self.bytes_per_token * block_size_tokens))
        if num_blocks < 1:
            raise ValueError(
                f"DynamicInferenceContext: buffer_size_gb={buffer_size_gb} holds no block of {block_size_tokens} "
                f"tokens ({self.bytes_per_token * block_size_tokens} bytes each); raise it or give num_blocks"
            )
        self.max_requests = max_requests if max_requests is not None else min(num_blocks, 256)
        self.max_tokens = max_tokens if max_tokens is not None else 2048
        if self.max_requests < 1 or self.max_tokens < self.max_requests:
            raise ValueError(
                f"DynamicInferenceContext: need max_requests >= 1 and max_tokens >= max_requests (every active "
                f"request decodes a token per step), got max_requests={self.max_requests}, "
                f"max_tokens={self.max_tokens}"
            )
        self.block_allocator = KVBlockAllocator(num_blocks)
        # One Mamba state slot per active request (used only by a hybrid model's Mamba layers); popped from the
        # end, lowest first, like the blocks.
        self._free_mamba_slots: List[int] = list(range(self.max_requests - 1, -1, -1))
        self.device = device if device is not None else get_current_device()
        self.memory_buffer: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._active: Dict[object, _ActiveRequest] = {}
        self._step: Optional[dict] = None
        self.step_inputs: Optional[Tuple[Tensor, Tensor, Tensor]] = None  # of the prepared step

    # ---- sizes ----

    @property
    def max_sequence_length(self) -> int:
        return self._max_sequence_length

    def is_static_batching(self) -> bool:
        return False

    @property
    def total_request_count(self) -> int:
        return len(self._active)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size_tokens)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this rank has allocated so far (layers allocate on their first forward)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.memory_buffer.values())

    def kv_cache_bytes_for_tokens(self, num_tokens: int) -> int:
        """What ``num_tokens`` cached tokens cost (all layers of the model, this rank's heads)."""
        return self.bytes_per_token * num_tokens

    # ---- admission ----

    def check_request(self, request_id, total_tokens: int) -> None:
        """Raise if a request of ``total_tokens`` (prompt plus its generation budget) can never fit."""
        if total_tokens > self._max_sequence_length:
            raise TokenOverflowError(
                request_id,
                f"prompt plus tokens to generate is {total_tokens} tokens, more than max_sequence_length="
                f"{self._max_sequence_length}; shorten the prompt or ask for fewer tokens",
                is_transient=False,
            )
        needed = self.blocks_needed(total_tokens)
        if needed > self.block_allocator.total_count:
            raise BlockOverflowError(
                request_id,
                f"needs {needed} KV-cache blocks of {self.block_size_tokens} tokens but the cache has only "
                f"{self.block_allocator.total_count}; raise the KV-cache size (buffer_size_gb / num_blocks)",
                is_transient=False,
            )

    def has_room_for(self, total_tokens: int) -> bool:
        """Whether a request of ``total_tokens`` can join now (a free request slot and enough free blocks)."""
        return len(self._active) < self.max_requests and self.block_allocator.is_memory_available(
            self.blocks_needed(total_tokens)
        )

    def add_request(self, request_id, total_tokens: int) -> None:
        """Give a request the blocks for ``total_tokens``; raise a ContextOverflowError if they are not there."""
        self.check_request(request_id, total_tokens)
        if request_id in self._active:
            raise ValueError(f"DynamicInferenceContext: request {request_id} is already active")
        if len(self._active) >= self.max_requests:
            raise ActiveRequestCountOverflowError(request_id, f"max_requests={self.max_requests} already active")
        needed = self.blocks_needed(total_tokens)
        if not self.block_allocator.is_memory_available(needed):
            raise BlockOverflowError(
                request_id, f"needs {needed} KV-cache blocks, {self.block_allocator.total_avail} free now"
            )
        self._active[request_id] = _ActiveRequest(
            self.block_allocator.allocate_memory_blocks(needed), self._free_mamba_slots.pop()
        )

    def release_request(self, request_id) -> None:
        """A request finished (or failed): its blocks and its Mamba state slot go back to the free lists."""
        entry = self._active.pop(request_id)
        self.block_allocator.release_memory_blocks(entry.blocks)
        self._free_mamba_slots.append(entry.mamba_slot)

    @property
    def mamba_state_slot_count(self) -> int:
        return self.max_requests

    @property
    def mamba_slots_in_use(self) -> int:
        return self.max_requests - len(self._free_mamba_slots)

    def request_length(self, request_id) -> int:
        return self._active[request_id].length

    def reset(self) -> None:
        """Forget every request; the allocated memory is kept and overwritten."""
        self._active.clear()
        self.block_allocator.reset()
        self._free_mamba_slots = list(range(self.max_requests - 1, -1, -1))
        self._step = None

    # ---- one forward step ----

    def prepare_step(self, chunks: Sequence[Tuple[object, Sequence[int]]]) -> Tuple[Tensor, Tensor, Tensor]:
        """Set up the attention state for one forward over ``chunks``: ``(request_id, new tokens)`` per request,
        each request at most once; a decoding request brings one token, a request in prefill a prompt chunk.

        Returns ``input_ids [1, t]``, ``position_ids [1, t]`` and the index of each request's last token in the
        step ``[r]`` (whose logits predict its next token).
        """
        if not chunks:
            raise ValueError("DynamicInferenceContext.prepare_step needs at least one request")
        bs = self.block_size_tokens
        tokens, positions, slots, last_index = [], [], [], []
        starts, lengths = [], []
        max_blocks = 0
        for request_id, new_tokens in chunks:
            entry = self._active[request_id]
            start, n = entry.length, len(new_tokens)
            if n < 1 or start + n > len(entry.blocks) * bs:
                raise TokenOverflowError(
                    request_id, f"a chunk of {n} tokens at position {start} does not fit its {len(entry.blocks)} blocks"
                )
            tokens.extend(new_tokens)
            request_positions = range(start, start + n)
            positions.extend(request_positions)
            slots.extend(entry.blocks[p // bs] * bs + p % bs for p in request_positions)
            last_index.append(len(tokens) - 1)
            starts.append(start)
            lengths.append(n)
            max_blocks = max(max_blocks, self.blocks_needed(start + n))
        if len(tokens) > self.max_tokens:
            raise TokenOverflowError(None, f"a step of {len(tokens)} tokens exceeds max_tokens={self.max_tokens}")
        device = self.device
        max_q = max(lengths)
        block_table = [(self._active[rid].blocks + [0] * max_blocks)[:max_blocks] for rid, _ in chunks]
        # Query positions padded to [r, max_q]; a padding query looks at key 0 only (never a fully masked row,
        # which would give NaN), and its output is dropped.
        query_positions = [[s + j if j < n else 0 for j in range(max_q)] for s, n in zip(starts, lengths)]
        key_positions = torch.arange(max_blocks * bs, device=device)
        qpos = torch.tensor(query_positions, device=device)
        masked = key_positions[None, None, :] > qpos[:, :, None]  # [r, max_q, L]: causal and beyond each length
        step = {
            "positions": torch.tensor(positions, device=device),
            "slots": torch.tensor(slots, device=device),
            "block_table": torch.tensor(block_table, device=device),
            "mask": masked[:, None],
            "decode_only": max_q == 1,
            "num_requests": len(chunks),
            "chunks": [(rid, n) for (rid, _), n in zip(chunks, lengths)],
        }
        kv_lengths = {start + n for start, n in zip(starts, lengths)}
        if max_q == 1 and len(kv_lengths) == 1:
            # Every request decodes at the same length (a batch of equal prompts): attend over exactly those keys,
            # with no padding to mask.
            step["kv_length"] = kv_lengths.pop()
            step["mask"] = None
        view = self._strided_view(chunks, starts, lengths)
        if view is not None:
            # Every request's blocks are consecutive and the requests sit at evenly spaced places in the pool (a
            # lone request, or a batch admitted together into a fresh cache): attend over a strided view of the
            # cache instead of gathering a copy, over exactly the longest request's keys.
            step["view"] = view
            if step["mask"] is not None:
                step["mask"] = step["mask"][..., : view[2]]
        if max_q > 1 and len(chunks) > 1:
            offsets = [0]
            for n in lengths[:-1]:
                offsets.append(offsets[-1] + n)
            step["pad_index"] = torch.tensor(
                [[o + j if j < n else o for j in range(max_q)] for o, n in zip(offsets, lengths)], device=device
            )
            step["unpad_index"] = torch.tensor(
                [i * max_q + j for i, n in enumerate(lengths) for j in range(n)], device=device
            )
        # Host numbers only: the Mamba metadata's tensors are made on first use (a model without Mamba layers
        # never pays for them).
        step["mamba"] = ([self._active[rid].mamba_slot for rid, _ in chunks], lengths, starts)
        self._step = step
        input_ids = torch.tensor(tokens, device=device).unsqueeze(0)
        self.step_inputs = (input_ids, step["positions"].unsqueeze(0), torch.tensor(last_index, device=device))
        return self.step_inputs

    def _strided_view(self, chunks, starts, lengths) -> Optional[Tuple[int, int, int]]:
        """``(first token, token stride between requests, keys to attend over)`` when request ``i``'s keys are
        the cache slots ``first + i * stride .. + length`` (its blocks consecutive, the requests' first blocks
        evenly spaced), else None. Host numbers only, once per step."""
        bs = self.block_size_tokens
        kv_length = max(start + n for start, n in zip(starts, lengths))
        used = self.blocks_needed(kv_length)
        firsts = []
        for request_id, _ in chunks:
            blocks = self._active[request_id].blocks
            first = blocks[0]
            # Every request reads kv_length slots from its first: they must be its own consecutive blocks (the
            # slots past its length are masked, or absent when all lengths are equal).
            if blocks[:used] != list(range(first, first + used)):
                return None
            firsts.append(first)
        stride = firsts[1] - firsts[0] if len(firsts) > 1 else 0
        # A view needs non-negative strides: requests later in the step must sit later in the pool.
        if stride < 0 or any(b - a != stride for a, b in zip(firsts, firsts[1:])):
            return None
        return firsts[0] * bs, stride * bs, kv_length

    def is_decode_only(self) -> bool:
        """Whether the prepared step is one token per request (a Mamba layer then updates its states in O(1))."""
        if self._step is None:
            raise ValueError("DynamicInferenceContext: call prepare_step() before the forward pass")
        return self._step["decode_only"]

    @property
    def mamba_metadata(self) -> Optional[MambaMetadata]:
        """The prepared step's Mamba state slots (None outside a step); built once per step, on first use."""
        step = self._step
        if step is None:
            return None
        if "mamba_metadata" not in step:
            slots, lengths, starts = step["mamba"]
            device = self.device
            if step["decode_only"]:
                metadata = MambaMetadata(batch_indices_decode=torch.tensor(slots, device=device))
            else:
                metadata = MambaMetadata(
                    batch_indices_prefill=torch.tensor(slots, device=device),
                    prefill_lengths=torch.tensor(lengths, device=device),
                    prefill_has_initial_states=torch.tensor([start > 0 for start in starts], device=device),
                )
            step["mamba_metadata"] = metadata
        return step["mamba_metadata"]

    def mamba_tokens_to_rows(self, hidden_states: Tensor) -> Tensor:
        """The step's flat tokens ``[t, 1, h]`` as one row per request ``[max_q, r, h]`` (right-padded; a
        decode-only step is ``[1, r, h]``), the layout a Mamba mixer runs, in the order of the step's chunks."""
        step = self._step
        if step["decode_only"]:
            return hidden_states.transpose(0, 1)
        if step["num_requests"] == 1:
            return hidden_states
        return hidden_states[:, 0][step["pad_index"]].transpose(0, 1)

    def mamba_rows_to_tokens(self, rows: Tensor) -> Tensor:
        """The inverse of :meth:`mamba_tokens_to_rows`: ``[max_q, r, h]`` back to the flat ``[t, 1, h]``."""
        step = self._step
        if step["decode_only"]:
            return rows.transpose(0, 1)
        if step["num_requests"] == 1:
            return rows
        return rows.transpose(0, 1).reshape(-1, rows.shape[-1])[step["unpad_index"]].unsqueeze(1)

    def commit_step(self) -> None:
        """The step's forward ran: its tokens' keys/values are now part of each request's cached sequence."""
        for request_id, n in self._step["chunks"]:
            self._active[request_id].length += n
        self._step = None

    def _layer_cache(self, layer_number: int, like: Tensor) -> Tuple[Tensor, Tensor]:
        cache = self.memory_buffer.get(layer_number)
        if cache is None:
            shape = (self.block_allocator.total_count * self.block_size_tokens,) + tuple(like.shape[-2:])
            cache = (
                torch.zeros(shape, dtype=self.params_dtype, device=like.device),
                torch.zeros(shape, dtype=self.params_dtype, device=like.device),
            )
            self.memory_buffer[layer_number] = cache
        return cache

    def cached_attention(self, attention, query, key, value, rotary_pos_emb):
        step = self._step
        if step is None:
            raise ValueError("DynamicInferenceContext: call prepare_step() before the forward pass")
        if query.shape[1] != 1:
            raise ValueError(f"the dynamic context runs a flat batch of tokens [t, 1, ...], got {tuple(query.shape)}")
        if rotary_pos_emb is not None and step.get("rope", (None,))[0] is not rotary_pos_emb:
            # The step's angles are the same for every layer: take cos/sin once per step.
            step["rope"] = (rotary_pos_emb, self._cos_sin(rotary_pos_emb[step["positions"]]))
        query, key = self._rotate_cos_sin(attention, query, key, None if rotary_pos_emb is None else step["rope"][1])
        key_cache, value_cache = self._layer_cache(attention.layer_number, key)
        key_cache.index_copy_(0, step["slots"], key[:, 0].to(key_cache.dtype))
        value_cache.index_copy_(0, step["slots"], value[:, 0].to(value_cache.dtype))
        r, groups, d = step["num_requests"], key.shape[2], key.shape[3]
        heads = query.shape[2]
        if "view" in step:
            first, stride, length = step["view"]

            def view(cache):  # [L, r, groups, d] over the pool, no copy
                return cache.as_strided(
                    (length, r, groups, d),
                    (groups * d, stride * groups * d, d, 1),
                    cache.storage_offset() + first * groups * d,
                )

            keys, values = view(key_cache), view(value_cache)
        else:
            table = step["block_table"]

            def gather(cache):  # [r, L, groups, d] -> [L, r, groups, d]
                blocks = cache.view(-1, self.block_size_tokens, groups, d)[table]
                return blocks.view(r, -1, groups, d).transpose(0, 1)

            keys, values = gather(key_cache), gather(value_cache)
            if "kv_length" in step:
                keys, values = keys[: step["kv_length"]], values[: step["kv_length"]]
        if step["decode_only"]:
            padded_query = query.view(1, r, heads, d)
        elif r == 1:
            padded_query = query  # one request's chunk: nothing to pad
        else:
            padded_query = query[:, 0][step["pad_index"]].transpose(0, 1)  # [max_q, r, heads, d]
        context = attention.core_attention(
            padded_query,
            keys,
            values,
            step["mask"],
            attn_mask_type=AttnMaskType.no_mask,
            attention_bias=None,
            packed_seq_params=None,
        )  # [max_q, r, heads * d]
        if step["decode_only"]:
            return context.view(r, 1, heads * d)
        if r == 1:
            return context
        flat = context.transpose(0, 1).reshape(-1, heads * d)
        return flat[step["unpad_index"]].unsqueeze(1)

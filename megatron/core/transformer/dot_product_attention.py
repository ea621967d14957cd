"""Core attention: softmax(q k^T * scale + mask) v over tensor-parallel heads.

``config.attention_backend`` picks the implementation per call (:mod:`.attention_backends`): the explicit reference
(``unfused``, ``local``), PyTorch's ``scaled_dot_product_attention`` (``fused``; ``flash`` and ``auto`` without a
sliding window), or the Triton flash kernel for sliding windows (``flash``; ``auto`` where it can run). Masks are
boolean with True = masked out (Megatron's convention); SDPA wants True = keep, so the mask is inverted once here.
With ``context_parallel_size > 1`` the work goes to the context-parallel core attention
(:mod:`megatron.core.transformer.context_parallel`, ``cp_comm_type`` picks ring / all-gather / all-to-all), so the
local layer spec runs CP without any model change."""

import functools
import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.fusions.fused_flash_attention import flash_attention, sliding_window_mask
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.transformer.attention_backends import SDPA, TRITON, check_attention_backend, select_implementation
from megatron.core.transformer.context_parallel import ContextParallelAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    attention_mask_func,
    get_sliding_window_causal_mask,
    is_layer_window_attention,
)
from megatron.core.utils import divide, get_current_device


def _sequence_ids(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Index of the packed sequence each token belongs to, from cumulative lengths ``[0, l0, l0 + l1, ...]``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)


# SDPA's enable_gqa (torch >= 2.5; setup.py allows 2.4) lets shared key/value heads be read in place.
_SDPA_HAS_ENABLE_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)
# Query chunk of windowed SDPA: at least this many queries, or twice the window (docs/attention-backends.md).
_MIN_WINDOW_CHUNK = 64


class DotProductAttention(MegatronModule):
    """Attention over this rank's heads. Inputs ``[s, b, heads, head_dim]``; output ``[s, b, heads * head_dim]``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp_size = tp_group_or_default(pg_collection).size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = softmax_scale or config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # Sliding-window attention on this layer (config.window_size, every layer unless window_attn_skip_freq
        # makes some of them full attention).
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number):
            self.window_size = tuple(config.window_size)
        else:
            self.window_size = None
        check_attention_backend(config.attention_backend, self.window_size, self.dropout_p, get_current_device())
        # The explicit path's softmax, as in Megatron. The scores reach it already scaled and in the softmax's dtype
        # (fp32 with attention_softmax_in_fp32), so it neither upcasts nor casts back (input_in_fp16/bf16 False);
        # the window is part of the mask this module hands it.
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=False,
            input_in_bf16=False,
            attn_mask_type=self.attn_mask_type,
            scaled_masked_softmax_fusion=config.masked_softmax_fusion,
            mask_func=attention_mask_func,
            softmax_in_fp32=config.attention_softmax_in_fp32,
            scale=None,
        )
        self.context_parallel = None
        if config.context_parallel_size > 1:
            self.context_parallel = self._context_parallel_attention(cp_comm_type, pg_collection)

    def _context_parallel_attention(self, cp_comm_type, pg_collection) -> ContextParallelAttention:
        """The CP core attention this module runs: ``cp_comm_type`` (or the config's, default ``p2p``) over the
        context-parallel group of ``pg_collection`` (default parallel_state's)."""
        config = self.config
        if self.attention_type != "self":
            raise ValueError(
                f"context parallelism supports self-attention only, not {self.attention_type!r} "
                "attention; use context_parallel_size=1"
            )
        if self.window_size is not None:
            raise ValueError("context parallelism does not support sliding-window attention (window_size)")
        if cp_comm_type is None:
            cp_comm_type = config.cp_comm_type
            if isinstance(cp_comm_type, list):
                cp_comm_type = cp_comm_type[self.layer_number - 1]
        cp_comm_type = cp_comm_type or "p2p"
        if getattr(pg_collection, "cp", None) is not None:
            cp_group, hierarchical = pg_collection.cp, getattr(pg_collection, "hcp", None)
        else:
            cp_group = parallel_state.get_context_parallel_group()
            hierarchical = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        if cp_group.size() != config.context_parallel_size:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size} but the context-parallel group has "
                f"{cp_group.size()} ranks; initialize_model_parallel(context_parallel_size=...) must match the config"
            )
        return ContextParallelAttention(
            cp_comm_type,
            cp_group,
            self.attn_mask_type,
            self.softmax_scale,
            self.num_attention_heads_per_partition,
            self.num_query_groups_per_partition,
            hierarchical,
            config.attention_backend,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ):
        mask_type = attn_mask_type or self.attn_mask_type
        if self.context_parallel is not None:
            if packed_seq_params is not None:
                raise ValueError(
                    "not supported yet: packed sequences (THD) with context parallelism; use "
                    "context_parallel_size=1 or unpacked [s, b] batches"
                )
            if attention_bias is not None:
                raise ValueError("not supported yet: attention_bias with context parallelism")
            dropout_p = self.dropout_p if self.training else 0.0
            return self.context_parallel(
                query, key, value, attention_mask, mask_type, dropout_p, self.config.sequence_parallel
            )
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, attention_mask, mask_type, attention_bias, packed_seq_params)
        sq, b, heads, head_dim = query.shape
        out_dtype = query.dtype
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        caller_mask = attention_mask is not None or attention_bias is not None
        alignment = self._flash_alignment(mask_type, sq, k.shape[2])
        implementation = select_implementation(
            self.config.attention_backend, self.window_size, q.device, dropout_p, caller_mask or alignment is None
        )
        if implementation == TRITON:
            causal, q_offset = alignment
            context, _ = flash_attention(q, k, v, self.softmax_scale, causal, self.window_size, q_offset=q_offset)
        else:
            if implementation == SDPA and self._upcast_for_cpu_sdpa(q):
                q, k, v = q.float(), k.float(), v.float()
            chunked = implementation == SDPA and self._window_in_chunks(caller_mask, alignment)
            if chunked:
                mask, is_causal = None, False
            else:
                mask, is_causal = self._sdpa_mask(attention_mask, mask_type, attention_bias, sq, k.shape[2], q.device)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(q.dtype)
            if chunked:
                run = functools.partial(self._sdpa_window_chunks, alignment=alignment)
            else:
                run = self._sdpa if implementation == SDPA else self._unfused
            if dropout_p > 0.0 and not self.config.sequence_parallel:
                # Heads are split over TP ranks, so each rank draws its own masks from the tensor-parallel stream
                # (under sequence parallelism the whole block already runs inside that stream).
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    context = run(q, k, v, mask, dropout_p, is_causal)
            else:
                context = run(q, k, v, mask, dropout_p, is_causal)
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim).to(out_dtype)

    def _window_in_chunks(self, caller_mask: bool, alignment) -> bool:
        # Only a window bounded on the left leaves each query chunk a short span of keys.
        return self.window_size is not None and self.window_size[0] >= 0 and not caller_mask and alignment is not None

    def _sdpa_window_chunks(self, q, k, v, _mask, dropout_p, _is_causal, alignment):
        """Sliding-window attention through SDPA one query chunk at a time, each over only the keys its window
        reaches: masks of ``[chunk, chunk + left]`` instead of ``[sq, sk]``, and ``O(s * window)`` work."""
        causal, q_offset = alignment
        left, right = self.window_size
        if causal:
            right = 0 if right < 0 else min(right, 0)
        sq, sk = q.shape[2], k.shape[2]
        chunk = max(2 * left, _MIN_WINDOW_CHUNK)
        pieces = []
        for start in range(0, sq, chunk):
            stop = min(sq, start + chunk)
            first = max(0, start + q_offset - left)
            last = sk if right < 0 else min(sk, stop + q_offset + right)
            masked = sliding_window_mask(
                stop - start, last - first, start + q_offset - first, causal, (left, right), q.device
            )
            keys, values = k[:, :, first:last], v[:, :, first:last]
            pieces.append(self._sdpa(q[:, :, start:stop], keys, values, ~masked, dropout_p, False))
        return torch.cat(pieces, dim=2)

    def _upcast_for_cpu_sdpa(self, q: torch.Tensor) -> bool:
        # GPU kernels keep the softmax in fp32 internally; the CPU kernel computes in the input dtype.
        return self.config.attention_softmax_in_fp32 and q.device.type == "cpu" and q.dtype != torch.float32

    def _flash_alignment(self, mask_type, sq: int, sk: int) -> Optional[Tuple[bool, int]]:
        """``(causal, q_offset)`` for the Triton kernel, or None when the mask type and the window disagree on
        where the queries sit (top-left causal with a bottom-right window, only when ``sq != sk``)."""
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
        if sq != sk and mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            return None
        return causal, sk - sq

    def _packed_forward(self, query, key, value, attention_mask, mask_type, attention_bias, packed_seq_params):
        """THD: ``[t, heads, d]`` inputs of concatenated sequences -> ``[t, heads * d]``; a token attends only to
        tokens of its own sequence (causally within it for causal mask types)."""
        if packed_seq_params.qkv_format != "thd" or query.dim() != 3:
            raise ValueError("packed_seq_params needs qkv_format='thd' and [t, heads, d] query/key/value")
        if attention_mask is not None:
            raise ValueError("packed sequences take their mask from packed_seq_params; pass attention_mask=None")
        cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)
        if causal and not torch.equal(cu_q, cu_kv):
            raise ValueError("causal attention over packed sequences needs cu_seqlens_q == cu_seqlens_kv")
        other_sequence = _sequence_ids(cu_q, query.device)[:, None] != _sequence_ids(cu_kv, query.device)[None, :]
        # With the same boundaries, the global causal mask restricted to one sequence is that sequence's causal mask.
        context = self.forward(
            query.unsqueeze(1),
            key.unsqueeze(1),
            value.unsqueeze(1),
            other_sequence[None, None],
            mask_type,
            attention_bias,
        )
        return context.squeeze(1)

    def _sdpa(self, q, k, v, keep_mask, dropout_p, is_causal):
        # Shared key/value heads are read in place (enable_gqa): measured faster than copying them on CPU, forward
        # and backward (docs/attention-backends.md).
        groups_repeat = q.shape[1] // k.shape[1]
        if groups_repeat > 1 and not _SDPA_HAS_ENABLE_GQA:
            k, v = k.repeat_interleave(groups_repeat, dim=1), v.repeat_interleave(groups_repeat, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=keep_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=self.softmax_scale,
            **({"enable_gqa": True} if groups_repeat > 1 and _SDPA_HAS_ENABLE_GQA else {}),
        )

    def _unfused(self, q, k, v, sdpa_mask, dropout_p, is_causal):
        """The explicit path (Megatron's local attention): scores ``q k^T * scale`` (+ bias), ``scale_mask_softmax``
        (fp32 with ``attention_softmax_in_fp32``), dropout, ``· v``; from the same (keep mask or bias, is_causal)
        that SDPA takes."""
        masked, bias = None, None
        if sdpa_mask is not None and sdpa_mask.dtype == torch.bool:
            masked = ~sdpa_mask
        elif sdpa_mask is not None:
            masked = torch.isneginf(sdpa_mask)
            bias = sdpa_mask.masked_fill(masked, 0.0)
        sq, sk = q.shape[2], k.shape[2]
        # The softmax module generates the causal mask itself for a causal layer without a mask: hand it the mask
        # whenever this call wants something else.
        generates_causal = self.scale_mask_softmax.attn_mask_type == AttnMaskType.causal and sq > 1
        if is_causal and not (generates_causal and sq == sk):
            masked = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        elif not is_causal and masked is None and generates_causal:
            masked = torch.zeros(1, 1, 1, sk, dtype=torch.bool, device=q.device)
        heads, groups = q.shape[1], k.shape[1]
        if heads != groups:
            k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2))
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        scores = scores * self.softmax_scale
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        probs = self.scale_mask_softmax(scores, masked)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs.to(v.dtype), v)

    def _sdpa_mask(self, attention_mask, mask_type, attention_bias, sq, sk, device):
        """Turn Megatron's (True = masked) mask and mask type into SDPA's (keep mask or bias, is_causal).

        ``causal`` / ``padding_causal`` align query ``i`` with key ``i`` (top-left, as SDPA's ``is_causal``);
        ``causal_bottom_right`` aligns the queries with the last ``sq`` keys (queries continuing a cached prefix).
        The two agree when ``sq == sk``. A sliding window further hides keys outside it.
        """
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        bottom_right = mask_type is AttnMaskType.causal_bottom_right and sq != sk
        if attention_mask is None and attention_bias is None and not bottom_right and self.window_size is None:
            return None, (causal or mask_type is AttnMaskType.causal_bottom_right) and sq > 1
        masked = torch.zeros(1, 1, sq, sk, dtype=torch.bool, device=device)
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask must be a bool tensor (True = masked), got {attention_mask.dtype}")
            masked = masked | attention_mask
        if causal or mask_type is AttnMaskType.causal_bottom_right:
            diagonal = sk - sq + 1 if mask_type is AttnMaskType.causal_bottom_right else 1
            masked = masked | torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal)
        if self.window_size is not None:
            masked = masked | get_sliding_window_causal_mask(sq, sk, self.window_size).to(device)
        if attention_bias is None:
            return ~masked, False
        bias = attention_bias.float().masked_fill(masked, float("-inf"))
        return bias, False

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: Tuple[Tuple[int, int, int], ...] = (),
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """Core attention holds no parameters of its own (softmax offsets, Megatron's only ones, are not built),
        so its sharded state is whatever the default finds: nothing, for this module."""
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

"""Self- and cross-attention: projections, optional q/k norms, rotary embeddings, core attention, output projection.

The QKV weight of self-attention is laid out per query group — ``[q heads of group 0, k of group 0, v of group 0,
q heads of group 1, ...]`` — so a contiguous column-parallel split hands each tensor-parallel rank whole groups
(Megatron's layout). Cross-attention projects queries from the hidden states and keys/values from the context.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Tuple, Union

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.rope_utils import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_with_cos_sin,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

if TYPE_CHECKING:
    from megatron.core.inference.contexts.base_context import BaseInferenceContext

# ---- what the submodule builders and their modules look like (ColumnParallelLinear, DotProductAttention fit) ----


class LinearQkvInterface(Protocol):
    """The fused QKV projection: ``(output, bias)``."""

    def forward(self, input: Tensor, /) -> tuple[Tensor, object]: ...

    def backward_dw(self) -> None: ...


class LinearQkvBuilder(Protocol):
    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> LinearQkvInterface: ...


class LinearInterface(Protocol):
    """Cross-attention's query or key/value projection: ``(output, bias)``."""

    def forward(self, input: Tensor, /) -> tuple[Tensor, object]: ...


class LinearLayerBuilder(Protocol):
    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        gather_output: bool,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> LinearInterface: ...


class CoreAttentionInterface(Protocol):
    """Attention over this rank's heads: ``[s, b, heads, d]`` query/key/value -> ``[s, b, heads * d]``."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        /,
        *,
        attn_mask_type: AttnMaskType,
        attention_bias: Tensor | None,
        packed_seq_params: PackedSeqParams | None,
    ) -> Tensor: ...


class CoreAttentionBuilder(Protocol):
    def __call__(
        self,
        *,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None,
        pg_collection: ProcessGroupCollection | None,
    ) -> CoreAttentionInterface: ...


class LinearProjInterface(Protocol):
    """The output projection: ``(output, bias)`` with the bias left for the bias-dropout-add."""

    def forward(self, hidden_states: Tensor, /) -> tuple[Tensor, Tensor | None]: ...

    def backward_dw(self) -> None: ...


class LinearProjBuilder(Protocol):
    def __call__(
        self,
        input_size: int,
        output_size: int,
        /,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> LinearProjInterface: ...


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: LinearQkvBuilder
    core_attention: CoreAttentionBuilder
    linear_proj: LinearProjBuilder
    q_layernorm: Union[ModuleSpec, type, None] = None
    k_layernorm: Union[ModuleSpec, type, None] = None


@dataclass
class CrossAttentionSubmodules:
    linear_q: LinearLayerBuilder
    linear_kv: LinearLayerBuilder
    core_attention: CoreAttentionBuilder
    linear_proj: LinearProjBuilder


def _run_backward_dw(*linears) -> None:
    # Only layers that defer their weight gradient (delay_wgrad_compute) have one to run.
    for linear in linears:
        if hasattr(linear, "backward_dw"):
            linear.backward_dw()


def _is_thd(packed_seq_params, hidden_states: Tensor) -> bool:
    """Whether attention runs on packed sequences (``qkv_format='thd'``, one row of concatenated sequences)."""
    if packed_seq_params is None:
        return False
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(
            f"not supported yet: packed_seq_params with qkv_format={packed_seq_params.qkv_format!r}; use 'thd'"
        )
    if hidden_states.shape[1] != 1:
        raise ValueError(
            f"packed sequences (qkv_format='thd') come as one row of concatenated sequences [t, 1, h]; got batch "
            f"size {hidden_states.shape[1]}"
        )
    return True


class Attention(MegatronModule, ABC):
    """What self- and cross-attention share: head bookkeeping, core attention, output projection and forward.

    ``forward`` returns ``(output, bias)``: the output projection's bias is handed back unapplied for the
    bias-dropout-add. ``pp_layer_offset`` is the index of this stage's first layer when the caller computed it;
    ``name`` is the module's dotted name in the model.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Union[SelfAttentionSubmodules, CrossAttentionSubmodules],
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        pp_layer_offset: Optional[int] = None,
        name: str | None = None,
    ):
        super().__init__(config)
        if config.multi_latent_attention:
            # MLATransformerConfig constructs (it is Megatron's public config), but MLA layers are not built yet.
            raise ValueError(
                "not supported yet: multi-latent attention (multi_latent_attention=True); build the model from a "
                "TransformerConfig with standard or grouped-query attention"
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.pg_collection = pg_collection
        self.pp_layer_offset = pp_layer_offset
        self.name = name
        self.tp_group = tp_group_or_default(pg_collection)
        tp_size = self.tp_group.size()
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.hidden_size_per_attention_head = config.kv_channels
        # divide() raises unless heads and query groups split evenly: each TP rank holds whole heads and groups.
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # Input projections first, then core attention and the output projection: the order in which parameters
        # draw their initial values from the layer's random stream.
        self._build_input_projections(submodules)
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        # Selective recompute (Korthikanti et al., 2022): the s x s attention activations are large, cheap to redo.
        self.checkpoint_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            # Core attention's output is already split by heads across the TP ranks.
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=self.tp_group,
        )
        # Megatron registers core attention and the output projection before the input projections. Registration
        # order is parameter order, which lays out the DDP buffers and so the distributed optimizer's bucket-space
        # checkpoints: follow it (the construction order above only fixes the random draws).
        for name in [name for name in self._modules if name not in ("core_attention", "linear_proj")]:
            self._modules[name] = self._modules.pop(name)

    @abstractmethod
    def _build_input_projections(self, submodules) -> None:
        """Build the projections that produce queries, keys and values."""

    @abstractmethod
    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor] | tuple[Tensor, list[int]]:
        """Query ``[sq, b, heads, d]`` and key/value ``[sk, b, groups, d]`` of this rank's heads."""

    def set_for_recompute_input_layernorm(self):
        """Prepare the projection that reads the layer's input norm for that norm being recomputed; attention
        without such a projection has nothing to prepare."""

    def _rotate(self, query: Tensor, key: Tensor, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, packed_seq_params):
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            q_seqlens = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
            kv_seqlens = packed_seq_params.cu_seqlens_kv if packed_seq_params is not None else None
            if q_pos_emb is not None:
                query = apply_rotary_pos_emb(query, q_pos_emb, self.config, cu_seqlens=q_seqlens)
            if k_pos_emb is not None:
                key = apply_rotary_pos_emb(key, k_pos_emb, self.config, cu_seqlens=kv_seqlens)
        elif rotary_pos_cos is not None and rotary_pos_sin is not None:
            interleaved = self.config.rotary_interleaved
            query = apply_rotary_pos_emb_with_cos_sin(query, rotary_pos_cos, rotary_pos_sin, interleaved)
            key = apply_rotary_pos_emb_with_cos_sin(key, rotary_pos_cos, rotary_pos_sin, interleaved)
        return query, key

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor,
        key_value_states: Optional[Tensor] = None,
        inference_context: Optional[BaseInferenceContext] = None,
        rotary_pos_emb: Optional[Union[Tensor, Tuple[Tensor, Tensor]]] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params: Optional[BaseInferenceContext] = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention over ``hidden_states`` ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

        ``rotary_pos_emb`` is one angle tensor for queries and keys or a ``(query, key)`` pair; precomputed
        ``rotary_pos_cos`` / ``rotary_pos_sin`` may be given instead. With ``packed_seq_params``
        (``qkv_format='thd'``) ``hidden_states`` is one row ``[t, 1, h]`` of concatenated sequences, each attending
        only within itself, with positions restarting per sequence.

        With an ``inference_context`` (``inference_params`` is its old name) the context rotates the new tokens'
        query/key, stores their keys/values in its KV cache and runs core attention over the cached sequence.
        """
        inference_context = inference_context if inference_context is not None else inference_params
        if sequence_len_offset is not None:
            raise ValueError("sequence_len_offset is not used: the inference context carries the positions")
        if rotary_pos_cos_sin is not None:
            raise ValueError(
                "not supported yet: the fused cos/sin RoPE tensor of inference kernels "
                "(rotary_pos_cos_sin); pass rotary_pos_cos and rotary_pos_sin"
            )
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if inference_context is not None:
            if self.attention_type != "self" or packed_seq_params is not None or rotary_pos_cos is not None:
                raise ValueError(
                    "inference with a KV cache supports self-attention with rotary_pos_emb (or no "
                    "rotary), without packed_seq_params"
                )
            return self.linear_proj(inference_context.cached_attention(self, query, key, value, rotary_pos_emb))
        packed = _is_thd(packed_seq_params, hidden_states)
        if packed:
            # Packed sequences: one row [t, 1, ...] of concatenated sequences becomes [t, heads, d] (THD).
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        query, key = self._rotate(query, key, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, packed_seq_params)
        # Only training runs backward, so only then is there anything to recompute.
        if self.checkpoint_core_attention and self.training:
            context = tensor_parallel.checkpoint(
                self._core_attention, False, query, key, value, attention_mask, attention_bias, packed_seq_params
            )
        else:
            context = self._core_attention(query, key, value, attention_mask, attention_bias, packed_seq_params)
        if packed:
            # Back to the [t, 1, h] row layout the output projection and the residual expect.
            context = context.reshape(context.shape[0], 1, -1)
        return self.linear_proj(context)

    def _core_attention(self, query, key, value, attention_mask, attention_bias, packed_seq_params):
        return self.core_attention(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )


class SelfAttention(Attention):
    """Multi-head or grouped-query self-attention with a fused QKV projection and optional q/k norms."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        pp_layer_offset: Optional[int] = None,
        name: str | None = None,
    ):
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type,
            "self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        self.q_layernorm = self._head_norm(submodules.q_layernorm)
        self.k_layernorm = self._head_norm(submodules.k_layernorm)

    def _build_input_projections(self, submodules: SelfAttentionSubmodules) -> None:
        config = self.config
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.tp_group,
        )

    def _head_norm(self, spec):
        if spec is None:
            return IdentityOp()
        norm = build_module(
            spec, config=self.config, hidden_size=self.hidden_size_per_attention_head, eps=self.config.layernorm_epsilon
        )
        # Heads are split over TP ranks but every rank applies the same per-head norm: its weight is replicated and
        # each rank's gradient covers only its own heads, so it is reduced across TP like a sequence-parallel norm.
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor] | tuple[Tensor, list[int]]:
        """Project and split into query ``[s, b, heads, d]`` and key/value ``[s, b, groups, d]`` for this rank
        (q/k norms applied). With ``split_qkv=False``: the projection ``[s, b, groups, (heads/group + 2) * d]`` and
        the sizes ``[q, k, v]`` to split each group's channels by, for a fused kernel to split itself."""
        if key_value_states is not None:
            raise ValueError("SelfAttention takes no key_value_states; use CrossAttention to attend to a context")
        if output_gate:
            raise ValueError("not supported yet: gated attention output (output_gate=True)")
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        d = self.hidden_size_per_attention_head
        s, b = mixed_qkv.shape[:2]
        # The projection's channels are grouped per query group, [q heads; k; v] each (module docstring).
        mixed_qkv = mixed_qkv.view(s, b, self.num_query_groups_per_partition, (heads_per_group + 2) * d)
        split_sizes = [heads_per_group * d, d, d]
        if not split_qkv:
            return mixed_qkv, split_sizes
        query, key, value = torch.split(mixed_qkv, split_sizes, dim=3)
        query = query.reshape(s, b, self.num_attention_heads_per_partition, d)
        return self.q_layernorm(query), self.k_layernorm(key), value

    def set_for_recompute_input_layernorm(self):
        """Prepare for the layer recomputing its input norm (``recompute_modules`` has ``layernorm``).

        Transformer Engine's FP8 QKV projection must then keep its un-quantised input; the projections built here
        always keep their input for backward, so there is nothing to change.
        """

    def backward_dw(self) -> None:
        """Run the deferred weight gradients of the QKV and output projections (``delay_wgrad_compute``)."""
        _run_backward_dw(self.linear_qkv, self.linear_proj)


class CrossAttention(Attention):
    """Attention from ``hidden_states`` (queries) to ``key_value_states`` (the context, e.g. an encoder's output).

    Queries and key/values have separate column-parallel projections; every query head has its own key/value head.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: CrossAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
    ):
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError(
                f"not supported yet: grouped-query cross-attention (num_query_groups={config.num_query_groups} "
                f"!= num_attention_heads={config.num_attention_heads})"
            )
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type,
            "cross",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            name=name,
        )

    def _build_input_projections(self, submodules: CrossAttentionSubmodules) -> None:
        config = self.config
        column_kwargs = dict(
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=config.add_bias_linear,
            skip_bias_add=False,
            is_expert=False,
            tp_group=self.tp_group,
        )
        self.linear_q = build_module(
            submodules.linear_q, config.hidden_size, self.query_projection_size, **column_kwargs
        )
        self.linear_kv = build_module(
            submodules.linear_kv, config.hidden_size, 2 * self.kv_projection_size, **column_kwargs
        )

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Optional[Tensor],
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """Query ``[sq, b, heads, d]`` from ``hidden_states``; key and value ``[sk, b, heads, d]`` from
        ``key_value_states`` (each head's ``[k; v]`` channels are adjacent in the kv projection)."""
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the context to attend to)")
        if output_gate or not split_qkv:
            raise ValueError("not supported yet: output_gate / split_qkv=False in CrossAttention")
        heads, d = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_kv, _ = self.linear_kv(key_value_states)
        mixed_kv = mixed_kv.view(*mixed_kv.shape[:2], heads, 2 * d)
        key, value = torch.split(mixed_kv, [d, d], dim=-1)
        query, _ = self.linear_q(hidden_states)
        return query.view(*query.shape[:2], heads, d), key, value

"""Self-attention: fused QKV projection, optional q/k norms, rotary embeddings, core attention, output projection.

The QKV weight is laid out per query group — ``[q heads of group 0, k of group 0, v of group 0, q heads of group 1,
...]`` — so a contiguous column-parallel split hands each tensor-parallel rank whole groups (Megatron's layout).
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection, tp_group_or_default
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


class SelfAttention(MegatronModule):
    """Multi-head or grouped-query self-attention over ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

    Returns ``(output, bias)``: the output projection's bias is handed back unapplied for the bias-dropout-add.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.pg_collection = pg_collection
        tp_group = tp_group_or_default(pg_collection)
        tp_size = tp_group.size()
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

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
            tp_group=tp_group,
        )
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
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
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=tp_group,
        )
        self.q_layernorm = self._head_norm(submodules.q_layernorm)
        self.k_layernorm = self._head_norm(submodules.k_layernorm)

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

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states=None):
        """Project and split into query ``[s, b, heads, d]`` and key/value ``[s, b, groups, d]`` for this rank."""
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        d = self.hidden_size_per_attention_head
        s, b = mixed_qkv.shape[:2]
        mixed_qkv = mixed_qkv.view(s, b, self.num_query_groups_per_partition, (heads_per_group + 2) * d)
        query, key, value = torch.split(mixed_qkv, [heads_per_group * d, d, d], dim=3)
        query = query.reshape(s, b, self.num_attention_heads_per_partition, d)
        return self.q_layernorm(query), self.k_layernorm(key), value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        if inference_context is not None or inference_params is not None:
            raise ValueError("inference contexts (KV caches) are not supported by SelfAttention yet")
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if rotary_pos_emb is not None:
            query = apply_rotary_pos_emb(query, rotary_pos_emb, self.config)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, self.config)
        if self.checkpoint_core_attention and self.training:
            context = tensor_parallel.checkpoint(
                self._core_attention, False, query, key, value, attention_mask, attention_bias
            )
        else:
            context = self._core_attention(query, key, value, attention_mask, attention_bias)
        return self.linear_proj(context)

    def _core_attention(self, query, key, value, attention_mask, attention_bias):
        return self.core_attention(
            query, key, value, attention_mask, attn_mask_type=self.attn_mask_type, attention_bias=attention_bias
        )

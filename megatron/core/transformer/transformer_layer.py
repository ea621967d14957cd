"""One transformer layer: pre-norm self-attention and MLP sublayers, each closed by bias-dropout-add."""

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Union[ModuleSpec, type] = IdentityOp
    self_attention: Union[ModuleSpec, type] = IdentityOp
    self_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_cross_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    cross_attention: Union[ModuleSpec, type] = IdentityOp
    cross_attn_bda: Union[ModuleSpec, type] = IdentityFuncOp
    pre_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp
    mlp: Union[ModuleSpec, type] = IdentityOp
    mlp_bda: Union[ModuleSpec, type] = IdentityFuncOp
    sharded_state_dict_keys_map: dict = field(default_factory=dict)


class TransformerLayer(MegatronModule):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (dropout on each sublayer output).

    ``layer_number`` is 1-based and global across pipeline stages. Cross-attention is not built by the GPT specs
    and is rejected here when a spec asks for it.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config)
        if submodules.cross_attention is not IdentityOp:
            raise ValueError("cross_attention is not supported in TransformerLayer; use IdentityOp in the spec")
        self.submodules_config = submodules
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kwargs)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=layer_number, pg_collection=pg_collection
        )
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kwargs)
        self.mlp = build_module(submodules.mlp, config=config, pg_collection=pg_collection)
        self.mlp_bda = build_module(submodules.mlp_bda)
        self.recompute_input_layernorm = self._recompute("layernorm") and not isinstance(
            self.input_layernorm, IdentityOp
        )
        self.recompute_pre_mlp_layernorm = self._recompute("layernorm") and not isinstance(
            self.pre_mlp_layernorm, IdentityOp
        )

    def _recompute(self, module_name: str) -> bool:
        config = self.config
        return config.recompute_granularity == "selective" and module_name in config.recompute_modules

    def _norm(self, norm, hidden_states: torch.Tensor, recompute: bool) -> torch.Tensor:
        if recompute and self.training:
            return tensor_parallel.checkpoint(norm, False, hidden_states)
        return norm(hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """Returns ``(hidden_states, context)`` as Megatron's layer does."""
        fused = self.config.bias_dropout_fusion
        normed = self._norm(self.input_layernorm, hidden_states, self.recompute_input_layernorm)
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        attention_output_with_bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            attention_bias=attention_bias,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
        )
        hidden_states = self.self_attn_bda(self.training, fused)(
            attention_output_with_bias, residual, self.hidden_dropout
        )

        normed = self._norm(self.pre_mlp_layernorm, hidden_states, self.recompute_pre_mlp_layernorm)
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        mlp_output_with_bias = self.mlp(normed)
        hidden_states = self.mlp_bda(self.training, fused)(mlp_output_with_bias, residual, self.hidden_dropout)
        return hidden_states, context

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The default sharded state, with checkpoint keys renamed by the spec's ``sharded_state_dict_keys_map``.

        The local spec maps ``input_layernorm.`` to ``self_attention.linear_qkv.layer_norm_`` (and the pre-MLP
        norm likewise into fc1), the names Transformer Engine's fused norm+linear layers use, so checkpoints of
        either spec share keys. Only checkpoint keys change; the dict keys stay this module's state-dict names.
        """
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        keys_map = self.submodules_config.sharded_state_dict_keys_map
        if keys_map:
            prefixed_map = {f"{prefix}{old}": f"{prefix}{new}" for old, new in keys_map.items()}
            apply_prefix_mapping(sharded_state_dict, prefixed_map)
        return sharded_state_dict

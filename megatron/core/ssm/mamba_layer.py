"""One Mamba layer of a hybrid model: ``x + dropout(mixer(norm(x)))``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import torch

from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

if TYPE_CHECKING:
    # The layer hands the context to its mixer (protocol: megatron.core.ssm.mamba_inference); the annotation keeps
    # Megatron's name without importing megatron.core.inference.
    BaseInferenceContext = Any


@dataclass
class MambaLayerSubmodules:
    """``norm`` (the pre-mixer norm; IdentityOp when in_proj fuses it, as Transformer Engine's spec does),
    ``mixer`` (a :class:`~megatron.core.ssm.mamba_mixer.MambaMixer` spec), ``mamba_bda`` (bias-dropout-add), and
    ``sharded_state_dict_keys_map``: checkpoint-key prefixes to rename. The local spec maps ``norm.`` to
    ``mixer.in_proj.layer_norm_``, so a separate norm is stored under the fused layer's name
    ``mixer.in_proj.layer_norm_weight`` and checkpoints of either spec share keys."""

    norm: Union[ModuleSpec, type] = IdentityOp
    mixer: Union[ModuleSpec, type] = IdentityOp
    mamba_bda: Union[ModuleSpec, type] = IdentityOp
    sharded_state_dict_keys_map: Dict[str, str] = field(default_factory=dict)


class MambaLayer(MegatronModule):
    """A residual block around a Mamba mixer: ``hidden_states + dropout(mixer(norm(hidden_states)))``, on ``[s, b, h]``.

    ``layer_number`` is the layer's 1-based global number (the hybrid block adds its stage's offset before building
    the layer); it is passed on to the mixer with ``pg_collection`` and ``pp_layer_offset``. The residual is kept in
    fp32 when ``config.fp32_residual_connection`` is set.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaLayerSubmodules,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection = None,
        pp_layer_offset: int = 0,
        name: str | None = None,
    ):
        super().__init__(config)
        self.submodules_config = submodules
        self.layer_number = layer_number
        self.pg_collection = pg_collection
        self.name = name
        self.hidden_dropout = config.hidden_dropout
        self.residual_in_fp32 = config.fp32_residual_connection
        self.mixer = build_module(
            submodules.mixer,
            config,
            d_model=config.hidden_size,
            layer_number=layer_number,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
        )
        self.norm = build_module(
            submodules.norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
        )
        self.mamba_bda = build_module(submodules.mamba_bda)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        inference_context: Optional[BaseInferenceContext] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        *,
        inference_params: Optional[BaseInferenceContext] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """The layer's output ``[s, b, h]``. ``attention_mask`` and ``rotary_pos_emb`` are what a hybrid block hands
        every layer; a Mamba layer is causal by construction and has no positions, so it does not read them."""
        inference_context = inference_context if inference_context is not None else inference_params
        residual = hidden_states.float() if self.residual_in_fp32 else hidden_states
        hidden_states = self.norm(hidden_states.to(dtype=self.config.params_dtype))
        # A dynamic (continuous-batching) context runs a flat batch of tokens [t, 1, h]; the mixer's recurrence
        # needs one row per request, so the context regroups the tokens around the mixer.
        regroup = inference_context is not None and hasattr(inference_context, "mamba_tokens_to_rows")
        if regroup:
            hidden_states = inference_context.mamba_tokens_to_rows(hidden_states)
        mixer_output_with_bias = self.mixer(
            hidden_states, inference_context=inference_context, packed_seq_params=packed_seq_params
        )
        if regroup:
            output, bias = mixer_output_with_bias
            mixer_output_with_bias = (inference_context.mamba_rows_to_tokens(output), bias)
        return self.mamba_bda(self.training, self.config.bias_dropout_fusion)(
            mixer_output_with_bias, residual, self.hidden_dropout
        )

    def mamba_state_shapes_per_request(self):
        """The mixer's conv and SSM state shapes of one sequence (see ``MambaMixer.mamba_state_shapes_per_request``)."""
        return self.mixer.mamba_state_shapes_per_request()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """The default sharded state with checkpoint keys renamed by the spec's ``sharded_state_dict_keys_map``
        (only checkpoint keys change; the dict keys stay this module's state-dict names)."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        keys_map = self.submodules_config.sharded_state_dict_keys_map
        if keys_map:
            prefixed_map = {f"{prefix}{old}": f"{prefix}{new}" for old, new in keys_map.items()}
            apply_prefix_mapping(sharded_state_dict, prefixed_map)
        return sharded_state_dict

"""One transformer layer: pre-norm self-attention (optionally cross-attention) and MLP sublayers, each closed by
bias-dropout-add; and the pipeline split that says which global layers a stage builds."""

from __future__ import annotations

import contextlib
from abc import ABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Protocol, Union

from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.transformer_config import TransformerConfig

if TYPE_CHECKING:
    from megatron.core.inference.contexts.base_context import BaseInferenceContext

# ---- the pipeline layer split ----------------------------------------------------------------------------------


def layers_per_virtual_stage(
    num_layers: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
) -> List[int]:
    """Layers built by each virtual stage, in pipeline order (virtual stage ``c * pp + r``: chunk ``c`` of rank ``r``).

    The one definition of the pipeline layer split (``validate_args`` and the layout report use it too); the
    arguments are the :class:`TransformerConfig` fields of the same names. Without virtual stages there is one per
    pipeline rank. Layers are split evenly, except that ``num_layers_in_first/last_pipeline_stage`` fix the
    first/last rank's share (the rest split evenly over the other ranks), and
    ``account_for_embedding/loss_in_pipeline_split`` count the embedding / the loss as one more layer of the first /
    last virtual stage. Each rank's share splits evenly into its virtual stages. A bad split raises a ``ValueError``
    naming the fields.
    """
    pp = pipeline_model_parallel_size
    for name, value in (("num_layers", num_layers), ("pipeline_model_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    vp = virtual_pipeline_model_parallel_size or 1
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    extra_first = int(account_for_embedding_in_pipeline_split)
    extra_last = int(account_for_loss_in_pipeline_split)
    if first is not None or last is not None:
        if extra_first or extra_last:
            raise ValueError(
                "num_layers_in_first/last_pipeline_stage cannot be combined with account_for_embedding_in_pipeline_"
                "split or account_for_loss_in_pipeline_split; use one way of balancing the stages"
            )
        per_rank = _uneven_layers_per_rank(num_layers, pp, first, last)
    else:
        slots = num_layers + extra_first + extra_last
        if slots % pp != 0:
            counted = f"num_layers ({num_layers})"
            if extra_first or extra_last:
                counted += f" + embedding/loss ({extra_first + extra_last}) = {slots}"
            raise ValueError(
                f"{counted} is not divisible by pipeline_model_parallel_size ({pp}); change num_layers or "
                "pipeline_model_parallel_size, or set num_layers_in_first/last_pipeline_stage for an uneven split"
            )
        per_rank = [slots // pp] * pp
    for rank, count in enumerate(per_rank):
        if count % vp != 0:
            raise ValueError(
                f"pipeline stage {rank} has {count} layers, not divisible by virtual_pipeline_model_parallel_size "
                f"({vp}); change num_layers, the stage sizes or virtual_pipeline_model_parallel_size so that every "
                "stage's layers split evenly into its model chunks"
            )
    # Pipeline order: every rank's chunk 0, then every rank's chunk 1, ... (virtual stage c * pp + r).
    per_virtual = [per_rank[rank] // vp for _ in range(vp) for rank in range(pp)]
    # Each virtual stage has at least one slot, and the first and last differ unless there is only one (which then
    # has num_layers + both extras), so no count goes negative.
    per_virtual[0] -= extra_first
    per_virtual[-1] -= extra_last
    return per_virtual


def _uneven_layers_per_rank(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> List[int]:
    if pp == 1:
        raise ValueError(
            "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1; unset them for one stage"
        )
    for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError(
            f"num_layers ({num_layers}) does not match num_layers_in_first_pipeline_stage ({first}) + "
            f"num_layers_in_last_pipeline_stage ({last}) on {pp} pipeline stages; make them add up to at most "
            "num_layers (exactly num_layers when they are the only stages)"
        )
    if middle_stages and middle_layers % middle_stages != 0:
        raise ValueError(
            f"the {middle_layers} layers left after num_layers_in_first/last_pipeline_stage do not divide evenly "
            f"over the other {middle_stages} pipeline stages; adjust num_layers, the first/last stage sizes or "
            "pipeline_model_parallel_size"
        )
    per_rank = [middle_layers // middle_stages if middle_stages else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return per_rank


def _layers_per_virtual_stage(config: TransformerConfig) -> List[int]:
    """:func:`layers_per_virtual_stage` for ``config``'s fields, or its pipeline layout's decoder counts."""
    if config.pipeline_model_parallel_layout is not None:
        return config.pipeline_model_parallel_layout.layers_per_virtual_stage()
    return layers_per_virtual_stage(
        config.num_layers,
        config.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
        config.account_for_embedding_in_pipeline_split,
        config.account_for_loss_in_pipeline_split,
    )


def _virtual_stage_index(config: TransformerConfig, vp_stage: Optional[int], pp_rank: Optional[int] = None) -> int:
    """Position of chunk ``vp_stage`` of pipeline rank ``pp_rank`` (this rank's when None) among all virtual stages."""
    pp = config.pipeline_model_parallel_size
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
    vp = config.virtual_pipeline_model_parallel_size
    if vp is None:
        return pp_rank
    if vp_stage is None or not 0 <= vp_stage < vp:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={vp} needs the model chunk's vp_stage (0 .. {vp - 1}), "
            f"got {vp_stage!r}; build one model per chunk with vp_stage=chunk"
        )
    return vp_stage * pp + pp_rank


def get_transformer_layer_offset(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
):
    """Global index of the first layer that pipeline rank ``pp_rank`` (this rank when None) builds for model chunk
    ``vp_stage``.

    Virtual stages take consecutive slices of the model in pipeline order: chunk ``c`` of rank ``r`` of ``p``
    comes after every chunk ``< c`` of every rank and after chunk ``c`` of ranks ``< r``.
    """
    counts = _layers_per_virtual_stage(config)
    return sum(counts[: _virtual_stage_index(config, vp_stage, pp_rank)])


# ---- the layer ------------------------------------------------------------------------------------------------


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


class BaseTransformerLayer(ABC):
    """Marks TransformerLayer-like modules (the layers a TransformerBlock may hold)."""

    def __init__(self):
        pass


class MlpInterface(Protocol):
    """What a layer needs of its MLP (dense MLP, MoE layer): ``(output, bias)`` for the bias-dropout-add."""

    def forward(
        self,
        hidden_states: Tensor,
        /,
        *,
        intermediate_tensors: tuple[Tensor, ...] | None = None,
        padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]: ...


class MlpBuilder(Protocol):
    """A layer's ``mlp`` entry when it is neither a ModuleSpec nor a class: called with the layer's config and
    process groups (e.g. ``functools.partial(MLP.as_mlp_submodule, submodules=...)``)."""

    def __call__(
        self, *, config: TransformerConfig, pg_collection: ProcessGroupCollection, is_mtp_layer: bool
    ) -> MlpInterface: ...


def _pp_rank(pg_collection: Optional[ProcessGroupCollection], config: TransformerConfig) -> int:
    pp_group = getattr(pg_collection, "pp", None)
    if pp_group is not None:
        return pp_group.rank()
    return parallel_state.get_pipeline_model_parallel_rank() if config.pipeline_model_parallel_size > 1 else 0


def _is_mlp_spec(spec) -> bool:
    """A dense-MLP entry (ModuleSpec or class of MLP): built from the tensor-parallel group alone."""
    if not isinstance(spec, (ModuleSpec, type)):
        return False
    module = get_module(spec)
    return isinstance(module, type) and issubclass(module, MLP)


class TransformerLayer(MegatronModule, BaseTransformerLayer):
    """``x + attn(norm(x))`` [then ``x + cross_attn(norm(x), context)``] then ``x + mlp(norm(x))`` (dropout on
    each sublayer output).

    ``layer_number`` is 1-based within this pipeline stage's chunk; the layer adds the stage's offset
    (:func:`get_transformer_layer_offset`) so ``self.layer_number`` is global, unless ``add_layer_offset=False`` or
    ``is_mtp_layer`` (multi-token-prediction layers are numbered on their own). The MLP entry of the spec is built
    with the tensor-parallel group when it is a dense :class:`MLP`, with ``pg_collection`` when it is another
    ModuleSpec or class (e.g. a mixture-of-experts layer), and called with ``config``, ``pg_collection`` and
    ``is_mtp_layer`` when it is any other builder (:class:`MlpBuilder`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
        is_mtp_layer: bool = False,
        add_layer_offset: bool = True,
        pp_layer_offset: Optional[int] = None,
        name: str | None = None,
    ):
        super().__init__(config)
        self.submodules_config = submodules
        self.pg_collection = pg_collection
        self.vp_stage = vp_stage
        self.is_mtp_layer = is_mtp_layer
        self.name = name
        if is_mtp_layer or not add_layer_offset:
            self.layer_number = layer_number
        else:
            offset = get_transformer_layer_offset(config, vp_stage, _pp_rank(pg_collection, config))
            self.layer_number = layer_number + offset
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout

        norm_kwargs = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        attention_kwargs = dict(config=config, layer_number=self.layer_number, pg_collection=pg_collection)
        if config.context_parallel_size > 1 and config.cp_comm_type is not None:
            # A list holds one communication type per layer (global layer numbers start at 1).
            cp_comm_type = config.cp_comm_type
            if isinstance(cp_comm_type, list):
                cp_comm_type = cp_comm_type[self.layer_number - 1]
            attention_kwargs["cp_comm_type"] = cp_comm_type
        if pp_layer_offset is not None:
            attention_kwargs["pp_layer_offset"] = pp_layer_offset
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kwargs)
        self.self_attention = build_module(submodules.self_attention, **attention_kwargs)
        self.self_attn_bda = build_module(submodules.self_attn_bda)
        self.pre_cross_attn_layernorm = build_module(submodules.pre_cross_attn_layernorm, **norm_kwargs)
        # CrossAttention's constructor takes no pp_layer_offset.
        attention_kwargs.pop("pp_layer_offset", None)
        self.cross_attention = build_module(submodules.cross_attention, **attention_kwargs)
        self.cross_attn_bda = build_module(submodules.cross_attn_bda)
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kwargs)
        self.mlp = self._build_mlp(submodules.mlp)
        if hasattr(self.mlp, "set_layer_number"):  # an MoE layer logs its router losses under the global number
            self.mlp.set_layer_number(self.layer_number)
        self.mlp_bda = build_module(submodules.mlp_bda)

        # An IdentityOp norm (e.g. fused into the next linear) has no output worth recomputing.
        self.recompute_input_layernorm = self._recompute("layernorm") and not isinstance(
            self.input_layernorm, IdentityOp
        )
        self.recompute_pre_mlp_layernorm = self._recompute("layernorm") and not isinstance(
            self.pre_mlp_layernorm, IdentityOp
        )
        if self.recompute_input_layernorm and hasattr(self.self_attention, "set_for_recompute_input_layernorm"):
            self.self_attention.set_for_recompute_input_layernorm()

    def _build_mlp(self, spec):
        if _is_mlp_spec(spec):
            return build_module(spec, config=self.config, tp_group=tp_group_or_default(self.pg_collection))
        if isinstance(spec, (ModuleSpec, type)):
            return build_module(spec, config=self.config, pg_collection=self.pg_collection)
        return spec(config=self.config, pg_collection=self.pg_collection, is_mtp_layer=self.is_mtp_layer)

    def _recompute(self, module_name: str) -> bool:
        config = self.config
        return config.recompute_granularity == "selective" and module_name in config.recompute_modules

    def _norm(self, norm, hidden_states: Tensor, recompute: bool) -> Tensor:
        if recompute and self.training:
            # The norm's output is not kept: it is recomputed from hidden_states in backward.
            return tensor_parallel.checkpoint(norm, False, hidden_states)
        return norm(hidden_states)

    def _residual(self, hidden_states: Tensor, normed: Tensor) -> Tensor:
        # Megatron's option to take the residual after the norm (as original BERT did) rather than before it.
        residual = normed if self.config.apply_residual_connection_post_layernorm else hidden_states
        # Keeps the residual stream in fp32 so rounding does not build up across layers.
        return residual.float() if self.config.fp32_residual_connection else residual

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor] = None,
        context: Optional[Tensor] = None,
        context_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        inference_context: Optional[BaseInferenceContext] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        sequence_len_offset: Optional[Tensor] = None,
        padding_mask: Optional[Tensor] = None,
        *,
        inference_params: Optional[Any] = None,
    ):
        """Returns ``(hidden_states, context)`` as Megatron's layer does. ``padding_mask`` is handed to the MLP
        (a mixture-of-experts layer routes no padding tokens); a dense MLP ignores it."""
        inference_context = inference_context if inference_context is not None else inference_params
        fused = self.config.bias_dropout_fusion
        normed = self._norm(self.input_layernorm, hidden_states, self.recompute_input_layernorm)
        residual = self._residual(hidden_states, normed)
        attention_output_with_bias = self.self_attention(
            normed,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        # The bda factory takes self.training so that dropout applies only in training.
        hidden_states = self.self_attn_bda(self.training, fused)(
            attention_output_with_bias, residual, self.hidden_dropout
        )

        if not isinstance(self.cross_attention, IdentityOp):
            normed = self.pre_cross_attn_layernorm(hidden_states)
            residual = self._residual(hidden_states, normed)
            attention_output_with_bias = self.cross_attention(
                normed, attention_mask=context_mask, key_value_states=context, inference_context=inference_context
            )
            hidden_states = self.cross_attn_bda(self.training, fused)(
                attention_output_with_bias, residual, self.hidden_dropout
            )

        normed = self._norm(self.pre_mlp_layernorm, hidden_states, self.recompute_pre_mlp_layernorm)
        residual = self._residual(hidden_states, normed)
        mlp_kwargs = {} if padding_mask is None else {"padding_mask": padding_mask}
        mlp_output_with_bias = self.mlp(normed, **mlp_kwargs)
        hidden_states = self.mlp_bda(self.training, fused)(mlp_output_with_bias, residual, self.hidden_dropout)
        return hidden_states, context

    def get_qkv_layer_norm_weights(self) -> Tensor:
        """The weight of the norm in front of the QKV projection (fused into it or separate)."""
        return self._norm_weight(self.input_layernorm, getattr(self.self_attention, "linear_qkv", None))

    def get_mlp_layer_norm_weights(self) -> Tensor:
        """The weight of the norm in front of the MLP's fc1 (fused into it or separate)."""
        return self._norm_weight(self.pre_mlp_layernorm, getattr(self.mlp, "linear_fc1", None))

    def get_layer_norm_weights(self):
        """``(qkv norm weight, mlp norm weight)``; None for a norm the layer does not have."""
        return self.get_qkv_layer_norm_weights(), self.get_mlp_layer_norm_weights()

    @staticmethod
    def _norm_weight(norm, fused_linear) -> Optional[Tensor]:
        # Transformer Engine's fused norm+linear layers keep the norm weight as `layer_norm_weight`.
        fused_weight = getattr(fused_linear, "layer_norm_weight", None)
        if fused_weight is not None:
            return fused_weight.data
        weight = getattr(norm, "weight", None)
        return None if weight is None else weight.data

    def get_inner_quantization_context(self) -> contextlib.AbstractContextManager:
        """The context the layer's inner modules run in: FP8 / FP4 autocast in Megatron when a quantisation
        recipe is configured. No recipe is built here (the config refuses them), so it is a null context."""
        return contextlib.nullcontext()

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
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

"""Layer specs for GPT/Llama-style models: the local spec (pure PyTorch modules) and the Transformer Engine spec.

The Transformer Engine spec builds this project's PyTorch modules in Transformer Engine's checkpoint layout
(:mod:`megatron.core.transformer.te_layout`: the norm in front of QKV / fc1 fused into the linear, ``_extra_state``
entries), so checkpoints of Megatron's default ``--transformer-impl transformer_engine`` load as they are; it says
so once per process. Mixture-of-experts layers (``num_experts``) take their MLP from
:mod:`megatron.core.models.gpt.moe_module_specs`; ``get_gpt_decoder_block_spec`` mixes dense and MoE layers by
``config.moe_layer_freq``.

Megatron's spec functions for features not built here (inference-optimised layers, multi-latent attention,
multi-token prediction, Kitchen / FP8 quantisation) keep Megatron's
names and parameters and refuse those features with a "not supported yet" ``ValueError``. Parameters that only
pick a Transformer Engine kernel for the same computation (``use_te_op_fuser``, ``use_te_activation_func``,
``use_grouped_gemm_for_dense_mlp``) have no effect with the local modules, as the config treats the fields of the
same names.
"""

import warnings
from typing import List, Optional, Union

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider, TELayoutSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.te_layout import TELayoutNorm, announce_te_layout
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import MlpBuilder, TransformerLayer, TransformerLayerSubmodules

_LOCAL = LocalSpecProvider()
_TE_LAYOUT = TELayoutSpecProvider()
LNImpl = _LOCAL.layer_norm()


def _not_supported(feature: str, **settings) -> ValueError:
    shown = ", ".join(f"{name}={value!r}" for name, value in settings.items())
    return ValueError(f"not supported yet: {feature} ({shown}); build the layer with the local dense specs")


def _refuse_unbuilt(multi_latent_attention=False, use_kitchen=False, use_kitchen_attention=False) -> None:
    if multi_latent_attention:
        raise _not_supported("multi-latent attention", multi_latent_attention=multi_latent_attention)
    if use_kitchen or use_kitchen_attention:
        raise _not_supported(
            "Kitchen quantised layers", use_kitchen=use_kitchen, use_kitchen_attention=use_kitchen_attention
        )


def _warn_deprecated_fp8(fp8: Optional[str], function: str) -> None:
    # Megatron's specs accept and ignore `fp8` (FP8 is the config's business).
    if fp8 is not None:
        warnings.warn(f"The fp8 argument of {function} is deprecated and ignored; set FP8 in the config")


def _norm_spec(normalization: Optional[str]):
    if normalization is None:
        return LNImpl
    return ModuleSpec(module=LNImpl, params={"normalization": normalization})


def get_mlp_module_spec_for_backend(
    backend: BackendSpecProvider,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_te_activation_func: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> MlpBuilder:
    """The MLP spec with ``backend``'s linears (and activation module, if it has one): the MoE layer spec when
    ``num_experts`` is set (grouped-GEMM experts with ``moe_grouped_gemm``), else the dense MLP, whose fc1 includes
    the pre-MLP norm when the backend fuses norms into linears. The other kernel-choice parameters make no
    difference to this project's modules."""
    if num_experts is not None:
        return get_moe_module_spec_for_backend(backend, num_experts, moe_grouped_gemm, use_te_activation_func)
    fused = backend.fuse_layernorm_and_linear()
    return ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear(),
            linear_fc2=backend.row_parallel_linear(),
            activation_func=backend.activation_func(),
        ),
    )


def get_mlp_module_spec(
    use_te: Optional[bool] = True,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    fp8: Optional[str] = None,
    use_te_op_fuser: Optional[bool] = False,
) -> MlpBuilder:
    """The dense (or, with ``num_experts``, MoE) MLP spec: in Transformer Engine's checkpoint layout with
    ``use_te`` (Megatron's default; the dense fc1 then holds the pre-MLP norm), else from the local modules."""
    if use_te:
        _warn_deprecated_fp8(fp8, "get_mlp_module_spec")
        announce_te_layout()
        return get_mlp_module_spec_for_backend(_TE_LAYOUT, num_experts, moe_grouped_gemm, use_te_op_fuser)
    _warn_deprecated_fp8(fp8, "get_mlp_module_spec")
    return get_mlp_module_spec_for_backend(_LOCAL, num_experts, moe_grouped_gemm, use_te_op_fuser)


def get_gpt_layer_local_submodules(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> TransformerLayerSubmodules:
    """The submodules of a GPT layer from local modules: pre-norm causal self-attention and MLP with
    bias-dropout-add; the MLP is an MoE layer with ``num_experts`` experts when that is set.

    ``normalization`` ('LayerNorm' / 'RMSNorm') overrides the config's choice for every norm in the layer;
    ``qk_layernorm`` normalises each query / key head with that norm, ``qk_l2_norm`` with a parameter-free L2
    norm (it takes precedence). ``kitchen_attention_backend`` only matters with ``use_kitchen_attention``.
    """
    _refuse_unbuilt(
        multi_latent_attention=multi_latent_attention,
        use_kitchen=use_kitchen,
        use_kitchen_attention=use_kitchen_attention,
    )
    _warn_deprecated_fp8(fp8, "get_gpt_layer_local_spec")
    norm = _norm_spec(normalization)
    if qk_l2_norm:
        qk_norm = _LOCAL.l2_norm()
    else:
        qk_norm = norm if qk_layernorm else None
    return TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=_LOCAL.column_parallel_linear(),
                core_attention=_LOCAL.core_attention(),
                linear_proj=_LOCAL.row_parallel_linear(),
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
            metainfo={"fuse_input_layernorm": _LOCAL.fuse_layernorm_and_linear()},
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm,
        mlp=get_mlp_module_spec_for_backend(_LOCAL, num_experts, moe_grouped_gemm),
        mlp_bda=get_bias_dropout_add,
        # Checkpoint keys of the separate norms are those of Transformer Engine's fused norm+linear layers.
        sharded_state_dict_keys_map={
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
        },
    )


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
) -> ModuleSpec:
    """A :class:`TransformerLayer` spec with :func:`get_gpt_layer_local_submodules` (same parameters)."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=get_gpt_layer_local_submodules(
            num_experts,
            moe_grouped_gemm,
            qk_layernorm,
            multi_latent_attention,
            fp8,
            normalization,
            qk_l2_norm,
            use_kitchen,
            use_kitchen_attention,
            kitchen_attention_backend,
        ),
    )


def get_gpt_layer_with_transformer_engine_submodules(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    mla_down_proj_fusion: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> TransformerLayerSubmodules:
    """The submodules of a GPT layer in Transformer Engine's checkpoint layout, from this project's modules (see
    :mod:`megatron.core.transformer.te_layout`; said once per process): the input norm inside ``linear_qkv``, the
    pre-MLP norm inside a dense MLP's ``linear_fc1`` or, with ``num_experts``, a separate norm in front of the MoE
    layer (grouped-GEMM experts with ``moe_grouped_gemm``).

    ``qk_layernorm`` normalises each query / key head with ``config.normalization``, ``qk_l2_norm`` with a
    parameter-free L2 norm (it takes precedence). ``fp8`` is deprecated and ignored, as in Megatron; the
    Transformer Engine kernel choices (``use_te_op_fuser``, ``use_te_activation_func``,
    ``use_grouped_gemm_for_dense_mlp``) compute the same and change nothing here; multi-latent attention and
    Kitchen layers are not supported yet.
    """
    _refuse_unbuilt(
        multi_latent_attention=multi_latent_attention,
        use_kitchen=use_kitchen,
        use_kitchen_attention=use_kitchen_attention,
    )
    _warn_deprecated_fp8(fp8, "get_gpt_layer_with_transformer_engine_spec")
    announce_te_layout()
    if qk_l2_norm:
        qk_norm = _TE_LAYOUT.l2_norm()
    else:
        qk_norm = _TE_LAYOUT.layer_norm(for_qk=True) if qk_layernorm else None
    return TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=_TE_LAYOUT.column_parallel_layer_norm_linear(),
                core_attention=_TE_LAYOUT.core_attention(),
                linear_proj=_TE_LAYOUT.row_parallel_linear(),
                q_layernorm=qk_norm,
                k_layernorm=qk_norm,
            ),
            metainfo={"fuse_input_layernorm": _TE_LAYOUT.fuse_layernorm_and_linear()},
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=_TE_LAYOUT.layer_norm() if num_experts else IdentityOp,
        mlp=get_mlp_module_spec_for_backend(_TE_LAYOUT, num_experts, moe_grouped_gemm),
        mlp_bda=get_bias_dropout_add,
    )


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    fp8: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    use_te_op_fuser: Optional[bool] = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    mla_down_proj_fusion: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> ModuleSpec:
    """A :class:`TransformerLayer` spec with :func:`get_gpt_layer_with_transformer_engine_submodules` (same
    parameters). A block built from it alone gets the final norm in the same layout."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=get_gpt_layer_with_transformer_engine_submodules(
            num_experts,
            moe_grouped_gemm,
            qk_layernorm,
            multi_latent_attention,
            fp8,
            qk_l2_norm,
            use_te_op_fuser,
            use_kitchen,
            use_te_activation_func,
            use_kitchen_attention,
            kitchen_attention_backend,
            mla_down_proj_fusion,
            use_grouped_gemm_for_dense_mlp,
        ),
        metainfo={"final_layernorm": TELayoutNorm},
    )


def get_gpt_layer_with_inference_submodules(
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    qk_l2_norm: Optional[bool] = False,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> TransformerLayerSubmodules:
    """Inference-optimised (Transformer Engine) layers are not supported yet: always a ``ValueError``."""
    raise _not_supported("inference-optimized layer specs", transformer_impl="inference_optimized")


def get_gpt_layer_with_inference_spec(
    qk_layernorm: Optional[bool] = False,
    multi_latent_attention: Optional[bool] = False,
    qk_l2_norm: Optional[bool] = False,
    num_experts: Optional[int] = None,
    moe_grouped_gemm: Optional[bool] = False,
    moe_use_legacy_grouped_gemm: Optional[bool] = False,
) -> ModuleSpec:
    """Inference-optimised (Transformer Engine) layers are not supported yet: always a ``ValueError``."""
    raise _not_supported("inference-optimized layer specs", transformer_impl="inference_optimized")


def get_gpt_decoder_layer_specs(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> List[ModuleSpec]:
    """A layer spec for every one of the model's ``config.num_layers`` layers: MoE layers where
    ``config.moe_layer_freq`` says (an int N: layers 0, N, 2N, ...; a list: 1 = MoE, 0 = dense, per layer), dense
    ones elsewhere, all dense without ``config.num_moe_experts``. ``vp_stage`` / ``pp_rank`` do not change the
    full list."""
    if use_transformer_engine:
        # Transformer Engine's norms read config.normalization, so Megatron passes `normalization` to local specs only.
        layer_spec = get_gpt_layer_with_transformer_engine_spec
        common = dict(qk_layernorm=config.qk_layernorm, qk_l2_norm=qk_l2_norm)
    else:
        layer_spec = get_gpt_layer_local_spec
        common = dict(qk_layernorm=config.qk_layernorm, normalization=normalization, qk_l2_norm=qk_l2_norm)
    dense_spec = layer_spec(**common)
    if config.num_moe_experts is None:
        return [dense_spec] * config.num_layers
    moe_spec = layer_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm, **common)
    return [moe_spec if is_moe else dense_spec for is_moe in moe_layer_pattern(config)]


def moe_layer_pattern(config: TransformerConfig) -> List[int]:
    """1 for each MoE layer, 0 for each dense one, from ``config.moe_layer_freq`` (validated by the config)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return [int(bool(x)) for x in freq]


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: Optional[str] = None,
    qk_l2_norm: Optional[bool] = False,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Block spec listing the layer specs of pipeline rank ``pp_rank``'s (this rank's when None) chunk
    ``vp_stage``, and the final norm (in Transformer Engine's layout with ``use_transformer_engine``)."""
    layer_specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm)
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    final_norm = TELayoutNorm if use_transformer_engine else _norm_spec(normalization)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + num_layers], layer_norm=final_norm)


def get_gpt_mtp_block_spec_for_backend(
    config: TransformerConfig,
    spec: Union[TransformerBlockSubmodules, ModuleSpec],
    backend: BackendSpecProvider,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> None:
    """The multi-token-prediction block spec: None when the model has no MTP layers (``config.mtp_num_layers``
    unset); MTP layers are not supported yet."""
    if config.mtp_num_layers is not None:
        raise _not_supported("multi-token prediction", mtp_num_layers=config.mtp_num_layers)
    return None


def get_gpt_mtp_block_spec(
    config: TransformerConfig,
    spec: Union[TransformerBlockSubmodules, ModuleSpec],
    use_transformer_engine: bool,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> None:
    """:func:`get_gpt_mtp_block_spec_for_backend` with the Transformer Engine layout or local backend (None
    without MTP layers)."""
    backend = _TE_LAYOUT if use_transformer_engine else _LOCAL
    return get_gpt_mtp_block_spec_for_backend(config, spec, backend, vp_stage, pp_rank)

"""Layer specs for GPT/Llama-style models built from Megatron-Core's local (pure PyTorch) modules."""

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

LNImpl = WrappedTorchNorm


def _norm_spec(normalization: Optional[str]):
    if normalization is None:
        return LNImpl
    return ModuleSpec(module=LNImpl, params={"normalization": normalization})


def get_mlp_module_spec(
    use_te: bool = False, num_experts: Optional[int] = None, moe_grouped_gemm: bool = False, **kwargs
) -> ModuleSpec:
    """The dense MLP spec (MoE specs arrive with the MoE feature)."""
    if use_te:
        raise ValueError("use_te=True needs Transformer Engine specs; use the local spec (use_te=False)")
    if num_experts is not None:
        raise ValueError(
            f"num_experts={num_experts}: mixture-of-experts layers are not available yet; use a dense MLP"
        )
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def get_gpt_layer_local_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    fp8: Optional[str] = None,
    moe_use_legacy_grouped_gemm: bool = False,
    normalization: Optional[str] = None,
    qk_l2_norm: bool = False,
) -> ModuleSpec:
    """A GPT layer from local modules: pre-norm causal self-attention and MLP with bias-dropout-add.

    ``normalization`` ('LayerNorm' / 'RMSNorm') overrides the config's choice for every norm in the layer.
    """
    if multi_latent_attention:
        raise ValueError("multi_latent_attention is not supported; use standard or grouped-query attention")
    if qk_l2_norm:
        raise ValueError("qk_l2_norm is not supported; use qk_layernorm")
    if fp8 is not None:
        raise ValueError(f"fp8={fp8!r} needs Transformer Engine; use fp8=None")
    norm = _norm_spec(normalization)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if qk_layernorm else None,
                    k_layernorm=norm if qk_layernorm else None,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add,
            # Checkpoint keys of the separate norms are those of Transformer Engine's fused norm+linear layers.
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool = False,
    normalization: Optional[str] = None,
    qk_l2_norm: bool = False,
    vp_stage: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """Block spec listing a layer spec for each layer of this stage (all dense until MoE layers exist)."""
    if use_transformer_engine:
        raise ValueError("use_transformer_engine=True needs Transformer Engine specs; use the local specs")
    layer_spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        qk_layernorm=config.qk_layernorm,
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
    )
    num_layers = get_num_layers_to_build(config, vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=_norm_spec(normalization))

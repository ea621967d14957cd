"""``hybrid_stack_spec``: the layer specs of a hybrid model, built from this project's local (pure PyTorch) modules.

Megatron-Core's spec of the same name uses Transformer Engine's fused norm + linear layers. Here every norm is a
separate torch norm in front of its sublayer, and each layer's spec maps that norm's checkpoint key to the fused
layer's name, so checkpoints match Megatron's:

- Mamba layer ``i``: ``decoder.layers.i.mixer.in_proj.layer_norm_weight`` (the pre-mixer norm);
- attention layer: ``decoder.layers.i.self_attention.linear_qkv.layer_norm_weight``;
- MLP layer: ``decoder.layers.i.mlp.linear_fc1.layer_norm_weight``;
- MoE layer: ``decoder.layers.i.pre_mlp_layernorm.weight`` (Megatron's hybrid MoE layer keeps a separate norm in
  front of the router, so the key is the module's own), experts as grouped linears (Megatron's hybrid spec uses
  grouped-GEMM experts) stored under ``mlp.experts.experts.linear_fc1.weight``, ``mlp.router.weight``,
  ``mlp.shared_experts.*``.
"""

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

_LOCAL = LocalSpecProvider()
_NORM = _LOCAL.layer_norm()

mamba_layer_spec = ModuleSpec(
    module=MambaLayer,
    submodules=MambaLayerSubmodules(
        norm=_NORM,
        mixer=ModuleSpec(
            module=MambaMixer,
            submodules=MambaMixerSubmodules(
                in_proj=_LOCAL.column_parallel_linear(), out_proj=_LOCAL.row_parallel_linear()
            ),
        ),
        mamba_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
    ),
)
"""A Mamba layer: pre-norm Mamba-2 mixer with a residual."""

attention_layer_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=_NORM,
        self_attention=ModuleSpec(
            module=SelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=_LOCAL.column_parallel_linear(),
                core_attention=_LOCAL.core_attention(),
                linear_proj=_LOCAL.row_parallel_linear(),
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
    ),
)
"""An attention-only layer: pre-norm causal self-attention with a residual."""

mlp_layer_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_NORM,
        mlp=get_mlp_module_spec_for_backend(_LOCAL),
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
    ),
)
"""An MLP-only layer: pre-norm MLP with a residual."""

moe_layer_spec = ModuleSpec(
    module=TransformerLayer,
    submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=_NORM,
        # The number of experts comes from the config when the layer is built; the spec only needs one to exist.
        mlp=get_moe_module_spec_for_backend(_LOCAL, num_experts=1, moe_grouped_gemm=True),
        mlp_bda=get_bias_dropout_add,
    ),
)
"""An MoE-only layer: pre-norm MoE MLP (router, grouped experts, optional shared expert) with a residual."""

hybrid_stack_spec = ModuleSpec(
    module=HybridStack,
    submodules=HybridStackSubmodules(
        mamba_layer=mamba_layer_spec,
        attention_layer=attention_layer_spec,
        mlp_layer=mlp_layer_spec,
        moe_layer=moe_layer_spec,
    ),
)
"""The spec ``HybridModel`` is built from: ``HybridModel(config, hybrid_stack_spec, ...)``."""

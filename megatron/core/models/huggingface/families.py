"""One table per Hugging Face model family: how its ``config.json`` reads as Megatron settings and how its tensor
names map onto GPTModel's.

A :class:`FamilyAdapter` is data: the architectures it covers, a function from the HF config to
:class:`ModelSettings` (Megatron's view of the model, refusing what it cannot express), the reverse function, and
the weight rules. A :class:`WeightRule` names one GPTModel state-dict entry (``{layer}`` = global layer index), the HF
tensors it is made of, and one of the few transforms in ``weights.py``. Adding a family is
adding a table here, plus the transforms its new layer types need.
"""

from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Tuple


class UnsupportedHFModelError(ValueError):
    """An HF checkpoint or config this converter refuses (the message names what, the value and the way out)."""


@dataclass(frozen=True)
class ModelSettings:
    """Everything that defines the model, in Megatron-LM's argument names (``--num-layers`` -> ``num_layers``)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int  # the HF vocabulary, before Megatron's padding
    max_position_embeddings: int
    position_embedding_type: str  # 'learned_absolute' | 'rope'
    normalization: str  # 'LayerNorm' | 'RMSNorm'
    layernorm_epsilon: float
    swiglu: bool
    openai_gelu: bool
    add_bias_linear: bool
    add_qkv_bias: bool
    untie_embeddings_and_output_weights: bool
    rotary_base: float = 10000.0
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    params_dtype: str = "float32"
    # A Mamba hybrid (HybridModel, --model-type hybrid) when set: its layer pattern, 'M' / '*' / '-' per layer.
    hybrid_layer_pattern: Optional[str] = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: Optional[int] = None
    squared_relu: bool = False
    # Mixture of experts (Mixtral): None = a dense MLP.
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_aux_loss_coeff: float = 0.0


@dataclass(frozen=True)
class WeightRule:
    """``megatron`` (a GPTModel / HybridModel state-dict name) is ``transform`` applied to the HF tensors ``hf``.

    ``kind``: for a hybrid, the layer symbol ('M', '*', '-') the rule belongs to (None: every layer).
    ``tp_sections``: the tensor's axis 0 concatenates segments of these sizes, each split over TP on its own (the
    Mamba in_proj's z|x|B|C|dt, the conv's x|B|C), so a rank's piece is piece r of every segment."""

    megatron: str
    hf: Tuple[str, ...]
    transform: str = "copy"  # see weights.TRANSFORMS
    kind: Optional[str] = None
    tp_sections: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class FamilyAdapter:
    name: str
    architectures: Tuple[str, ...]
    settings_from_hf: Callable[[dict], ModelSettings]
    hf_config_from_settings: Callable[[ModelSettings], dict]
    global_rules: Callable[[ModelSettings], List[WeightRule]]
    layer_rules: Callable[[ModelSettings], List[WeightRule]]
    # HF tensors that are not weights (buffers some writers store) and are recomputed on the Megatron side.
    ignorable_hf_suffixes: Tuple[str, ...] = field(default=())
    # Prefixes some writers of this family leave off (GPT-2 files from the Hub have no "transformer.").
    optional_hf_prefix: str = ""
    model_type: str = "GPT"  # convert.py's --model-type for the family


# ---- reading config values ----------------------------------------------------------------------------------------


def _refuse(architecture: str, what: str, value, fix: str):
    raise UnsupportedHFModelError(f"{architecture}: {what} = {value!r} is not supported; {fix}")


def _require(config: dict, key: str, architecture: str):
    if config.get(key) is None:
        raise UnsupportedHFModelError(f"{architecture}: config.json has no {key!r}, which the conversion needs")
    return config[key]


def _rope(config: dict, architecture: str) -> Tuple[float, bool, float]:
    """(theta, Llama-3 scaling on, factor) from transformers 5's ``rope_parameters`` or the older top-level
    ``rope_theta`` + ``rope_scaling``. Megatron's Llama-3 scaling fixes low 1 / high 4 / original 8192."""
    parameters = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    parameters.update({key: value for key, value in scaling.items() if key not in parameters})
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), False, 8.0
    if rope_type != "llama3":
        _refuse(
            architecture,
            "rope_type",
            rope_type,
            "Megatron's GPTModel has the default and the Llama-3 ('llama3') RoPE only",
        )
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for key, expected in fixed.items():
        if float(parameters.get(key, expected)) != expected:
            _refuse(
                architecture,
                f"rope_parameters[{key!r}]",
                parameters.get(key),
                f"Megatron's Llama-3 RoPE scaling (--use-rope-scaling) fixes it at {expected:g}",
            )
    return float(theta), True, float(_require(parameters, "factor", architecture))


def _dtype(config: dict) -> str:
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


# ---- GPT-2 ---------------------------------------------------------------------------------------------------------

_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def _gpt2_settings(config: dict) -> ModelSettings:
    architecture = "GPT2LMHeadModel"
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GELU:
        _refuse(architecture, "activation_function", activation, f"use one of {sorted(_GELU)}")
    for key, ok in (
        ("scale_attn_by_inverse_layer_idx", False),
        ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True),
        ("add_cross_attention", False),
    ):
        if bool(config.get(key, ok)) != ok:
            _refuse(architecture, key, config.get(key), f"Megatron's attention has no equivalent; it must be {ok}")
    hidden = _require(config, "n_embd", architecture)
    heads = _require(config, "n_head", architecture)
    return ModelSettings(
        num_layers=_require(config, "n_layer", architecture),
        hidden_size=hidden,
        ffn_hidden_size=config.get("n_inner") or 4 * hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hidden // heads,
        vocab_size=_require(config, "vocab_size", architecture),
        max_position_embeddings=_require(config, "n_positions", architecture),
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        layernorm_epsilon=float(config.get("layer_norm_epsilon", 1e-5)),
        swiglu=False,
        openai_gelu=_GELU[activation],
        add_bias_linear=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", True),
        hidden_dropout=float(config.get("resid_pdrop", 0.1)),
        attention_dropout=float(config.get("attn_pdrop", 0.1)),
        params_dtype=_dtype(config),
    )


def _gpt2_config(s: ModelSettings) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": s.num_layers,
        "n_embd": s.hidden_size,
        "n_head": s.num_attention_heads,
        "n_inner": s.ffn_hidden_size,
        "n_positions": s.max_position_embeddings,
        "vocab_size": s.vocab_size,
        "layer_norm_epsilon": s.layernorm_epsilon,
        "activation_function": "gelu_new" if s.openai_gelu else "gelu",
        "resid_pdrop": s.hidden_dropout,
        "embd_pdrop": s.hidden_dropout,
        "attn_pdrop": s.attention_dropout,
        "scale_attn_weights": True,
        "tie_word_embeddings": not s.untie_embeddings_and_output_weights,
        "dtype": s.params_dtype,
    }


def _gpt2_global_rules(s: ModelSettings) -> List[WeightRule]:
    rules = [
        WeightRule("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab"),
        WeightRule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
        WeightRule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
        WeightRule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
    ]
    output_source = "lm_head.weight" if s.untie_embeddings_and_output_weights else "transformer.wte.weight"
    return rules + [WeightRule("output_layer.weight", (output_source,), "vocab")]


def _gpt2_layer_rules(s: ModelSettings) -> List[WeightRule]:
    hf = "transformer.h.{layer}."
    mg = "decoder.layers.{layer}."
    return [
        WeightRule(mg + "input_layernorm.weight", (hf + "ln_1.weight",)),
        WeightRule(mg + "input_layernorm.bias", (hf + "ln_1.bias",)),
        WeightRule(mg + "self_attention.linear_qkv.weight", (hf + "attn.c_attn.weight",), "fused_qkv_conv1d"),
        WeightRule(mg + "self_attention.linear_qkv.bias", (hf + "attn.c_attn.bias",), "fused_qkv"),
        WeightRule(mg + "self_attention.linear_proj.weight", (hf + "attn.c_proj.weight",), "transpose"),
        WeightRule(mg + "self_attention.linear_proj.bias", (hf + "attn.c_proj.bias",)),
        WeightRule(mg + "pre_mlp_layernorm.weight", (hf + "ln_2.weight",)),
        WeightRule(mg + "pre_mlp_layernorm.bias", (hf + "ln_2.bias",)),
        WeightRule(mg + "mlp.linear_fc1.weight", (hf + "mlp.c_fc.weight",), "transpose"),
        WeightRule(mg + "mlp.linear_fc1.bias", (hf + "mlp.c_fc.bias",)),
        WeightRule(mg + "mlp.linear_fc2.weight", (hf + "mlp.c_proj.weight",), "transpose"),
        WeightRule(mg + "mlp.linear_fc2.bias", (hf + "mlp.c_proj.bias",)),
    ]


# ---- Llama, Mistral, Qwen2: RMSNorm, SwiGLU, RoPE, grouped-query attention --------------------------------------


def _llama_like_settings(config: dict, architecture: str, qkv_bias: bool) -> ModelSettings:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        _refuse(architecture, "hidden_act", activation, "the SwiGLU MLP of this family uses 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            _refuse(
                architecture,
                key,
                config[key],
                "Megatron's add_bias_linear puts a bias on every linear "
                "layer, which this family does not have; convert a checkpoint without these biases",
            )
    if config.get("use_sliding_window") or (
        config.get("sliding_window") is not None and config.get("use_sliding_window", True)
    ):
        _refuse(
            architecture,
            "sliding_window",
            config.get("sliding_window"),
            "sliding-window attention has no local-spec equivalent; set it to null for a model whose context "
            "fits the window",
        )
    if float(config.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(architecture, "partial_rotary_factor", config["partial_rotary_factor"], "only full rotary is mapped")
    hidden = _require(config, "hidden_size", architecture)
    heads = _require(config, "num_attention_heads", architecture)
    theta, scaling, factor = _rope(config, architecture)
    return ModelSettings(
        num_layers=_require(config, "num_hidden_layers", architecture),
        hidden_size=hidden,
        ffn_hidden_size=_require(config, "intermediate_size", architecture),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or hidden // heads,
        vocab_size=_require(config, "vocab_size", architecture),
        max_position_embeddings=_require(config, "max_position_embeddings", architecture),
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        openai_gelu=False,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        rotary_base=theta,
        use_rope_scaling=scaling,
        rope_scaling_factor=factor,
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        params_dtype=_dtype(config),
    )


def _llama_like_config(s: ModelSettings, architecture: str, model_type: str) -> dict:
    rope = {"rope_type": "default", "rope_theta": s.rotary_base}
    if s.use_rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": s.rotary_base,
            "factor": s.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "num_hidden_layers": s.num_layers,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.ffn_hidden_size,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_query_groups,
        "head_dim": s.kv_channels,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.layernorm_epsilon,
        "hidden_act": "silu",
        "rope_parameters": rope,
        "tie_word_embeddings": not s.untie_embeddings_and_output_weights,
        "attention_dropout": s.attention_dropout,
        "dtype": s.params_dtype,
    }
    if model_type in ("llama",):
        config.update(attention_bias=False, mlp_bias=False)
    if model_type in ("mistral", "qwen2"):
        config["sliding_window"] = None
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    return config


def _llama_like_global_rules(s: ModelSettings) -> List[WeightRule]:
    output_source = "lm_head.weight" if s.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
    return [
        WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        WeightRule("output_layer.weight", (output_source,), "vocab"),
    ]


def _llama_like_layer_rules(s: ModelSettings) -> List[WeightRule]:
    hf = "model.layers.{layer}."
    mg = "decoder.layers.{layer}."
    qkv = tuple(hf + f"self_attn.{name}_proj" for name in "qkv")
    rules = [
        WeightRule(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
        WeightRule(mg + "self_attention.linear_qkv.weight", tuple(name + ".weight" for name in qkv), "qkv"),
        WeightRule(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",)),
        WeightRule(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
        WeightRule(mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "cat"),
        WeightRule(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",)),
    ]
    if s.add_qkv_bias:
        rules.insert(2, WeightRule(mg + "self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv), "qkv"))
    return rules


def _llama_like(name: str, architecture: str, model_type: str, qkv_bias: bool) -> FamilyAdapter:
    return FamilyAdapter(
        name=name,
        architectures=(architecture,),
        settings_from_hf=lambda config: _llama_like_settings(config, architecture, qkv_bias),
        hf_config_from_settings=lambda settings: _llama_like_config(settings, architecture, model_type),
        global_rules=_llama_like_global_rules,
        layer_rules=_llama_like_layer_rules,
        ignorable_hf_suffixes=("rotary_emb.inv_freq",),
    )


# ---- NemotronH: Mamba-2 / attention / squared-ReLU MLP hybrid (HybridModel) --------------------------------------

_NEMOTRON_H = "NemotronHForCausalLM"
_BLOCK_SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_BLOCK_NAMES = {symbol: name for name, symbol in _BLOCK_SYMBOLS.items()}


def _nemotron_h_pattern(config: dict) -> str:
    """The hybrid layer pattern from ``layers_block_type`` (transformers 5) or ``hybrid_override_pattern`` (older
    config files); MoE ('E') layers are refused: their Megatron side is not built on this branch."""
    blocks = config.get("layers_block_type")
    if blocks is not None:
        unknown = [b for b in blocks if b not in _BLOCK_SYMBOLS]
        if unknown:
            _refuse(_NEMOTRON_H, "layers_block_type entry", unknown[0], f"use {sorted(_BLOCK_SYMBOLS)}")
        pattern = "".join(_BLOCK_SYMBOLS[b] for b in blocks)
    else:
        pattern = config.get("hybrid_override_pattern")
        if pattern is None:
            raise UnsupportedHFModelError(
                f"{_NEMOTRON_H}: config.json has neither 'layers_block_type' nor "
                "'hybrid_override_pattern'; the conversion needs the layer pattern"
            )
        bad = [c for c in pattern if c not in "M*-E"]
        if bad:
            _refuse(_NEMOTRON_H, "hybrid_override_pattern symbol", bad[0], "use M, *, - (and E for MoE)")
    if "E" in pattern:
        _refuse(
            _NEMOTRON_H,
            "MoE layers ('moe' / 'E' in the layer pattern)",
            pattern,
            "the hybrid's MoE layers are not mapped yet (MoE support is built separately); convert a "
            "checkpoint whose layers are Mamba, attention and MLP only",
        )
    return pattern


# Older NemotronH config files' names, which transformers still reads (new name: old name).
_NEMOTRON_H_LEGACY = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "use_conv_bias": "mamba_conv_bias",
    "chunk_size": "mamba_chunk_size",
}


def _nemotron_h_settings(config: dict) -> ModelSettings:
    a = _NEMOTRON_H
    config = {**{new: config[old] for new, old in _NEMOTRON_H_LEGACY.items() if old in config}, **config}
    pattern = _nemotron_h_pattern(config)
    if config.get("head_dim") is None and config.get("attention_head_dim", 128) != 128:
        _refuse(
            a,
            "attention_head_dim (without head_dim)",
            config["attention_head_dim"],
            "transformers reads head_dim (default 128) and ignores attention_head_dim; add head_dim to config.json",
        )
    expected = {
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "use_bias": False,
        "mlp_bias": False,
        "use_conv_bias": True,
        "conv_kernel": 4,
        "num_nextn_predict_layers": 0,
        "sliding_window": None,
    }
    fixes = {
        "mlp_hidden_act": "the MLP layers map to Megatron's squared ReLU (--squared-relu) only",
        "mamba_hidden_act": "Megatron's Mamba mixer uses SiLU",
        "use_bias": "Megatron's Mamba in/out projections have no bias in the hybrid spec",
        "mlp_bias": "the hybrid's MLP layers have no bias",
        "use_conv_bias": "Megatron's Mamba conv always has a bias",
        "conv_kernel": "Megatron's hybrid spec builds the Mamba conv with width 4 (d_conv)",
        "num_nextn_predict_layers": "multi-token prediction layers are not built for hybrids",
        "sliding_window": "attention layers are global",
    }
    for key, value in expected.items():
        if config.get(key, value) != value:
            _refuse(a, key, config[key], fixes[key])
    epsilon = float(config.get("layer_norm_epsilon", 1e-5))
    if "M" in pattern and epsilon != 1e-5:
        _refuse(
            a,
            "layer_norm_epsilon",
            epsilon,
            "Megatron's Mamba mixer fixes its gated RMSNorm's epsilon at 1e-5, so the model's norms must use it too",
        )
    hidden = _require(config, "hidden_size", a)
    heads = _require(config, "num_attention_heads", a)
    return ModelSettings(
        num_layers=len(pattern),
        hidden_size=hidden,
        ffn_hidden_size=_require(config, "intermediate_size", a),
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        kv_channels=config.get("head_dim") or 128,  # transformers' default, not hidden / heads
        vocab_size=_require(config, "vocab_size", a),
        max_position_embeddings=_require(config, "max_position_embeddings", a),
        position_embedding_type="none",
        normalization="RMSNorm",
        layernorm_epsilon=epsilon,
        swiglu=False,
        openai_gelu=False,
        add_bias_linear=False,
        add_qkv_bias=False,
        # transformers' NemotronH never ties lm_head to the embeddings (whatever tie_word_embeddings says, its files
        # hold lm_head.weight and the model uses it), so neither does the Megatron model.
        untie_embeddings_and_output_weights=True,
        hidden_dropout=float(config.get("hidden_dropout", 0.0)),
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        params_dtype=_dtype(config),
        hybrid_layer_pattern=pattern,
        mamba_state_dim=_require(config, "ssm_state_size", a),
        mamba_head_dim=_require(config, "mamba_head_dim", a),
        mamba_num_groups=_require(config, "n_groups", a),
        mamba_num_heads=_require(config, "mamba_num_heads", a),
        squared_relu=True,
    )


def _nemotron_h_config(s: ModelSettings) -> dict:
    if not s.untie_embeddings_and_output_weights:
        _refuse(
            _NEMOTRON_H,
            "a Megatron hybrid with tied embeddings (no --untie-embeddings-and-output-weights)",
            True,
            "transformers' NemotronH always has its own lm_head; train the hybrid with "
            "--untie-embeddings-and-output-weights",
        )
    return {
        "architectures": [_NEMOTRON_H],
        "model_type": "nemotron_h",
        "layers_block_type": [_BLOCK_NAMES[c] for c in s.hybrid_layer_pattern.replace("|", "")],
        "hidden_size": s.hidden_size,
        "intermediate_size": s.ffn_hidden_size,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_query_groups,
        "head_dim": s.kv_channels,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.max_position_embeddings,
        "layer_norm_epsilon": s.layernorm_epsilon,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "ssm_state_size": s.mamba_state_dim,
        "mamba_head_dim": s.mamba_head_dim,
        "n_groups": s.mamba_num_groups,
        "mamba_num_heads": s.mamba_num_heads,
        "conv_kernel": 4,
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "hidden_dropout": s.hidden_dropout,
        "attention_dropout": s.attention_dropout,
        "dtype": s.params_dtype,
    }


def _nemotron_h_global_rules(s: ModelSettings) -> List[WeightRule]:
    return [
        WeightRule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), "vocab"),
        WeightRule("decoder.final_norm.weight", ("backbone.norm_f.weight",)),
        WeightRule("output_layer.weight", ("lm_head.weight",), "vocab"),
    ]


def _nemotron_h_layer_rules(s: ModelSettings) -> List[WeightRule]:
    hf = "backbone.layers.{layer}."
    mg = "decoder.layers.{layer}."
    heads = s.mamba_num_heads
    d_inner, group_width = heads * s.mamba_head_dim, s.mamba_num_groups * s.mamba_state_dim
    in_proj = (d_inner, d_inner, group_width, group_width, heads)
    conv = (d_inner, group_width, group_width)
    mamba = [WeightRule(mg + "norm.weight", (hf + "norm.weight",), kind="M")] + [
        WeightRule(mg + f"mixer.{name}", (hf + f"mixer.{name}",), kind="M", tp_sections=sections)
        for name, sections in (
            ("in_proj.weight", in_proj),
            ("conv1d.weight", conv),
            ("conv1d.bias", conv),
            ("A_log", None),
            ("D", None),
            ("dt_bias", None),
            ("norm.weight", None),
            ("out_proj.weight", None),
        )
    ]
    qkv = tuple(hf + f"mixer.{name}_proj.weight" for name in "qkv")
    attention = [
        WeightRule(mg + "input_layernorm.weight", (hf + "norm.weight",), kind="*"),
        WeightRule(mg + "self_attention.linear_qkv.weight", qkv, "qkv", kind="*"),
        WeightRule(mg + "self_attention.linear_proj.weight", (hf + "mixer.o_proj.weight",), kind="*"),
    ]
    mlp = [
        WeightRule(mg + "pre_mlp_layernorm.weight", (hf + "norm.weight",), kind="-"),
        WeightRule(mg + "mlp.linear_fc1.weight", (hf + "mixer.up_proj.weight",), kind="-"),
        WeightRule(mg + "mlp.linear_fc2.weight", (hf + "mixer.down_proj.weight",), kind="-"),
    ]
    return mamba + attention + mlp


# ---- Mixtral: the Mistral attention with a top-k mixture of SwiGLU experts -------------------------------------------
# Mixtral routes by softmax over all experts, top-k, renormalised over the k: Megatron's default router
# (moe_router_score_function="softmax", moe_router_pre_softmax=False, no top-k scaling factor). transformers 5 holds the
# experts fused in memory (mlp.experts.gate_up_proj [E, 2F, h]) but writes the legacy per-expert names on disk, which
# are the names mapped here.


def _mixtral_settings(config: dict) -> ModelSettings:
    architecture = "MixtralForCausalLM"
    if float(config.get("router_jitter_noise") or 0.0) != 0.0:
        _refuse(
            architecture,
            "router_jitter_noise",
            config["router_jitter_noise"],
            "Megatron's router has no multiplicative jitter (--moe-input-jitter-eps adds noise differently); "
            "set it to 0",
        )
    settings = _llama_like_settings(config, architecture, qkv_bias=False)
    experts = _require(config, "num_local_experts", architecture)
    topk = _require(config, "num_experts_per_tok", architecture)
    if not 1 <= topk <= experts:
        _refuse(architecture, "num_experts_per_tok", topk, f"it must be between 1 and num_local_experts ({experts})")
    return replace(
        settings,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=settings.ffn_hidden_size,
        moe_aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.001)),
    )


def _mixtral_config(s: ModelSettings) -> dict:
    config = _llama_like_config(s, "MixtralForCausalLM", "mixtral")
    config.update(
        intermediate_size=s.moe_ffn_hidden_size,
        num_local_experts=s.num_moe_experts,
        num_experts_per_tok=s.moe_router_topk,
        router_aux_loss_coef=s.moe_aux_loss_coeff,
        router_jitter_noise=0.0,
        output_router_logits=False,
        sliding_window=None,
    )
    if s.kv_channels * s.num_attention_heads == s.hidden_size:
        config["head_dim"] = None  # as Mixtral's config writes it: hidden_size / heads
    return config


def _mixtral_layer_rules(s: ModelSettings) -> List[WeightRule]:
    hf = "model.layers.{layer}."
    mg = "decoder.layers.{layer}."
    dense_mlp = (mg + "mlp.linear_fc1.weight", mg + "mlp.linear_fc2.weight")
    rules = [rule for rule in _llama_like_layer_rules(s) if rule.megatron not in dense_mlp]
    rules.append(WeightRule(mg + "mlp.router.weight", (hf + "block_sparse_moe.gate.weight",)))
    for e in range(s.num_moe_experts):  # each expert at its global index, both sides
        expert, mg_expert = hf + f"block_sparse_moe.experts.{e}.", mg + f"mlp.experts.local_experts.{e}."
        rules.append(WeightRule(mg_expert + "linear_fc1.weight", (expert + "w1.weight", expert + "w3.weight"), "cat"))
        rules.append(WeightRule(mg_expert + "linear_fc2.weight", (expert + "w2.weight",)))
    return rules


FAMILIES: Dict[str, FamilyAdapter] = {
    "gpt2": FamilyAdapter(
        name="gpt2",
        architectures=("GPT2LMHeadModel",),
        settings_from_hf=_gpt2_settings,
        hf_config_from_settings=_gpt2_config,
        global_rules=_gpt2_global_rules,
        layer_rules=_gpt2_layer_rules,
        ignorable_hf_suffixes=(".attn.bias", ".attn.masked_bias"),  # causal-mask buffers of older writers
        optional_hf_prefix="transformer.",
    ),
    "llama": _llama_like("llama", "LlamaForCausalLM", "llama", qkv_bias=False),
    "mistral": _llama_like("mistral", "MistralForCausalLM", "mistral", qkv_bias=False),
    "qwen2": _llama_like("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
    "nemotron_h": FamilyAdapter(
        name="nemotron_h",
        architectures=(_NEMOTRON_H,),
        settings_from_hf=_nemotron_h_settings,
        hf_config_from_settings=_nemotron_h_config,
        global_rules=_nemotron_h_global_rules,
        layer_rules=_nemotron_h_layer_rules,
        model_type="hybrid",
    ),
    "mixtral": FamilyAdapter(
        name="mixtral",
        architectures=("MixtralForCausalLM",),
        settings_from_hf=_mixtral_settings,
        hf_config_from_settings=_mixtral_config,
        global_rules=_llama_like_global_rules,
        layer_rules=_mixtral_layer_rules,
        ignorable_hf_suffixes=("rotary_emb.inv_freq",),
    ),
}

# Architectures whose Megatron side is being built elsewhere: refused with what they wait for.
NOT_YET = {}


def family_for_architecture(architecture: Optional[str]) -> FamilyAdapter:
    """The adapter for an HF ``architectures[0]``; refuses unknown and not-yet-supported ones by name."""
    if architecture in NOT_YET:
        raise UnsupportedHFModelError(f"architecture {architecture} is not supported yet: {NOT_YET[architecture]}")
    for family in FAMILIES.values():
        if architecture in family.architectures:
            return family
    known = sorted(a for family in FAMILIES.values() for a in family.architectures)
    raise UnsupportedHFModelError(f"unknown architecture {architecture!r} in config.json; supported: {known}")


def family_for_settings(settings: ModelSettings) -> FamilyAdapter:
    """The family a Megatron model belongs to when no HF config says so (a checkpoint trained here): learned
    positions -> GPT-2; a hybrid -> NemotronH; RoPE + SwiGLU with experts -> Mixtral, with a QKV bias -> Qwen2,
    else -> Llama."""
    if settings.hybrid_layer_pattern is not None:
        return FAMILIES["nemotron_h"]
    if settings.position_embedding_type == "learned_absolute" and settings.normalization == "LayerNorm":
        return FAMILIES["gpt2"]
    if settings.position_embedding_type == "rope" and settings.swiglu and settings.normalization == "RMSNorm":
        if settings.num_moe_experts:
            return FAMILIES["mixtral"]
        return FAMILIES["qwen2" if settings.add_qkv_bias else "llama"]
    raise UnsupportedHFModelError(
        f"no Hugging Face family matches this model (position_embedding_type={settings.position_embedding_type!r}, "
        f"normalization={settings.normalization!r}, swiglu={settings.swiglu}); pass --hf-architecture"
    )

"""Tiny random Hugging Face models, one per supported family, written with transformers' save_pretrained (nothing
downloaded). Norm weights and biases are re-drawn away from 1 and 0, so a swapped norm or a dropped bias moves the
logits."""

import os

import torch

VOCAB, SEQ, BATCH = 100, 12, 2

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

CONFIGS = {
    # learned positions, LayerNorm + biases, tanh GELU, fused Conv1D QKV, tied embeddings
    "gpt2": dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        layer_norm_epsilon=1e-5,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    ),
    # GQA (4 heads, 2 groups), Llama-3 RoPE scaling, untied output layer
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters=LLAMA3_ROPE,
        tie_word_embeddings=False,
    ),
    # head_dim (16) != hidden / heads (8), theta 1e6, tied, no sliding window
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        tie_word_embeddings=True,
    ),
    # QKV bias (no other bias), GQA, tied
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        tie_word_embeddings=True,
    ),
    # Mamba-2 / GQA attention (no RoPE) / squared-ReLU MLP hybrid, untied; 8 Mamba heads in 2 groups (TP2 splits
    # both), a chunk size that does not divide the sequence
    "nemotron_h": dict(
        architectures=["NemotronHForCausalLM"],
        model_type="nemotron_h",
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        ssm_state_size=8,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=5,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    ),
    # 4 experts, top-2 (softmax over all, renormalised over the 2), GQA, untied, no sliding window
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        router_aux_loss_coef=0.02,
        tie_word_embeddings=False,
    ),
}


def hf_model(family: str, seed: int = 0, **overrides):
    """The family's tiny transformers model (fp32, eval mode), with norms and biases re-drawn."""
    import transformers

    values = {**CONFIGS[family], **overrides}
    model_type = values.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                if name.endswith("weight"):
                    param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith((".D", ".A_log")):  # Mamba: D initialised to ones, A_log to log(1..heads)
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    return model.eval()


def save_hf_model(family: str, directory: str, seed: int = 0, **overrides) -> str:
    """Write the family's tiny model to ``directory`` (config.json + model.safetensors)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model(family, seed, **overrides).save_pretrained(directory)
    return directory


def tokens(seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_logits(directory: str, input_ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def all_files(directory: str):
    return sorted(os.listdir(directory))

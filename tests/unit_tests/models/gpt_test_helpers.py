"""Shared pieces of the GPT equivalence tests: build a small model at any TP size and gather its results."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 128, 16, 2

VARIANTS = {
    # learned positions, LayerNorm, GELU, multi-head attention, untied embeddings
    "gpt2": dict(config={}, model={"position_embedding_type": "learned_absolute"}),
    # rotary, RMSNorm, SwiGLU, grouped-query attention, tied embeddings, no biases
    "llama": dict(
        config={
            "normalization": "RMSNorm",
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "num_query_groups": 4,
            "add_bias_linear": False,
        },
        model={"position_embedding_type": "rope", "share_embeddings_and_output_weights": True},
    ),
    # q/k layernorm, squared ReLU, partial rotary with interleaving, QKV bias only
    "qk_norm": dict(
        config={
            "qk_layernorm": True,
            "activation_func": "squared_relu",
            "add_bias_linear": False,
            "add_qkv_bias": True,
            "rotary_interleaved": True,
        },
        model={"position_embedding_type": "rope", "rotary_percent": 0.5},
    ),
}


def build_config(tp: int, sp: bool, overrides: dict) -> TransformerConfig:
    overrides = dict(overrides)
    if overrides.get("activation_func") == "squared_relu":
        from megatron.core.activations import squared_relu

        overrides["activation_func"] = squared_relu
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def build_model(tp: int, sp: bool, variant: str, seed: int = 1234, config_overrides=None) -> GPTModel:
    spec = VARIANTS[variant]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    config = build_config(tp, sp, {**spec["config"], **(config_overrides or {})})
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm)
    return GPTModel(config, layer_spec, vocab_size=VOCAB, max_sequence_length=SEQ, **spec["model"])


def batch(seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, position_ids, labels


def gather_tensor_parallel(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """Reassemble a TP-sharded weight (or its gradient) into the full tensor, undoing a partition stride."""
    if not getattr(param, "tensor_model_parallel", False):
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    tp = dist.get_world_size(group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[rank][s] for s in range(stride) for rank in range(tp)], dim=dim)


def full_gradients(model: torch.nn.Module) -> dict:
    """Every parameter's gradient as the single-process model would have it."""
    grads = {}
    group = parallel_state.get_tensor_model_parallel_group()
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=group)  # each TP rank holds a partial gradient
        grads[name] = gather_tensor_parallel(grad, param)
    return grads


def full_weights(model: torch.nn.Module) -> dict:
    return {name: gather_tensor_parallel(p.detach(), p) for name, p in model.named_parameters()}


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_close_dicts(actual: dict, expected: dict, tolerance: float = 1e-5, what: str = "") -> None:
    assert actual.keys() == expected.keys(), f"{what}: parameter names differ"
    for name in expected:
        assert actual[name].shape == expected[name].shape, f"{what} {name}: shape {actual[name].shape}"
        error = relative_error(actual[name], expected[name])
        assert error <= tolerance, f"{what} {name}: relative error {error:.2e} > {tolerance}"

"""A small HybridModel at any TP / SP / PP layout, and its weights and gradients in checkpoint space.

Checkpoint space is the layout-independent view the distributed checkpoint stores: every tensor (each of the
``.z .x .B .C .dt`` pieces of a Mamba in_proj, say) whole, under its global key. Comparing two layouts there needs
no knowledge of how a module splits its weights over TP ranks or of which stage holds which layer.
"""

from contextlib import contextmanager
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.activations import squared_relu
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, BATCH = 64, 16, 2
PATTERN = "M*-M-"
SEED = 1234


def build_config(tp: int = 1, sp: bool = False, pp: int = 1, num_layers: int = 5, **overrides) -> TransformerConfig:
    """Mamba-2 mixers (8 heads of 16 in 4 groups, state 8), grouped-query attention (8 heads, 4 key/value
    groups), squared-ReLU MLPs, RMSNorm, no biases: the Nemotron-H layer kinds, small."""
    settings = dict(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=128,
        activation_func=squared_relu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mamba_state_dim=8,
        mamba_head_dim=16,
        mamba_num_groups=4,
        is_hybrid_model=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def build_model(
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    pattern: str = PATTERN,
    seed: int = SEED,
    ep: int = 1,
    config_overrides: Optional[dict] = None,
    **model_kwargs,
) -> HybridModel:
    """This rank's stage of the model (model parallel state initialised here for tp x pp x ep);
    ``config_overrides`` go to :func:`build_config` (the MoE fields of a pattern with 'E' layers, say)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    model_parallel_cuda_manual_seed(seed)
    num_layers = len(pattern.replace("|", ""))
    config = build_config(tp, sp, pp, num_layers=num_layers, expert_model_parallel_size=ep, **(config_overrides or {}))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return HybridModel(
        config,
        hybrid_stack_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern=pattern,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        **model_kwargs,
    )


def build_chunks(pp: int, vp: int, pattern: str, seed: int = SEED, config_overrides: Optional[dict] = None):
    """This rank's ``vp`` model chunks (virtual stages) of a ``pattern`` with ``pp * vp`` '|' segments."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    model_parallel_cuda_manual_seed(seed)
    config = build_config(
        pp=pp,
        num_layers=len(pattern.replace("|", "")),
        virtual_pipeline_model_parallel_size=vp,
        **(config_overrides or {}),
    )
    return [
        HybridModel(
            config,
            hybrid_stack_spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern=pattern,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=chunk),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=chunk),
            vp_stage=chunk,
        )
        for chunk in range(vp)
    ]


def batch(seed: int = 7):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens, position_ids, labels


@contextmanager
def _parameters_holding_gradients(model: torch.nn.Module):
    """Every parameter temporarily holds its (TP-complete) gradient, so the sharded state dict shows gradients."""
    swapped = []
    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=group)  # each TP rank holds the gradient of its slice of the sequence
        swapped.append((param, param.data))
        param.data = grad
    try:
        yield
    finally:
        for param, data in swapped:
            param.data = data


def checkpoint_space(model: torch.nn.Module, gradients: bool = False) -> Dict[str, torch.Tensor]:
    """Every tensor of the model's sharded state dict (its gradient with ``gradients``) assembled whole from all
    ranks, by checkpoint key. Collective over the world."""
    if gradients:
        with _parameters_holding_gradients(model):
            return checkpoint_space(model)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    pieces = [
        (
            item.key,
            tuple(item.global_shape),
            tuple(item.global_offset),
            item.prepend_axis_num,
            item.data.detach().clone(),
        )
        for item in nested_values(sharded)
        if isinstance(item, ShardedTensor)
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    full: Dict[str, torch.Tensor] = {}
    for rank_pieces in everyone:
        for key, shape, offset, prepend, data in rank_pieces:
            tensor = full.setdefault(key, torch.zeros(shape, dtype=data.dtype))
            index = tuple(offset[:prepend]) + tuple(
                slice(start, start + size) for start, size in zip(offset[prepend:], data.shape)
            )
            tensor[index] = data
    return full


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, logits.contiguous(), group=group)
    return torch.cat(shards, dim=-1)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def assert_close_dicts(actual: dict, expected: dict, tolerance: float, what: str, keys: Optional[set] = None):
    assert set(actual) == set(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
    for key in sorted(keys or expected):
        assert actual[key].shape == expected[key].shape, f"{what} {key}: shape {actual[key].shape}"
        error = relative_error(actual[key].float(), expected[key].float())
        assert error <= tolerance, f"{what} {key}: relative error {error:.2e} > {tolerance}"


def _microbatches():
    generator = torch.Generator().manual_seed(11)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (2, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (2, SEQ), generator=generator),
            "loss_mask": (torch.rand(2, SEQ, generator=generator) > 0.2).float(),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(2, SEQ),
        }
        for _ in range(4)
    ]


def _forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(data["tokens"], data["position_ids"], None, labels=data["labels"])

    def loss_func(output_tensor):
        loss = (output_tensor.float() * data["loss_mask"]).sum()
        num_tokens = data["loss_mask"].sum().to(torch.int64)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def run_pipeline(pp: int, pattern: str, vp=None, config_overrides: Optional[dict] = None):
    """Four micro-batches through Megatron's schedule (1F1B, or interleaved with ``vp``) at PP=``pp``: the summed
    loss and token count on the last stage, this rank's layers, and weights and gradients in checkpoint space."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    chunks = (
        [build_model(pp=pp, pattern=pattern, config_overrides=config_overrides)]
        if vp is None
        else build_chunks(pp, vp, pattern, config_overrides=config_overrides)
    )
    microbatches = _microbatches()
    reduced = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=[iter(microbatches) for _ in chunks],
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=SEQ,
        micro_batch_size=2,
    )
    loss = torch.stack([item["lm loss"] for item in reduced]).sum(0) if reduced else None
    weights, grads = {}, {}
    for chunk in chunks:
        weights.update(checkpoint_space(chunk))
        grads.update(checkpoint_space(chunk, gradients=True))
    return {
        "loss": loss,
        "layers": "|".join("".join(chunk.decoder.layer_type_list) for chunk in chunks),
        "numbers": [layer.layer_number for chunk in chunks for layer in chunk.decoder.layers],
        "weights": weights,
        "grads": grads,
    }

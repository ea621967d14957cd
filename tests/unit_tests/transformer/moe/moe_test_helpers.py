"""Shared pieces of the MoE tests: a tiny MoE config, a layer built like a block builds it, the global batch, and the
gathering of every gradient to its single-process name (experts by global index)."""

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import layout_independent_init

HIDDEN, SEQ, BATCH, EXPERTS = 16, 8, 2, 4


def moe_config(tp=1, ep=1, etp=None, **overrides) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def build_moe_layer(config: TransformerConfig, seed: int = 1234, layer_number: int = 1):
    """An MoE layer at the current parallel layout, drawn from layer ``layer_number``'s stream as a block would."""
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    spec = get_moe_module_spec(
        use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
    )
    with layout_independent_init(config, stream_offset=layer_number):
        layer = build_module(spec, config=config)
    layer.set_layer_number(layer_number)
    return layer


def global_batch(num_batches: int, seed: int = 5):
    """One ``[s, b, h]`` input and one output-gradient weight per data-parallel rank."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(num_batches)]
    weights = [torch.randn(SEQ, BATCH, HIDDEN, generator=generator) for _ in range(num_batches)]
    return inputs, weights


def _gather_shards(tensor, param, group):
    if not getattr(param, "tensor_model_parallel", False) or group is None or dist.get_world_size(group) == 1:
        return tensor
    size = dist.get_world_size(group)
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(size)], dim=dim)


def _global_name(name: str, num_experts: int) -> str:
    """Local expert ``i`` of this EP rank is global expert ``ep_rank * experts_per_rank + i``."""
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    offset = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep_size)
    name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{offset + int(m.group(1))}.", name)
    return re.sub(r"(linear_fc[12]\.(?:weight|bias))(\d+)$", lambda m: f"{m.group(1)}{offset + int(m.group(2))}", name)


def summed_full_gradients(layer, num_experts: int = EXPERTS) -> dict:
    """Every gradient as the single-process layer run over the whole global batch (one backward per data-parallel
    batch, summed) would hold it, keyed by single-process names: what DDP's reduction computes, done by hand.

    Dense parameters: partial sums over TP for sequence-parallel ones, then summed over the data-parallel group,
    TP shards gathered. Expert parameters (allreduce=False): summed over the expert data-parallel group, expert-TP
    shards gathered, then collected from every EP rank.
    """
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    edp_group = parallel_state.get_expert_data_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    grads, expert_grads = {}, {}
    for name, param in layer.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "allreduce", True):
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=tp_group)
            dist.all_reduce(grad, group=dp_group)
            grads[name] = _gather_shards(grad, param, tp_group)
        else:
            dist.all_reduce(grad, group=edp_group)
            expert_grads[_global_name(name, num_experts)] = _gather_shards(grad, param, etp_group)
    parts = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(parts, expert_grads, group=ep_group)
    for part in parts:
        grads.update(part)
    return grads


def fresh_moe_state() -> None:
    """Workers are reused between tests: start with an empty aux-loss tracker and the aux-loss gradient scale 1."""
    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))


def reduced_tracker() -> dict:
    """The aux-loss tracker reduced across ranks, as the training log sees it ({name: per-layer values})."""
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    values = {name: entry["values"].clone() for name, entry in moe_utils.get_moe_layer_wise_logging_tracker().items()}
    moe_utils.clear_aux_losses_tracker()
    return values

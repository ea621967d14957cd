"""Small helpers of the training application: rank-aware printing, unwrapping, norms, memory, batches."""

from datetime import datetime
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import Float16Module, param_is_not_shared
from megatron.core.utils import device_memory_mb, get_current_device, print_rank_0  # noqa: F401  (re-exported)

ALL_MODULE_WRAPPER_CLASSNAMES = (DistributedDataParallel, Float16Module)


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """Print from the last global rank, which holds the loss under pipeline parallelism."""
    if not dist.is_initialized() or is_last_rank():
        print(message, flush=True)


def print_datetime(message: str) -> None:
    dist.barrier()
    print_rank_0(f"[{message}] datetime: {datetime.now().strftime('%Y-%m-%d %H:%M:%S')} ")


def unwrap_model(model, module_instances=ALL_MODULE_WRAPPER_CLASSNAMES):
    """The model chunks without their DDP / Float16Module wrappers (a list in, a list out)."""
    return_list = isinstance(model, list)
    chunks = model if return_list else [model]
    unwrapped = []
    for chunk in chunks:
        while isinstance(chunk, module_instances):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if return_list else unwrapped[0]


def calc_params_l2_norm(model: List[torch.nn.Module]) -> float:
    """L2 norm of all parameters, each counted once across TP ranks and tied copies, over the model-parallel group."""
    params = [
        param
        for chunk in unwrap_model(model if isinstance(model, list) else [model])
        for param in chunk.parameters()
        if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)
    ]
    return get_grad_norm_fp32(
        [param.detach() for param in params], grad_stats_parallel_group=parallel_state.get_model_parallel_group()
    )


def report_memory(name: str) -> str:
    """A one-line memory report: accelerator MB on a GPU, peak resident set size on a CPU."""
    stats = device_memory_mb()
    if stats is not None:
        fields = " | ".join(f"{key}: {value:.1f}" for key, value in stats.items())
        return f"[Rank {dist.get_rank()}] (after {name}) memory (MB) | {fields}"
    import resource

    max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"[Rank {dist.get_rank()}] (after {name}) memory (MB) | max resident: {max_rss_mb:.1f}"


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch_on_this_tp_rank(data_iterator) -> Dict[str, Optional[torch.Tensor]]:
    """Read the next micro-batch on tensor-parallel rank 0 and broadcast it to the other TP ranks.

    Only the first and last pipeline stages need data (tokens and positions on the first, labels and the loss mask
    on the last); middle stages get Nones. The attention mask is broadcast when the dataset makes one.
    """
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    if not (first or last):
        return {key: None for key in _BATCH_KEYS}
    tp_rank_0 = parallel_state.get_tensor_model_parallel_rank() == 0
    batch = next(data_iterator) if tp_rank_0 else None
    has_mask = torch.tensor([int(tp_rank_0 and batch.get("attention_mask") is not None)], device=get_current_device())
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(has_mask, parallel_state.get_tensor_model_parallel_src_rank(),
                       group=parallel_state.get_tensor_model_parallel_group())
    integer_keys = ["tokens", "labels", "position_ids"]
    data = tensor_parallel.broadcast_data(integer_keys, batch, torch.int64)
    float_data = tensor_parallel.broadcast_data(["loss_mask"], batch, torch.float32)
    attention_mask = None
    if has_mask.item():
        attention_mask = tensor_parallel.broadcast_data(["attention_mask"], batch, torch.bool)["attention_mask"]
    return {
        "tokens": data["tokens"] if first else None,
        "position_ids": data["position_ids"] if first else None,
        "labels": data["labels"] if last else None,
        "loss_mask": float_data["loss_mask"] if last else None,
        "attention_mask": attention_mask,
    }

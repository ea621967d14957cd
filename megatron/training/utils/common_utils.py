"""Small helpers of the training application: rank-aware printing, unwrapping, norms, memory, batches, masks."""

import importlib
import importlib.util
import os
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core._slurm_utils import resolve_slurm_local_rank
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import Float16Module, param_is_not_shared
from megatron.core.utils import cuda_available, device_memory_mb, get_current_device
from megatron.training import argument_utils

ALL_MODULE_WRAPPER_CLASSNAMES = (DistributedDataParallel, Float16Module)


# ---- ranks and printing -----------------------------------------------------------------------------------------


def is_rank0() -> bool:
    """Global rank 0, or a single process before torch.distributed is initialised."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message) -> None:
    """Print from global rank 0 (or always, before torch.distributed is initialised)."""
    if is_rank0():
        print(message, flush=True)


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """Print from the last global rank, which holds the loss under pipeline parallelism."""
    if not dist.is_initialized() or is_last_rank():
        print(message, flush=True)


def warn_rank_0(message: str) -> None:
    """``warnings.warn`` on global rank 0 only, so a job of N ranks warns once, not N times."""
    if is_rank0():
        warnings.warn(message, stacklevel=2)


def get_local_rank_preinit() -> int:
    """This process's rank on its node, read before torch.distributed exists (to pick a device early): LOCAL_RANK
    (torchrun) first, then SLURM_LOCALID inside a SLURM job, else 0 with a warning, since a wrong guess shares a GPU."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    slurm_local_rank = resolve_slurm_local_rank()
    if slurm_local_rank is not None:
        return slurm_local_rank
    warnings.warn("Could not determine local rank from LOCAL_RANK or SLURM_LOCALID. Defaulting to local rank 0.")
    return 0


def is_first_or_last_pipeline_stage(vp_stage) -> bool:
    """Whether this rank's model chunk ``vp_stage`` is the first or the last stage of the pipeline."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return True
    return parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage) or (
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    )


def is_hybrid_model(args) -> bool:
    """Whether the arguments describe a hybrid (Mamba + attention) model: ``--is-hybrid-model`` or a layer pattern."""
    return bool(
        getattr(args, "is_hybrid_model", False)
        or getattr(args, "hybrid_layer_pattern", None)
        or getattr(args, "hybrid_override_pattern", None)
    )


def get_blend_and_blend_per_split(args):
    """``(blend, blend_per_split)`` of the data flags (``--data-path``, ``--data-args-path``, the per-split paths or
    ``--per-split-data-args-path``), as the dataset configs take them; both None for ``--mock-data``."""
    return argument_utils.get_blend_and_blend_per_split(args)


def update_use_dist_ckpt(args) -> None:
    """``args.use_dist_ckpt``: every checkpoint format but the legacy per-rank ``torch`` one is distributed."""
    args.use_dist_ckpt = args.ckpt_format != "torch"


# ---- model wrappers ---------------------------------------------------------------------------------------------


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


def to_empty_if_meta_device(module: torch.nn.Module, *, device: torch.device, recurse=True):
    """Allocate (uninitialised) storage on ``device`` for the parameters and buffers still on the meta device;
    tensors that already have storage keep it. Returns ``module``."""

    def materialize(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor

    return module._apply(materialize, recurse=recurse)


# ---- norms and reductions ---------------------------------------------------------------------------------------


def calc_params_l2_norm(model, force_create_fp32_copy=False) -> float:
    """L2 norm of all parameters, each value counted once on the ranks that hold distinct parts of the model.

    Dense parameters are summed over the model-parallel group (TP x PP, TP-replicated ones on TP rank 0 only, the
    last stage's copy of a tied embedding not at all); expert parameters (``allreduce=False``) over the expert
    tensor x expert x pipeline group, since expert-data-parallel ranks hold identical copies of them. The norm is
    accumulated in fp32 whatever the parameters' dtype, so ``force_create_fp32_copy`` (Megatron's switch for that)
    changes nothing here.
    """
    dense, expert = [], []
    for chunk in unwrap_model(model if isinstance(model, list) else [model]):
        for param in chunk.parameters():
            if not (param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)):
                continue
            (dense if getattr(param, "allreduce", True) else expert).append(param.detach())
    dense_norm = get_grad_norm_fp32(dense, grad_stats_parallel_group=parallel_state.get_model_parallel_group())
    # Every rank joins the expert reduction (a stage or a dense model without experts adds zero), so no rank waits.
    expert_norm = get_grad_norm_fp32(
        expert, grad_stats_parallel_group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    )
    return (dense_norm**2 + expert_norm**2) ** 0.5


def calc_dtensor_params_l2_norm(params) -> float:
    """L2 norm of DTensor parameters (FSDP-style sharded), each reduced over its own device mesh."""
    squares = [torch.linalg.vector_norm(param.detach().float()).full_tensor() ** 2 for param in params]
    if not squares:
        return 0.0
    return torch.stack(squares).sum().sqrt().item()


def average_losses_across_data_parallel_group(losses: List[torch.Tensor]) -> torch.Tensor:
    """The mean over data-parallel ranks of each (scalar) loss in ``losses``, as one tensor."""
    averaged = torch.cat([loss.detach().clone().view(1) for loss in losses])
    group = parallel_state.get_data_parallel_group()
    dist.all_reduce(averaged, group=group)
    return averaged / dist.get_world_size(group=group)


def reduce_max_stat_across_model_parallel_group(stat: Optional[float]) -> Optional[float]:
    """The largest ``stat`` over the model-parallel group; ranks without one pass None (None if nobody has one)."""
    value = torch.tensor([-1.0 if stat is None else float(stat)], dtype=torch.float32, device=get_current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=parallel_state.get_model_parallel_group())
    return None if value.item() == -1.0 else value.item()


def logical_and_across_model_parallel_group(input: bool) -> bool:
    """True only when ``input`` is True on every rank of the model-parallel group."""
    value = torch.tensor([int(bool(input))], dtype=torch.int32, device=get_current_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=parallel_state.get_model_parallel_group())
    return bool(value.item())


def print_params_min_max_norm(optimizer, iteration) -> None:
    """One line per optimizer parameter on every rank: iteration, rank, index, model-parallel flag, min, max, norm."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm"]
    index = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            index += 1
            data = param.detach().float()
            model_parallel = int(getattr(param, "tensor_model_parallel", False))
            lines.append(
                f"{iteration:7d}, {rank:4d}, {index:4d}, {model_parallel:2d}, "
                f"{data.min().item():.6E}, {data.max().item():.6E}, {torch.linalg.norm(data).item():.6E}"
            )
    print("\n".join(lines), flush=True)


# ---- device and memory ------------------------------------------------------------------------------------------


def get_device_arch_version() -> int:
    """The accelerator's compute-capability major version (9 on Hopper); 0 on a CPU, so every "at least
    architecture N" check for a GPU feature is false there."""
    device = get_current_device()
    if device.type == "cpu":
        return 0
    return torch.get_device_module(device).get_device_capability(device)[0]


def report_memory(name: str) -> str:
    """Print (data-parallel rank 0 of each model-parallel group) and return a one-line memory report: accelerator
    MB on a GPU, peak resident set size on a CPU."""
    stats = device_memory_mb()
    if stats is not None:
        fields = " | ".join(f"{key}: {value:.1f}" for key, value in stats.items())
    else:
        import resource

        fields = f"max resident: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}"
    report = f"[Rank {dist.get_rank()}] (after {name}) memory (MB) | {fields}"
    if parallel_state.get_data_parallel_rank() == 0:
        print(report, flush=True)
    return report


def get_nvtx_range():
    """A context-manager factory ``nvtx_range(msg)`` naming a region in profiles: an NVTX range on CUDA (Nsight),
    a ``record_function`` region on other devices (torch.profiler traces)."""

    @contextmanager
    def nvtx_range(msg, *args, **kwargs):
        if cuda_available():
            with torch.cuda.nvtx.range(msg, *args, **kwargs):
                yield
        else:
            with torch.autograd.profiler.record_function(msg):
                yield

    return nvtx_range


def has_nvrx_installed() -> bool:
    """Whether NVIDIA Resiliency Extension (``nvidia_resiliency_ext``) is importable."""
    return importlib.util.find_spec("nvidia_resiliency_ext") is not None


def has_nvrx_checkpointing_async_support() -> bool:
    """Whether NVRx's asynchronous checkpoint module is importable (it is used only when installed)."""
    if not has_nvrx_installed():
        return False
    return importlib.util.find_spec("nvidia_resiliency_ext.checkpointing.async_ckpt") is not None


# ---- batches ----------------------------------------------------------------------------------------------------


def get_ltor_masks_and_position_ids(
    data, eod_token, pad_token, reset_position_ids, reset_attention_mask, eod_mask_loss, pad_mask_loss
):
    """Left-to-right masks for a batch of token ids ``data`` [b, s]: the attention mask [b or 1, 1, s, s]
    (True = masked; one per sample only when ``reset_attention_mask`` makes them differ), the loss mask [b, s]
    (0 at EOD with ``eod_mask_loss``, at padding with ``pad_mask_loss``) and the position ids [b, s]."""
    masks, loss_masks, positions = [], [], []
    for row in data:
        mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            row.cpu(), eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss, create_attention_mask=True
        )
        if pad_mask_loss:
            loss_mask[row.cpu() == pad_token] = 0.0
        masks.append(mask)
        loss_masks.append(loss_mask)
        positions.append(position_ids)
    attention_mask = torch.stack(masks if reset_attention_mask else masks[:1])
    return (
        attention_mask.to(data.device),
        torch.stack(loss_masks).to(data.device),
        torch.stack(positions).to(data.device),
    )


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch_on_this_tp_rank(data_iterator) -> Dict[str, Optional[torch.Tensor]]:
    """Read the next micro-batch on tensor-parallel rank 0 and broadcast it to the other TP ranks.

    Only the first and last pipeline stages need data (tokens and positions on the first, labels and the loss mask
    on the last); middle stages get Nones. The attention mask is broadcast when the dataset makes one.
    """
    # The virtual stage the interleaved schedule is running decides, not just the physical one: only the first
    # chunk of the first stage and the last chunk of the last stage read batches from the shared iterator.
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False)
    if not (first or last):
        return {key: None for key in _BATCH_KEYS}
    tp_rank_0 = parallel_state.get_tensor_model_parallel_rank() == 0
    batch = next(data_iterator) if tp_rank_0 else None
    has_mask = torch.tensor([int(tp_rank_0 and batch.get("attention_mask") is not None)], device=get_current_device())
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(
            has_mask,
            parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
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


# Names that moved up to a module that imports this one; PEP 562 looks them up there on first use, so the old path
# keeps working without an upward import.
_MOVED = {"check_adlr_autoresume_termination": "megatron.training.checkpointing"}


def __getattr__(name):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

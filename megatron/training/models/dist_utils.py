"""Building this rank's model stages and preparing them for distributed training, driven by configs rather than
by the global arguments (``megatron.training.training.get_model`` is the argument-driven path).

The steps, in order: one stage per virtual pipeline rank (``build_virtual_pipeline_stages``), the pre-wrap hook,
default tensor-parallel attributes on every parameter, the parameter count, the move to the device, the
mixed-precision wrapper, meta-device materialisation, and the DDP / Megatron-FSDP wrapper (``_ddp_wrap``).
"""

import contextlib
import logging
from typing import Any, Callable

import torch

from megatron.core import tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    TorchFullyShardedDataParallel,
)
from megatron.core.distributed.distributed_data_parallel import (
    DEFAULT_BUCKET_SIZE_PER_DP_RANK,
    DEFAULT_MIN_BUCKET_SIZE,
)
from megatron.core.enums import ModelType
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel import utils as pipeline_utils
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device, get_model_config, get_pg_rank
from megatron.training.models.base import apply_post_wrap_hooks, compose_hooks


HAVE_FSDP2 = True  # Megatron-LM's flag (it tests for the import); torch FSDP2 is always built here

logger = logging.getLogger(__name__)


def build_virtual_pipeline_stages(
    build_model_func: Callable,
    pg_collection: ProcessGroupCollection,
    vp_size: int | None,
    model_type: ModelType = ModelType.encoder_or_decoder,
) -> list[MegatronModule]:
    """``build_model_func(pg_collection, pre_process=, post_process=[, vp_stage=])`` once per virtual pipeline
    stage (``vp_size`` of them when the pipeline has more than one rank), else once; ``model_type`` set on each."""
    pp_group = pg_collection.pp
    if pp_group.size() > 1 and vp_size is not None:
        stages = []
        for vp_stage in range(vp_size):
            stage = build_model_func(
                pg_collection,
                pre_process=pipeline_utils.is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size)
                and pipeline_utils.is_pp_first_stage(pp_group),
                post_process=pipeline_utils.is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size)
                and pipeline_utils.is_pp_last_stage(pp_group),
                vp_stage=vp_stage,
            )
            stage.model_type = model_type
            stages.append(stage)
        return stages
    stage = build_model_func(
        pg_collection,
        pre_process=pipeline_utils.is_pp_first_stage(pp_group),
        post_process=pipeline_utils.is_pp_last_stage(pp_group),
    )
    stage.model_type = model_type
    return [stage]


def _check_ddp_config(wrap_with_ddp: bool, ddp_config) -> None:
    if wrap_with_ddp and not ddp_config:
        raise ValueError(
            "ddp_config is required when wrap_with_ddp is True: pass a DistributedDataParallelConfig, "
            "or wrap_with_ddp=False to get unwrapped model chunks"
        )


def build_with_wrap_hooks(builder, pg_collection: ProcessGroupCollection, **options) -> list[MegatronModule]:
    """What ``ModelBuilder.build_distributed_models`` does for every single-modality builder: ``builder``'s stages
    through :func:`unimodal_build_distributed_models` with its config's pre-wrap hooks, then its post-wrap hooks
    (``options``: that function's keyword arguments)."""
    config = builder._model_config
    model_list = unimodal_build_distributed_models(
        builder.build_model,
        config.transformer,
        pg_collection,
        pre_wrap_hook=compose_hooks(config.pre_wrap_hooks),
        **options,
    )
    return apply_post_wrap_hooks(config.post_wrap_hooks, compose_hooks, model_list)


def unimodal_build_distributed_models(
    build_model_func: Callable,
    transformer_config: TransformerConfig,
    pg_collection: ProcessGroupCollection,
    ddp_config: DistributedDataParallelConfig | None = None,
    overlap_param_gather_with_optimizer_step: bool = False,
    use_megatron_fsdp: bool = False,
    use_torch_fsdp2: bool = False,
    wrap_with_ddp: bool = True,
    data_parallel_random_init: bool = False,
    mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
    pre_wrap_hook: Callable[[list[MegatronModule]], list[MegatronModule]] | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
) -> list[MegatronModule]:
    """This rank's model stages of a single-modality model (GPT, hybrid), built by ``build_model_func`` (on the
    meta device with ``init_model_with_meta_device``), passed through ``pre_wrap_hook`` (a None result keeps the
    stages), then prepared by ``prepare_existing_model_chunks_for_distributed_training``."""
    _check_ddp_config(wrap_with_ddp, ddp_config)
    vp_size = transformer_config.virtual_pipeline_model_parallel_size
    device = torch.device("meta") if transformer_config.init_model_with_meta_device else contextlib.nullcontext()
    with device:
        model_list = build_virtual_pipeline_stages(build_model_func, pg_collection, vp_size, model_type)
    if pre_wrap_hook is not None:
        if not callable(pre_wrap_hook):
            raise TypeError(f"pre_wrap_hook must be a callable taking the list of model chunks, got {pre_wrap_hook!r}")
        hooked = pre_wrap_hook(model_list)
        if hooked is None:
            logger.warning("The pre-wrap hook returned None; keeping the model chunks it was given.")
        else:
            model_list = hooked
    return prepare_existing_model_chunks_for_distributed_training(
        model_list,
        transformer_config,
        pg_collection,
        ddp_config=ddp_config,
        overlap_param_gather_with_optimizer_step=overlap_param_gather_with_optimizer_step,
        use_megatron_fsdp=use_megatron_fsdp,
        use_torch_fsdp2=use_torch_fsdp2,
        wrap_with_ddp=wrap_with_ddp,
        data_parallel_random_init=data_parallel_random_init,
        mixed_precision_wrapper=mixed_precision_wrapper,
    )


def prepare_existing_model_chunks_for_distributed_training(
    model_list: list[MegatronModule],
    transformer_config: TransformerConfig,
    pg_collection: ProcessGroupCollection,
    ddp_config: DistributedDataParallelConfig | None = None,
    overlap_param_gather_with_optimizer_step: bool = False,
    use_megatron_fsdp: bool = False,
    use_torch_fsdp2: bool = False,
    wrap_with_ddp: bool = True,
    data_parallel_random_init: bool = False,
    mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
) -> list[MegatronModule]:
    """Model chunks already built, made ready for training: default tensor-parallel attributes on every
    parameter (the optimizer reads them), the parameter count printed, moved to the device (not with Torch FSDP2,
    CPU initialisation or the meta device), wrapped for fp16/bf16, meta tensors materialised, then DDP/FSDP."""
    _check_ddp_config(wrap_with_ddp, ddp_config)
    on_meta = transformer_config.init_model_with_meta_device
    for chunk in model_list:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    _print_num_params(model_list, pg_collection=pg_collection)
    if not use_torch_fsdp2 and not transformer_config.use_cpu_initialization and not on_meta:
        device = get_current_device()
        for chunk in model_list:
            chunk.to(device)
    model_list = _wrap_with_mp_wrapper(model_list, transformer_config, mixed_precision_wrapper)
    if on_meta and not use_torch_fsdp2 and not use_megatron_fsdp:
        model_list = [to_empty_if_meta_device(chunk, device=get_current_device()) for chunk in model_list]
    if wrap_with_ddp:
        model_list = _ddp_wrap(
            model_list,
            data_parallel_random_init,
            ddp_config,
            overlap_param_gather_with_optimizer_step,
            use_megatron_fsdp=use_megatron_fsdp,
            use_torch_fsdp2=use_torch_fsdp2,
            pg_collection=pg_collection,
        )
    return model_list


def _print_num_params(model: list[MegatronModule], pg_collection: ProcessGroupCollection) -> None:
    """The parameter count of this rank's chunks, printed once per model-parallel rank (data- and
    context-parallel rank 0)."""
    if pg_collection.dp.rank() != 0 or pg_collection.cp.rank() != 0:
        return
    count = sum(param.nelement() for chunk in model for param in chunk.parameters())
    gtp_remat = getattr(pg_collection, "gtp_remat", None)
    print(
        f" > number of parameters on (tensor, gtp_remat, pipeline) model parallel rank "
        f"({pg_collection.tp.rank()}, {0 if gtp_remat is None else get_pg_rank(gtp_remat)}, "
        f"{pg_collection.pp.rank()}): {count}",
        flush=True,
    )


def _wrap_with_mp_wrapper(
    model_list: list[MegatronModule],
    transformer_config: TransformerConfig,
    mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
) -> list[MegatronModule]:
    """Each chunk in ``mixed_precision_wrapper(config, chunk)`` for fp16/bf16; MoE expert biases stay fp32."""
    if not (transformer_config.fp16 or transformer_config.bf16) or mixed_precision_wrapper is None:
        return model_list
    model_list = [mixed_precision_wrapper(transformer_config, chunk) for chunk in model_list]
    for chunk in model_list:
        for submodule in chunk.modules():
            if hasattr(submodule, "_maintain_float32_expert_bias"):
                submodule._maintain_float32_expert_bias()
    return model_list


def _data_parallel_class(use_megatron_fsdp: bool, use_torch_fsdp2: bool):
    if use_megatron_fsdp and use_torch_fsdp2:
        raise ValueError(
            "use_megatron_fsdp and use_torch_fsdp2 cannot both be set (--use-megatron-fsdp, --use-torch-fsdp2); "
            "choose one"
        )
    if use_megatron_fsdp:
        return FullyShardedDataParallel
    if use_torch_fsdp2:
        return TorchFullyShardedDataParallel
    return DistributedDataParallel


def _set_bucket_size(model: list[MegatronModule], ddp_config, pg_collection) -> None:
    """``ddp_config.bucket_size`` as Megatron-LM sets it: total parameters / ``num_buckets`` when given, else
    max(40M, 1M x the data-parallel size) elements, and None (one bucket) without ``overlap_grad_reduce``."""
    if ddp_config.num_buckets is not None:
        ddp_config.bucket_size = sum(param.nelement() for chunk in model for param in chunk.parameters()) // (
            ddp_config.num_buckets
        )
    if ddp_config.bucket_size is None:
        ddp_config.bucket_size = max(
            DEFAULT_MIN_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * pg_collection.dp_cp.size()
        )
    if not ddp_config.overlap_grad_reduce:
        ddp_config.bucket_size = None


def _full_param_layout(chunk, ddp_config, pg_collection, disable_bucketing: bool):
    """The distributed optimizer's parameter layout of one chunk, over the group the optimizer shards across."""
    params = [param for param in chunk.parameters() if param.requires_grad]
    bucket_size = None if disable_bucketing or pg_collection.pp.rank() > 0 else ddp_config.bucket_size
    dp_group = getattr(pg_collection, "intra_dp_cp", None)
    dp_group = pg_collection.dp_cp if dp_group is None else dp_group
    expert_dp_group = getattr(pg_collection, "intra_expt_dp", None)
    expert_dp_group = pg_collection.expt_dp if expert_dp_group is None else expert_dp_group
    return DistributedOptimizer.compute_full_param_layout(
        params, bucket_size, dp_group.size(), ddp_config, expert_data_parallel_world_size=expert_dp_group.size()
    )


def _ddp_wrap(
    model: list[MegatronModule],
    data_parallel_random_init: bool,
    ddp_config: DistributedDataParallelConfig,
    overlap_param_gather_with_optimizer_step: bool,
    use_megatron_fsdp: bool = False,
    use_torch_fsdp2: bool = False,
    *,
    pg_collection: ProcessGroupCollection,
) -> list[MegatronModule]:
    """Each chunk wrapped in DDP (or Megatron-FSDP); only the first chunk is bucketed (none with
    ``overlap_param_gather_with_optimizer_step``); parameters broadcast from data-parallel rank 0 when
    ``data_parallel_random_init``."""
    data_parallel = _data_parallel_class(use_megatron_fsdp, use_torch_fsdp2)
    if not use_torch_fsdp2:
        _set_bucket_size(model, ddp_config, pg_collection)
    wrapped = []
    for index, chunk in enumerate(model):
        disable_bucketing = index > 0 or overlap_param_gather_with_optimizer_step
        kwargs = {} if use_torch_fsdp2 else {"pg_collection": pg_collection}
        if ddp_config.use_distributed_optimizer and data_parallel is DistributedDataParallel:
            kwargs["full_param_layout"] = _full_param_layout(chunk, ddp_config, pg_collection, disable_bucketing)
        wrapped.append(
            data_parallel(
                config=get_model_config(chunk),
                ddp_config=ddp_config,
                module=chunk,
                disable_bucketing=disable_bucketing,
                **kwargs,
            )
        )
    if data_parallel_random_init:
        for chunk in wrapped:
            chunk.broadcast_params()
    return wrapped


def to_empty_if_meta_device(module: torch.nn.Module, *, device: torch.device, recurse=True):
    """``module`` with its meta tensors replaced by uninitialised ones on ``device`` and the others moved there
    (unlike ``Module.to_empty``, which would also overwrite buffers computed at construction)."""

    def materialize(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "meta":
            return torch.empty_like(tensor, device=device)
        return tensor.to(device)

    return module._apply(materialize, recurse=recurse)

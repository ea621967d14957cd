"""Start-up of a training job: arguments, torch.distributed, process groups, seeds, micro-batch calculator."""

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.utils import cuda_available, set_device_for_rank
from megatron.training.arguments import parse_args, validate_args
from megatron.training.checkpointing import load_args_from_checkpoint
from megatron.training.global_vars import get_args, set_global_variables

logger = logging.getLogger(__name__)


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, parsed_args=None):
    """Parse and validate Megatron's flags, then bring up torch.distributed and every process group.

    Every check on the flags runs before the first collective, so a bad flag fails fast on every rank alike.
    """
    args = parsed_args if parsed_args is not None else parse_args(extra_args_provider, ignore_unknown_args)
    if args.use_checkpoint_args:
        load_args_from_checkpoint(args)
    validate_args(args, args_defaults)
    set_global_variables(args)  # also the micro-batch calculator, tokenizer, timers and writers
    _initialize_distributed(args)
    _set_random_seed(args.seed, args.data_parallel_random_init)
    return args


def _initialize_distributed(args) -> None:
    """torchrun's environment -> process group (nccl on GPUs, gloo on CPUs) -> model-parallel groups."""
    if cuda_available():
        set_device_for_rank(args.local_rank)
    else:
        # One rank per core slice: without this every rank starts one thread per core and they fight.
        threads = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a plain `python pretrain_gpt.py` is a 1-rank job
        os.environ.setdefault("MASTER_PORT", "6000")
        dist.init_process_group(
            backend=args.distributed_backend,
            world_size=args.world_size,
            rank=args.rank,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    if args.rank == 0:
        logger.info(
            "initialized tensor model parallel with size %d, pipeline model parallel with size %d, "
            "data parallel with size %d",
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(),
        )


def _set_random_seed(seed: int, data_parallel_random_init: bool = False) -> None:
    """Megatron's seeding: a different stream per pipeline stage, optionally per DP rank, then the TP tracker."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed = seed + 10 * parallel_state.get_data_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def get_args_or_initialize():
    """The parsed arguments (for tools that may run before or after initialize_megatron)."""
    return get_args()

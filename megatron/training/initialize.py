"""Start-up of a training job: torch.distributed, process groups, seeds and the run's globals.

As in Megatron-LM 0.19 the flags are parsed and validated first (``parse_and_validate_args``, which sets them as
the run's arguments); ``initialize_megatron`` then brings up everything that depends on them. Called with no
arguments set, it parses and validates the command line itself.
"""

import atexit
import logging
import os
import random
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.utils import cuda_available, get_current_device, set_device_for_rank
from megatron.training.argument_validation import _print_args
from megatron.training.error_handling import exit_with_launcher
from megatron.training.global_vars import (
    get_adlr_autoresume,
    get_args,
    get_tensorboard_writer,
    set_global_variables,
)

logger = logging.getLogger(__name__)


def initialize_megatron(
    allow_no_cuda=False,
    skip_mpu_initialization=False,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    store=None,
    skip_model_parallel_init=False,
    seed_pp_group=None,
    seed_dp_group=None,
    seed_tp_group=None,
    seed_ep_group=None,
    seed_etp_group=None,
    skip_random_seed=False,
):
    """Bring up the run from its validated arguments: globals, torch.distributed, process groups, seeds.

    - ``allow_no_cuda``: with ``--distributed-backend nccl`` on a machine without CUDA, fall back to gloo (with a
      warning) instead of refusing to start.
    - ``skip_mpu_initialization``: set the globals only (no torch.distributed, no groups, no seeds).
    - ``get_embedding_ranks`` / ``get_position_embedding_ranks``: which pipeline ranks hold the (position)
      embeddings, handed to ``parallel_state.initialize_model_parallel``.
    - ``store``: a ``torch.distributed.Store`` to rendezvous through instead of the environment's address.
    - ``skip_model_parallel_init``: initialise torch.distributed but create no model-parallel groups (the caller
      brings its own, e.g. a ``ProcessGroupCollection``); seeds then use the ``seed_*_group`` ranks.
    - ``seed_pp_group`` ... ``seed_etp_group``: groups whose ranks offset the seeds instead of parallel_state's.
    - ``skip_random_seed``: leave every random generator as it is.

    Returns the arguments. Every check on the flags ran before the first collective, so a bad flag fails fast.
    """
    args = _validated_args()
    if args.distributed_backend == "nccl" and not cuda_available():
        if not allow_no_cuda:
            raise RuntimeError(
                "--distributed-backend nccl needs CUDA, which this machine does not have; use "
                "--distributed-backend gloo (or initialize_megatron(allow_no_cuda=True) to fall back to it)"
            )
        warnings.warn("no CUDA on this machine: using the gloo backend instead of nccl (allow_no_cuda=True)")
        args.distributed_backend = "gloo"
    set_global_variables(args)  # also the micro-batch calculator, tokenizer, timers and writers
    setup_logging()
    if skip_mpu_initialization:
        return args
    _initialize_distributed(args, store, get_embedding_ranks, get_position_embedding_ranks, skip_model_parallel_init)
    if not skip_random_seed:
        _set_random_seed(
            args.seed,
            args.data_parallel_random_init,
            pp_group=seed_pp_group,
            dp_group=seed_dp_group,
            tp_group=seed_tp_group,
            ep_group=seed_ep_group,
            etp_group=seed_etp_group,
        )
    _init_autoresume()
    _print_args("arguments", args)  # once start-up has succeeded
    return args


def _validated_args():
    try:
        return get_args()
    except RuntimeError:  # nothing parsed yet: a plain initialize_megatron() reads the command line
        from megatron.training.arguments import parse_and_validate_args

        return parse_and_validate_args()


def _destroy_process_groups() -> None:
    """At a normal exit, while the interpreter is still whole: a gloo group left for interpreter shutdown to tear
    down can abort the rank ("terminate called without an active exception") after its work is done, and an NCCL
    group should be destroyed explicitly. Error exits leave through ``exit_now`` and never get here."""
    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the model-parallel ones included


def _initialize_distributed(
    args, store, get_embedding_ranks, get_position_embedding_ranks, skip_model_parallel_init
) -> None:
    """torchrun's environment (or ``store``) -> process group (nccl on GPUs, gloo on CPUs) -> model-parallel
    groups."""
    exit_with_launcher()  # before anything that can block: a rank must not outlive a killed torchrun
    if cuda_available():
        set_device_for_rank(args.local_rank)
    else:
        # One rank per core slice: without this every rank starts one thread per core and they fight.
        threads = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", threads)))
    if not dist.is_initialized():
        if store is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a plain `python pretrain_gpt.py` is a 1-rank job
            os.environ.setdefault("MASTER_PORT", "6000")
        dist.init_process_group(
            backend=args.distributed_backend,
            world_size=args.world_size,
            rank=args.rank,
            timeout=timedelta(minutes=args.distributed_timeout_minutes),
            store=store,
        )
        atexit.unregister(_destroy_process_groups)  # once, however many runs one process starts
        atexit.register(_destroy_process_groups)
    if skip_model_parallel_init or parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
    )
    if args.rank == 0:
        logger.info(
            "initialized tensor model parallel with size %d, pipeline model parallel with size %d, "
            "data parallel with size %d",
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size(),
        )


def _group_rank(group, fallback) -> int:
    """This process's rank in ``group``; parallel_state's rank (``fallback``) when no group is given."""
    if group is not None:
        return dist.get_rank(group)
    return fallback() if parallel_state.model_parallel_is_initialized() else 0


def _set_random_seed(
    seed_: int,
    data_parallel_random_init: bool = False,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    pp_group=None,
    dp_group=None,
    tp_group=None,
    ep_group=None,
    etp_group=None,
) -> None:
    """Megatron's seeding: a different stream per pipeline stage, optionally per DP rank, then the TP tracker."""
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"Seed ({seed_}) should be a positive integer: set --seed to a positive integer")
    seed = seed_ + 100 * _group_rank(pp_group, parallel_state.get_pipeline_model_parallel_rank)
    if data_parallel_random_init:
        seed = seed + 10 * _group_rank(dp_group, parallel_state.get_data_parallel_rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed,
        te_rng_tracker,
        inference_rng_tracker,
        use_cudagraphable_rng,
        tp_rank=_group_rank(tp_group, parallel_state.get_tensor_model_parallel_rank),
        ep_rank=_group_rank(ep_group, parallel_state.get_expert_model_parallel_rank),
        etp_rank=_group_rank(etp_group, parallel_state.get_expert_tensor_parallel_rank),
    )


def _init_autoresume() -> None:
    """ADLR autoresume (``--adlr-autoresume`` on NVIDIA's clusters): initialise it on every rank together."""
    autoresume = get_adlr_autoresume()
    if autoresume is not None:
        dist.barrier()
        autoresume.init()
        dist.barrier()


def set_jit_fusion_options(tp_size=None) -> None:
    """Configure TorchScript as Megatron-LM does (profiling executor; the legacy CPU/GPU fusers and the
    TensorExpr fuser off) and warm up this project's TorchScript functions (``gelu_impl``, ``erf_gelu``) at the
    run's activation shape ``[seq_length / tp_size, micro_batch_size, ffn_hidden_size / tp_size]`` and dtype, so
    the profiling executor has specialised them before the first step. ``tp_size`` defaults to
    ``--tensor-model-parallel-size``."""
    from megatron.core.transformer.utils import erf_gelu, gelu_impl

    args = get_args()
    torch._C._jit_set_profiling_executor(True)
    torch._C._jit_set_profiling_mode(True)
    torch._C._jit_override_can_fuse_on_cpu(False)
    torch._C._jit_override_can_fuse_on_gpu(False)
    torch._C._jit_set_texpr_fuser_enabled(False)
    torch._C._debug_set_autodiff_subgraph_inlining(False)

    tp_size = tp_size or args.tensor_model_parallel_size
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    shape = (max(1, args.seq_length // tp_size), args.micro_batch_size, max(1, args.ffn_hidden_size // tp_size))
    # A deterministic input: drawing random numbers here would shift every generator the run is seeded with.
    x = torch.linspace(-3.0, 3.0, shape[0] * shape[1] * shape[2], device=get_current_device()).to(dtype)
    x = x.view(shape).requires_grad_(True)
    for function in (gelu_impl, erf_gelu):
        for _ in range(2):  # the profiling executor optimises a function on its second call
            function(x).sum().backward()
    x.grad = None


def setup_logging() -> None:
    """The root logger's level: ``--logging-level``, else the ``MEGATRON_LOGGING_LEVEL`` environment variable;
    left as it is when neither is given."""
    level = getattr(get_args(), "logging_level", None)
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)


def write_args_to_tensorboard() -> None:
    """Write every argument as a text entry to TensorBoard (on the writing rank, with ``--tensorboard-dir``)."""
    args = get_args()
    writer = get_tensorboard_writer()
    if writer is None:
        return
    for name, value in sorted(vars(args).items()):
        writer.add_text(name, str(value), global_step=getattr(args, "iteration", 0))

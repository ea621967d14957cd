"""initialize_megatron's Megatron-0.19 parameters, each doing what it says, and the other start-up helpers."""

import logging
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.training import global_vars
from megatron.training.initialize import (
    initialize_megatron,
    set_jit_fusion_options,
    setup_logging,
    write_args_to_tensorboard,
)
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.training.test_arguments import validated


@pytest.fixture
def clean_process():
    """This process before and after: no globals, no process group (initialize_megatron creates one here)."""
    global_vars.unset_global_variables()
    yield
    global_vars.unset_global_variables()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_skip_mpu_initialization_sets_the_globals_only(clean_process):
    args = validated()
    global_vars.set_args(args)
    assert initialize_megatron(skip_mpu_initialization=True) is args
    assert global_vars.get_tokenizer() is not None and global_vars.get_timers() is not None
    assert not dist.is_initialized()


def test_store_and_skip_model_parallel_init(clean_process, tmp_path):
    global_vars.set_args(validated())
    store = dist.FileStore(str(tmp_path / "store"), 1)
    initialize_megatron(store=store, skip_model_parallel_init=True)
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert not parallel_state.model_parallel_is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_nccl_without_cuda_is_refused_unless_allow_no_cuda(clean_process, tmp_path):
    args = validated()
    args.distributed_backend = "nccl"
    global_vars.set_args(args)
    with pytest.raises(RuntimeError, match="--distributed-backend nccl needs CUDA, which this machine does not have"):
        initialize_megatron(skip_mpu_initialization=True)
    with pytest.warns(UserWarning, match="using the gloo backend instead of nccl"):
        initialize_megatron(allow_no_cuda=True, store=dist.FileStore(str(tmp_path / "store"), 1))
    assert dist.get_backend() == "gloo"


def test_a_normal_exit_destroys_the_process_groups(tmp_path):
    """Left to interpreter shutdown, a gloo group can abort a finished rank ("terminate called without an active
    exception"). atexit handlers run last-registered first, so the probe registered before initialize_megatron
    runs after its clean-up and must find no process group."""
    script = textwrap.dedent(f"""
        import atexit, torch.distributed as dist
        atexit.register(lambda: print("groups at exit:", dist.is_initialized(), flush=True))
        from megatron.training import global_vars
        from megatron.training.initialize import initialize_megatron
        from tests.unit_tests.training.test_arguments import validated
        global_vars.set_args(validated())
        initialize_megatron(store=dist.FileStore({str(tmp_path / "store")!r}, 1))
        assert dist.is_initialized()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "groups at exit: False" in result.stdout


def test_skip_random_seed_leaves_the_generators_alone(clean_process, tmp_path):
    global_vars.set_args(validated("--seed", 5))
    torch.manual_seed(99)
    initialize_megatron(skip_random_seed=True, store=dist.FileStore(str(tmp_path / "store"), 1))
    assert torch.initial_seed() == 99


def _embedding_ranks_and_seeds(custom):
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from megatron.training.initialize import initialize_megatron

    args = validated("--pipeline-model-parallel-size", 2, "--seed", 7, world_size=2)
    args.rank = dist.get_rank()
    global_vars.set_args(args)
    try:
        if custom:
            initialize_megatron(
                get_embedding_ranks=lambda pp_ranks, vp=None: pp_ranks[:1],
                get_position_embedding_ranks=lambda pp_ranks, vp=None: pp_ranks[-1:],
            )
        else:
            initialize_megatron()
        return (
            parallel_state.get_embedding_group_ranks(),
            parallel_state.is_rank_in_position_embedding_group(),
            torch.initial_seed(),
        )
    finally:
        global_vars.unset_global_variables()


def test_embedding_ranks_reach_parallel_state():
    # Default: the first and last pipeline stages share the embedding; only the first holds position embeddings.
    assert run_distributed(2, _embedding_ranks_and_seeds, False) == [([0, 1], True, 7), ([0, 1], False, 107)]
    assert run_distributed(2, _embedding_ranks_and_seeds, True) == [([0], False, 7), ([0], True, 107)]


def _seeded_by_groups():
    from megatron.training import global_vars
    from megatron.training.initialize import initialize_megatron

    args = validated("--seed", 3, world_size=2)
    args.rank = dist.get_rank()
    global_vars.set_args(args)
    try:
        # No model-parallel groups; the world group stands in for the pipeline group of the seed offsets.
        initialize_megatron(skip_model_parallel_init=True, seed_pp_group=dist.group.WORLD)
        return torch.initial_seed()
    finally:
        global_vars.unset_global_variables()


def test_seed_groups_give_the_rank_offsets():
    assert run_distributed(2, _seeded_by_groups) == [3, 103]


def test_setup_logging_sets_the_root_level(monkeypatch, clean_process):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)
    args = validated()
    args.logging_level = logging.ERROR
    global_vars.set_args(args)
    setup_logging()
    assert root.level == logging.ERROR
    args.logging_level = None
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", str(logging.DEBUG))
    setup_logging()
    assert root.level == logging.DEBUG


def test_set_jit_fusion_options_configures_torchscript_and_warms_up(clean_process):
    global_vars.set_args(validated())
    state = torch.random.get_rng_state()
    set_jit_fusion_options(tp_size=2)
    assert not torch._C._jit_can_fuse_on_cpu() and not torch._C._jit_texpr_fuser_enabled()
    assert torch.equal(torch.random.get_rng_state(), state)  # the warm-up draws no random numbers


def test_write_args_to_tensorboard(monkeypatch, clean_process):
    texts = {}
    writer = types.SimpleNamespace(add_text=lambda name, value, global_step: texts.setdefault(name, value))
    global_vars.set_args(validated("--seed", 11))
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", writer)
    write_args_to_tensorboard()
    assert texts["seed"] == "11" and texts["num_layers"] == "4"

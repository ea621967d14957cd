"""megatron.training.training's Megatron-0.19 functions: refusals before any collective, training length from
samples, FLOPs of packed sequences, DDP wrapping and bucket sizes, hooks, the progress log, callbacks, evaluation
with non-loss data."""

import argparse
import io
import types
from contextlib import redirect_stdout
from datetime import datetime, timedelta

import pytest
import torch

from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
)
from megatron.training import flops, global_vars, progress_log, training
from megatron.training.training import (
    build_train_valid_test_data_iterators,
    build_train_valid_test_datasets,
    compute_throughputs_and_append_to_progress_log,
    cyclic_iter,
    disable_forward_pre_hook,
    dummy_train_step,
    enable_forward_pre_hook,
    force_param_sync,
    get_start_time_from_progress_log,
    num_floating_point_operations,
    post_training_step_callbacks,
    preprocess_common_state_dict,
    pretrain,
    print_datetime,
    resolve_ddp_bucket_size,
    set_startup_timestamps,
    setup_model_and_optimizer,
    should_disable_forward_pre_hook,
    train,
    update_train_iters,
    wrap_model_chunks_with_ddp,
)
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.training.test_arguments import validated


@pytest.fixture(autouse=True)
def clean_globals():
    global_vars.unset_global_variables()
    yield
    global_vars.unset_global_variables()


def test_refusals_come_before_any_collective():
    with pytest.raises(ValueError, match="not supported yet: Megatron's configuration container \\(dict\\)"):
        pretrain({}, None, ModelType.encoder_or_decoder, None, model_provider=lambda **kw: None)
    with pytest.raises(ValueError, match=r"not supported yet: building the model .* \(model_provider=None\)"):
        pretrain(None, None, ModelType.encoder_or_decoder, None)
    with pytest.raises(ValueError, match="not supported yet: in-process restart"):
        pretrain(
            None,
            None,
            ModelType.encoder_or_decoder,
            None,
            model_provider=lambda **kw: None,
            inprocess_call_wrapper=object(),
        )
    global_vars.set_args(validated())
    with pytest.raises(ValueError, match=r"\(model_provider_func=None\)"):
        setup_model_and_optimizer(ModelType.encoder_or_decoder)
    with pytest.raises(ValueError, match="not supported yet: a separate inference model"):
        train(None, [], None, None, None, None, None, None, {}, None, inference_model=object())
    with pytest.raises(ValueError, match="bucket_sizes has 1 entries for 2 model chunks"):
        wrap_model_chunks_with_ddp([None, None], None, None, bucket_sizes=[10])


def test_update_train_iters_from_samples_with_and_without_ramp_up():
    args = types.SimpleNamespace(train_samples=100, global_batch_size=8, rampup_batch_size=None)
    update_train_iters(args)
    assert args.train_iters == 12
    # Batches of 4 for the first 16 samples (4 iterations), then 8: 4 + 1 iterations reach 24 samples, then
    # (100 - 24) // 8 = 9 more.
    init_num_microbatches_calculator(0, [4, 4, 16], 8, 1, 1)
    try:
        args = types.SimpleNamespace(train_samples=100, global_batch_size=8, rampup_batch_size=["4", "4", "16"])
        update_train_iters(args)
        assert args.train_iters == 14
    finally:
        unset_num_microbatches_calculator()


def test_packed_sequence_flops_reduce_to_the_padded_count_for_equal_lengths():
    args = argparse.Namespace(**vars(validated("--seq-length", 32)))
    args.padded_vocab_size = 128
    batch, seq = 4, 32
    assert num_floating_point_operations(args, batch) == flops.num_floating_point_operations(args, batch)
    assert num_floating_point_operations(args, batch, batch * seq**2, batch * seq) == pytest.approx(
        flops.num_floating_point_operations(args, batch)
    )
    # Shorter sequences cost less attention for the same tokens.
    assert num_floating_point_operations(args, batch, 8 * 16**2, 8 * 16) < flops.num_floating_point_operations(
        args, batch
    )


def test_packed_sequence_flops_with_one_statistic_keep_the_other_terms():
    args = argparse.Namespace(**vars(validated("--seq-length", 32)))
    args.padded_vocab_size = 128
    batch, seq = 4, 32
    full = flops.num_floating_point_operations(args, batch)
    no_attention = num_floating_point_operations(args, batch, seqlen_squared_sum_in_batch=0)
    doubled = num_floating_point_operations(args, batch, seqlen_squared_sum_in_batch=2 * batch * seq**2)
    assert no_attention < full and doubled - full == pytest.approx(full - no_attention)
    assert num_floating_point_operations(args, batch, total_real_tokens_in_batch=batch * seq) == pytest.approx(full)


def test_seqlen_stats_without_process_groups_and_empty_updates():
    from megatron.training.training import consume_seqlen_stats_in_iteration, update_seqlen_stats_from_cu_seqlens

    update_seqlen_stats_from_cu_seqlens(None)
    update_seqlen_stats_from_cu_seqlens(torch.tensor([0]))
    assert consume_seqlen_stats_in_iteration() == (None, None)
    update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 100, 300]))
    assert consume_seqlen_stats_in_iteration() == (300.0, 50000.0)
    assert consume_seqlen_stats_in_iteration() == (None, None)


def _seqlen_stats():
    from megatron.core import parallel_state
    from megatron.training.training import consume_seqlen_stats_in_iteration, update_seqlen_stats_from_cu_seqlens

    parallel_state.initialize_model_parallel()
    update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 3, 7]))
    update_seqlen_stats_from_cu_seqlens(torch.tensor([0, 1]))
    return consume_seqlen_stats_in_iteration(), consume_seqlen_stats_in_iteration()


def test_seqlen_stats_sum_over_data_parallel_ranks_and_reset():
    # Per rank: lengths 3, 4 and 1 -> tokens 8, squares 26; two data-parallel ranks.
    assert run_distributed(2, _seqlen_stats) == [((16.0, 52.0), (None, None))] * 2


def test_resolve_ddp_bucket_size():
    group = types.SimpleNamespace(size=lambda: 4)
    config = types.SimpleNamespace(bucket_size=None)
    assert resolve_ddp_bucket_size(config, group, False, 10**9) is None
    assert resolve_ddp_bucket_size(config, group, True, 10**9) == 40_000_000
    assert resolve_ddp_bucket_size(types.SimpleNamespace(bucket_size=1000), group, True, 10**9) == 1000
    assert resolve_ddp_bucket_size(config, group, True, 1000) is None  # one bucket holds everything anyway


def _wrap_chunks():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()

    class MyDDP(DistributedDataParallel):
        pass

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    chunks = [torch.nn.Linear(8, 8) for _ in range(3)]
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    wrapped = wrap_model_chunks_with_ddp(
        chunks,
        config,
        ddp_config,
        DP=MyDDP,
        bucket_sizes=[10, 20, 30],
        disable_bucketing_per_chunk=[False, True, False],
    )
    default = wrap_model_chunks_with_ddp(chunks[:2], config, ddp_config)
    return (
        [type(w).__name__ for w in wrapped],
        [w.bucket_size for w in wrapped],
        [w.ddp_config.bucket_size for w in wrapped],
        [w.bucket_size is None for w in default],
    )


def test_wrap_model_chunks_with_ddp():
    assert run_distributed(2, _wrap_chunks) == [(["MyDDP"] * 3, [10, None, 30], [10, 20, 30], [False, True])] * 2


def test_forward_pre_hook_helpers_dispatch_to_every_chunk():
    calls = []
    chunk = types.SimpleNamespace(
        enable_forward_pre_hook=lambda: calls.append("enable"),
        disable_forward_pre_hook=lambda param_sync: calls.append(f"disable {param_sync}"),
        start_param_sync=lambda force_sync: calls.append(f"sync {force_sync}"),
    )
    enable_forward_pre_hook([chunk, chunk])
    disable_forward_pre_hook([chunk], param_sync=False)
    force_param_sync([chunk])
    assert calls == ["enable", "enable", "disable False", "sync True"]
    assert should_disable_forward_pre_hook(
        types.SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=True)
    )
    assert not should_disable_forward_pre_hook(
        types.SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=False)
    )


def test_dummy_train_step_reads_the_micro_batches_of_a_skipped_step():
    init_num_microbatches_calculator(0, None, 8, 2, 1)  # 4 micro-batches
    try:
        first, second = iter(range(10)), iter(range(100, 110))
        dummy_train_step([first, None, second])
        assert next(first) == 4 and next(second) == 104
    finally:
        unset_num_microbatches_calculator()


def test_post_training_step_callbacks(monkeypatch):
    collected, exits, steps = [], [], []
    monkeypatch.setattr(training.gc, "collect", lambda: collected.append(True))
    global_vars.set_args(types.SimpleNamespace(manual_gc=True, manual_gc_interval=2, profile=True, profile_step_end=3))
    prof = types.SimpleNamespace(step=lambda: steps.append(True))
    nsys = types.SimpleNamespace(__exit__=lambda *a: exits.append(a))
    for iteration in range(1, 5):
        post_training_step_callbacks(None, None, None, iteration, prof, 0.0, nsys_nvtx_context=nsys)
    assert len(steps) == 4 and len(collected) == 2 and exits == [(None, None, None)]


def test_preprocess_common_state_dict_drops_rank_specific_arguments():
    args = argparse.Namespace(rank=3, local_rank=1, hidden_size=64)
    common = {"args": args, "iteration": 5}
    assert preprocess_common_state_dict(common) == {"args": {"hidden_size": 64}, "iteration": 5}
    assert common["args"] is args and args.rank == 3  # the state to save is left as it is


def test_startup_timestamps_and_print_datetime(monkeypatch):
    monkeypatch.setattr(progress_log, "_TRAIN_START_TIME", progress_log._TRAIN_START_TIME)
    set_startup_timestamps(program_start=1000.0, main_entry=1001.0)
    assert (progress_log._TRAIN_START_TIME, progress_log._MAIN_ENTRY_TIME) == (1000.0, 1001.0)
    out = io.StringIO()
    with redirect_stdout(out):
        print_datetime("after start", override_timestamp=datetime(2026, 1, 2, 3, 4, 5).timestamp())
    assert out.getvalue() == "[after start] datetime: 2026-01-02 03:04:05 \n"


def test_cyclic_iter_and_default_num_samples():
    assert [x for x, _ in zip(cyclic_iter([1, 2]), range(5))] == [1, 2, 1, 2, 1]
    global_vars.set_args(
        types.SimpleNamespace(train_samples=None, train_iters=10, global_batch_size=8, eval_interval=5, eval_iters=2)
    )
    seen = []
    build_train_valid_test_datasets(lambda samples: seen.append(samples) or (None, None, None))
    build_train_valid_test_datasets(lambda samples: seen.append(samples) or (None, None, None), [1, 2, 3])
    assert seen == [(80, 48, 16), [1, 2, 3]]


def _external_iterators():
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    # An external provider's iterables are used as they are: no micro batch size or workers needed in the args.
    args = types.SimpleNamespace(
        train_samples=None, train_iters=1, global_batch_size=1, eval_interval=1, eval_iters=1,
        consumed_train_samples=0, consumed_valid_samples=0, dataloader_type="external",
    )  # fmt: skip
    global_vars.set_args(args)
    train_it, valid_it, test_it = build_train_valid_test_data_iterators(lambda n: ([1], [2], None))
    return next(train_it), next(valid_it), test_it, (args.do_train, args.do_valid, args.do_test)


def test_external_dataloaders_pass_through():
    assert run_distributed(1, _external_iterators) == [(1, 2, None, (True, True, False))]


def test_progress_log_start_time_and_throughput(tmp_path, monkeypatch):
    def line(when, world_size, event):
        return f"{when:%Y-%m-%d %H:%M:%S}\tJob ID: 1\t# GPUs: {world_size}\t{event}\n"

    now = datetime.now().replace(microsecond=0)
    start = now - timedelta(seconds=100)
    (tmp_path / "progress.txt").write_text(
        line(now - timedelta(seconds=500), 8, "Starting job")
        + line(
            now - timedelta(seconds=400),
            8,
            "Saved checkpoint\tIteration: 1\tJob throughput: 1.0 TFLOP/s/GPU\t"
            "Cumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 2.00e+12\tTokens (in billions): 0.00",
        )
        + line(start, 1, "Starting job")
        + line(start + timedelta(seconds=10), 1, "Starting job")
    )
    global_vars.set_args(
        types.SimpleNamespace(save=str(tmp_path), world_size=1, consumed_train_samples=1000, seq_length=1000)
    )
    assert get_start_time_from_progress_log() == (start, 2e12)  # the first start at this world size
    monkeypatch.setattr(progress_log, "_TRAIN_START_TIME", progress_log.time.time() - 50)
    monkeypatch.setattr(progress_log, "_JOB_START_FLOPS", 2e12)
    compute_throughputs_and_append_to_progress_log(9, 2e12 + 1e14)
    fields = (tmp_path / "progress.txt").read_text().splitlines()[-1].split("\t")
    assert fields[3:5] == ["Saved checkpoint", "Iteration: 9"]
    job = float(fields[5].split(": ")[1].split()[0])
    cumulative = float(fields[6].split(": ")[1].split()[0])
    assert job == pytest.approx(2.0, abs=0.15) and cumulative == pytest.approx(1.0, abs=0.1)
    assert fields[7:] == ["Floating-point operations: 1.02e+14", "Tokens (in billions): 0.00"]


# ---- evaluation with non-loss data ------------------------------------------------------------------------------


def _evaluate_with_non_loss_data():
    from functools import partial

    import pretrain_gpt
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import evaluate, evaluate_and_print_results, get_model

    args = validated("--eval-iters", 3)
    global_vars.set_args(args)
    initialize_megatron()
    model = get_model(pretrain_gpt.model_provider)

    def loss_func(loss_mask, output_tensor, non_loss_data=False):
        if non_loss_data:
            return {"tokens seen": output_tensor.numel()}
        return pretrain_gpt.loss_func(loss_mask, output_tensor)

    def forward_step(data_iterator, model):
        output, _ = pretrain_gpt.forward_step(data_iterator, model)
        return output, partial(loss_func, torch.ones(2, 32))

    def batches():
        generator = torch.Generator().manual_seed(0)
        while True:
            tokens = torch.randint(0, 100, (2, 33), generator=generator)
            yield {
                "tokens": tokens[:, :-1],
                "labels": tokens[:, 1:],
                "loss_mask": torch.ones(2, 32),
                "position_ids": torch.arange(32).repeat(2, 1),
            }

    config = model[0].module.config if hasattr(model[0], "module") else model[0].config
    losses, collected, timelimit_hit = evaluate(forward_step, batches(), model, lambda *a: None, config, eval_iters=2)
    args.consumed_valid_samples = 0
    _, from_func, _ = evaluate(forward_step, batches(), model, None, config, non_loss_data_func=lambda m: "direct")
    received = []
    writer = types.SimpleNamespace(add_scalar=lambda *a: None)
    global_vars._GLOBAL_TENSORBOARD_WRITER = writer
    with redirect_stdout(io.StringIO()):
        evaluate_and_print_results(
            "it 1",
            forward_step,
            batches(),
            model,
            1,
            lambda data, iteration, w: received.append((data, iteration, w is writer)),
            config,
        )
    global_vars.unset_global_variables()
    return sorted(losses), collected, timelimit_hit, from_func, received, args.consumed_valid_samples


def test_evaluate_collects_non_loss_data():
    losses, collected, timelimit_hit, from_func, received, consumed = run_distributed(1, _evaluate_with_non_loss_data)[
        0
    ]
    assert losses == ["lm loss"] and not timelimit_hit
    assert collected == [{"tokens seen": 2 * 32}]  # one micro-batch of [b=2, s=32] per-token losses
    assert from_func == "direct"
    assert received == [([{"tokens seen": 64}], 1, True)]
    assert consumed == 2 * (3 + 3)  # the default --eval-iters 3, twice (samples of global batch 2)


def _get_model_hands_on_config_and_groups():
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.training import get_model

    global_vars.set_args(validated())
    parallel_state.initialize_model_parallel()
    groups = ProcessGroupCollection.use_mpu_process_groups()
    seen = []

    def provider(pre_process, post_process, **kwargs):
        seen.append((pre_process, post_process, sorted(kwargs)))
        return torch.nn.Linear(2, 2)

    get_model(provider, wrap_with_ddp=False)
    get_model(provider, wrap_with_ddp=False, config="the config", pg_collection=groups)
    global_vars.unset_global_variables()
    return seen


def test_get_model_hands_config_and_pg_collection_to_the_provider():
    assert run_distributed(1, _get_model_hands_on_config_and_groups)[0] == [
        (True, True, []),
        (True, True, ["config", "pg_collection"]),
    ]


def _training_log_line():
    from megatron.core import parallel_state
    from megatron.training.training import training_log

    global_vars.set_global_variables(validated("--log-interval", 5, "--log-params-norm"))
    parallel_state.initialize_model_parallel()
    out = io.StringIO()
    with redirect_stdout(out):
        global_vars.get_timers()("interval-time", log_level=0).start()
        loss = {"lm loss": torch.tensor(2.5)}
        # Not a log iteration: only accumulated; the first iteration prints anyway when asked to.
        flag = training_log(loss, {}, 1e-3, 3, 1.0, True, 0, 1.5, None, None, None)
        quiet = out.getvalue()
        flag = training_log(loss, {}, 1e-3, 3, 1.0, flag, 0, 1.5, 12.25, None, 7.5, is_first_iteration=True)
    global_vars.unset_global_variables()
    return quiet, out.getvalue(), flag


def test_training_log_prints_params_norm_and_max_attention_logit():
    quiet, printed, flag = run_distributed(1, _training_log_line)[0]
    assert quiet == "" and flag is False
    assert " params norm: 12.250 |" in printed and " max attention logit: 7.500 |" in printed
    assert " lm loss: 2.500000E+00 |" in printed and "(after iteration 3) memory (MB)" in printed


def _rng_state_per_data_parallel_rank():
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training.checkpointing import get_rng_state

    args = validated(world_size=2)
    args.data_parallel_random_init = True
    global_vars.set_args(args)
    parallel_state.initialize_model_parallel()
    torch.manual_seed(100 + dist.get_rank())
    tp, pp = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_pipeline_model_parallel_group()
    sharded = get_rng_state("torch_dist", tp, pp, key_prefix="x.")
    plain = get_rng_state("torch", tp, pp)
    global_vars.unset_global_variables()
    seeds = [torch.Generator().set_state(state["torch_rng_state"]).initial_seed() for state in sharded.data]
    return sharded.key, sharded.replica_id, seeds, len(plain)


def test_rng_state_holds_every_data_parallel_ranks_state_with_data_parallel_random_init():
    assert run_distributed(2, _rng_state_per_data_parallel_rank) == [
        ("x.rng_state", 0, [100, 101], 2),
        ("x.rng_state", 1, [100, 101], 2),
    ]

"""Megatron FSDP through the real entry point: --use-megatron-fsdp trains like one process (with interleaved
pipeline parallelism and overlapped communication), and its torch_dist checkpoint resumes under the plain
distributed optimizer at another layout, and the reverse, on the single-process curve."""

from megatron.training.dcp_checkpointing import stored_keys
from tests.functional_tests.configs import EQUIVALENCE_FLAGS, EQUIVALENCE_ITERS, EQUIVALENCE_REFERENCE_ITERS, with_flag
from tests.functional_tests.harness import assert_curves_close, run_pretrain
from tests.functional_tests.test_layout_equivalence import LOSS_REL_TOL, assert_trains_like_reference

FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--data-parallel-sharding-strategy"]


def _planned_flags():
    return with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_REFERENCE_ITERS))


def _resume(checkpoint_dir, layout_flags, nproc, cpu_data_flags):
    flags = _planned_flags() + layout_flags + cpu_data_flags + ["--load", checkpoint_dir]
    return run_pretrain(flags, nproc)


def _assert_continues_reference(resumed, reference, what):
    assert "successfully loaded" in resumed.output, resumed.describe()
    expected = {i: v for i, v in reference.curve().items() if i > EQUIVALENCE_ITERS}
    assert min(resumed.curve()) == EQUIVALENCE_ITERS + 1
    assert_curves_close(resumed.curve(), expected, LOSS_REL_TOL, f"{what}\n{resumed.describe()}")


def test_fsdp_with_pipeline_parallelism_trains_like_one_process_and_resumes_under_ddp(
    equivalence_reference, cpu_data_flags, tmp_path
):
    # optim_grads_params exercises everything optim_grads does (and the parameter gathers); the unit tests cover
    # each strategy.
    strategy = "optim_grads_params"
    save_dir = tmp_path / "fsdp"
    layout = FSDP + [strategy, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    layout += ["--overlap-grad-reduce", "--overlap-param-gather"]
    flags = _planned_flags() + layout + cpu_data_flags
    flags += [
        "--exit-interval",
        "10",
        "--save",
        save_dir,
        "--save-interval",
        "10",
        "--dist-ckpt-optim-fully-reshardable",
    ]
    saved = run_pretrain(flags, 4)
    assert_trains_like_reference(saved, equivalence_reference, f"FSDP {strategy} PP2 x VPP2 x DP2, overlapped")
    resumed = _resume(save_dir, ["--use-distributed-optimizer"], 4, cpu_data_flags)
    _assert_continues_reference(resumed, equivalence_reference, f"FSDP {strategy} PP2 x VPP2 x DP2 -> distopt DP4")


def test_ddp_checkpoint_resumes_under_fsdp_at_another_layout(tp2_pp2_run, equivalence_reference, cpu_data_flags):
    resumed = _resume(tp2_pp2_run.checkpoint_dir, FSDP + ["optim_grads_params"], 2, cpu_data_flags)
    _assert_continues_reference(resumed, equivalence_reference, "distopt TP2 x PP2 -> FSDP optim_grads_params DP2")


def test_fsdp_dtensor_checkpoint_resumes_at_another_tensor_and_data_parallel_size(
    equivalence_reference, cpu_data_flags, tmp_path
):
    # Saved by TP2 x DP2 under ZeRO-3 in Megatron-LM's fsdp_dtensor format; resumed by DP4 under ZeRO-2, which
    # finds the format by itself: the same losses as the single-process run that never stopped.
    layout = FSDP + ["optim_grads_params", "--tensor-model-parallel-size", "2", "--ckpt-format", "fsdp_dtensor"]
    flags = _planned_flags() + layout + cpu_data_flags
    saved = run_pretrain(flags + ["--exit-interval", "10", "--save", tmp_path, "--save-interval", "10"], 4)
    assert_trains_like_reference(saved, equivalence_reference, "FSDP optim_grads_params TP2 x DP2, fsdp_dtensor")
    keys = stored_keys(str(tmp_path / "iter_0000010"))
    # Megatron-LM's names: the wrapper's module. before the model's names, the optimizer's by parameter name.
    assert "model.module.decoder.layers.3.self_attention.linear_qkv.weight" in keys
    assert "optimizer.state.module.module.decoder.layers.0.mlp.linear_fc2.weight.exp_avg" in keys
    assert "optimizer.param_to_group_meta.module.module.embedding.word_embeddings.weight.lr" in keys
    assert "rng_state.(0, 1).0.torch_rng_state" in keys and "iteration" in keys
    resumed = _resume(tmp_path, FSDP + ["optim_grads"], 4, cpu_data_flags)
    _assert_continues_reference(resumed, equivalence_reference, "fsdp_dtensor TP2 x DP2 -> FSDP optim_grads DP4")


def test_fsdp_with_context_parallelism_trains_like_one_process(equivalence_reference, cpu_data_flags):
    # Context-parallel ranks hold different tokens of the same samples, so FSDP shards and reduces over the
    # data x context-parallel group, as the distributed optimizer does.
    layout = FSDP + ["optim_grads_params", "--context-parallel-size", "2"]
    flags = with_flag(EQUIVALENCE_FLAGS, "--train-iters", str(EQUIVALENCE_ITERS)) + layout + cpu_data_flags
    assert_trains_like_reference(run_pretrain(flags, 4), equivalence_reference, "FSDP optim_grads_params CP2 x DP2")

"""pretrain_hybrid.py end to end: a tiny Mamba-2 hybrid ("M*-M-") on 2 CPU ranks at TP2 with sequence parallelism
and the distributed optimizer reproduces its golden curves; resuming from its iteration-6 checkpoint reproduces
iterations 7-12 exactly; PP2 (the pattern split by '|') x DP2 with the distributed optimizer trains the same model
(no dropout and layout-independent initialisation, so the layouts must agree).

Regenerate the record after an intended change of the numbers with

    MEGATRON_REGENERATE_GOLDEN_VALUES=1 python -m pytest tests/functional_tests/test_hybrid.py

and review the JSON diff. Tolerances are those of test_golden_values (one thread per rank: bit-reproducible).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.functional_tests.harness import REPO_ROOT, assert_curves_close, run_pretrain
from tests.functional_tests.test_golden_values import GRAD_NORM_ABS_TOL, LOSS_REL_TOL, LR_REL_TOL, REGENERATE_ENV

ENTRY_POINT = REPO_ROOT / "pretrain_hybrid.py"
GOLDEN_FILE = Path(__file__).parent / "golden_values" / "hybrid_tiny_tp2.json"
ITERATIONS = 12
HYBRID_FLAGS = [
    "--hybrid-layer-pattern",
    "M*-M-",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--mamba-state-dim",
    "8",
    "--mamba-head-dim",
    "16",
    "--mamba-num-groups",
    "2",
    "--squared-relu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
    "--position-embedding-type",
    "none",
    "--seq-length",
    "64",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--use-cpu-initialization",
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    str(ITERATIONS),
    "--lr",
    "2e-3",
    "--min-lr",
    "2e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--lr-decay-iters",
    str(ITERATIONS),
    "--weight-decay",
    "0.01",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
]
CURVES = ("lm loss", "learning rate", "grad norm")


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory, cpu_data_flags):
    save_dir = tmp_path_factory.mktemp("hybrid_checkpoints")
    result = run_pretrain(
        HYBRID_FLAGS + cpu_data_flags + ["--save", save_dir, "--save-interval", "6"], nproc=2, entry_point=ENTRY_POINT
    )
    return result, save_dir


def _observed(result) -> dict:
    return {
        "description": "5-layer Mamba-2 hybrid M*-M- (hidden 64, GQA, squared ReLU) on the built-in corpus; 2 ranks "
        "TP2 + SP + distributed optimizer, no dropout, fp32, OMP_NUM_THREADS=1",
        "regenerate": f"{REGENERATE_ENV}=1 python -m pytest tests/functional_tests/test_hybrid.py",
        "torch_version": torch.__version__,
        "flags": " ".join(HYBRID_FLAGS),
        **{key: {str(i): v for i, v in result.curve(key).items()} for key in CURVES},
    }


def _as_curve(values: dict) -> dict:
    return {int(i): v for i, v in values.items()}


def test_hybrid_model_trains_and_reproduces_its_golden_values(hybrid_run):
    result, _ = hybrid_run
    observed = _observed(result)
    losses = result.curve()
    assert len(losses) == ITERATIONS and losses[ITERATIONS] < losses[1] - 0.3  # it learns
    if os.environ.get(REGENERATE_ENV) == "1":
        GOLDEN_FILE.write_text(json.dumps(observed, indent=2) + "\n")
        pytest.skip(f"regenerated {GOLDEN_FILE}; review its diff and commit it")
    golden = json.loads(GOLDEN_FILE.read_text())
    assert golden["flags"] == observed["flags"], f"the flags changed; regenerate with {golden['regenerate']}"
    what = f"hybrid run vs {GOLDEN_FILE.name}\n{result.describe()}"
    assert_curves_close(_as_curve(observed["lm loss"]), _as_curve(golden["lm loss"]), LOSS_REL_TOL, what)
    assert_curves_close(_as_curve(observed["learning rate"]), _as_curve(golden["learning rate"]), LR_REL_TOL, what)
    for iteration, expected in _as_curve(golden["grad norm"]).items():
        actual = _as_curve(observed["grad norm"])[iteration]
        assert abs(actual - expected) <= GRAD_NORM_ABS_TOL, f"grad norm, iteration {iteration}: {actual} vs {expected}"


def test_hybrid_resume_reproduces_the_uninterrupted_run(hybrid_run, cpu_data_flags):
    result, save_dir = hybrid_run
    resumed = run_pretrain(
        HYBRID_FLAGS + cpu_data_flags + ["--load", save_dir, "--ckpt-step", "6"], nproc=2, entry_point=ENTRY_POINT
    )
    assert "successfully loaded checkpoint" in resumed.output
    assert min(resumed.curve()) == 7
    for key in CURVES:
        expected = {i: v for i, v in result.curve(key).items() if i > 6}
        assert resumed.curve(key) == expected, f"{key}\n{resumed.describe()}"


def test_checkpoint_args_carry_the_hybrid_shape(hybrid_run):
    """--use-checkpoint-args takes the pattern and the Mamba sizes from the checkpoint."""
    from megatron.training.arguments import parse_args_list
    from megatron.training.checkpointing import load_args_from_checkpoint
    from pretrain_hybrid import hybrid_model_flags

    _, save_dir = hybrid_run
    args = parse_args_list(["--load", str(save_dir), "--use-checkpoint-args"], extra_args_provider=hybrid_model_flags)
    load_args_from_checkpoint(args)
    assert (
        args.hybrid_layer_pattern,
        args.num_layers,
        args.mamba_state_dim,
        args.mamba_head_dim,
        args.mamba_num_groups,
        args.is_hybrid_model,
    ) == ("M*-M-", 5, 8, 16, 2, True)


def test_checkpoint_args_take_the_layout_only_when_asked(hybrid_run):
    """The saved TP size replaces the command line's only with --use-mp-args-from-checkpoint-args (Megatron-LM's
    rule); otherwise the command line's layout holds and the checkpoint reshards on load."""
    from megatron.training.arguments import parse_args_list
    from megatron.training.checkpointing import load_args_from_checkpoint
    from pretrain_hybrid import hybrid_model_flags

    _, save_dir = hybrid_run
    sizes = {}
    for extra in ([], ["--use-mp-args-from-checkpoint-args"]):
        args = parse_args_list(
            ["--load", str(save_dir), "--use-checkpoint-args", *extra], extra_args_provider=hybrid_model_flags
        )
        sizes[bool(extra)] = load_args_from_checkpoint(args).tensor_model_parallel_size
    assert sizes == {False: 1, True: 2}


def test_hybrid_pipeline_and_data_parallel_train_like_tensor_parallel(hybrid_run, cpu_data_flags):
    """PP2 (3 + 2 layers by the pattern's '|') x DP2 with the distributed optimizer follows the TP2 + SP run's
    curve: both are the single-process model (the unit tests compare each layout with one process)."""
    from tests.functional_tests.configs import with_flag
    from tests.functional_tests.test_layout_equivalence import LOSS_REL_TOL as LAYOUT_REL_TOL

    result, _ = hybrid_run
    flags = [flag for flag in HYBRID_FLAGS if flag != "--sequence-parallel"]
    for name, value in (
        ("--tensor-model-parallel-size", "1"),
        ("--hybrid-layer-pattern", "M*-|M-"),
        ("--train-iters", "6"),
        ("--lr-decay-iters", str(ITERATIONS)),
    ):
        flags = with_flag(flags, name, value)
    parallel = run_pretrain(
        flags + ["--pipeline-model-parallel-size", "2"] + cpu_data_flags, nproc=4, entry_point=ENTRY_POINT
    )
    expected = {i: v for i, v in result.curve().items() if i <= 6}
    assert_curves_close(parallel.curve(), expected, LAYOUT_REL_TOL, f"PP2 x DP2\n{parallel.describe()}")


def test_generate_from_a_hybrid_checkpoint_at_tp1_and_tp2(hybrid_run):
    """examples/inference/generate_from_checkpoint.py builds a HybridModel from --hybrid-layer-pattern and generates
    from the TP2 checkpoint at TP1 and at TP2 (resharded on load; the Mamba states split by heads at TP2): the same
    greedy tokens and log-probs."""
    from megatron.training import builtin_data

    _, save_dir = hybrid_run
    model_flags = HYBRID_FLAGS[: HYBRID_FLAGS.index("--tensor-model-parallel-size")]
    script = REPO_ROOT / "examples" / "inference" / "generate_from_checkpoint.py"
    outputs = []
    for nproc in (1, 2):
        flags = model_flags + [
            "--tensor-model-parallel-size",
            str(nproc),
            "--distributed-backend",
            "gloo",
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            builtin_data.vocab_file(),
            "--merge-file",
            builtin_data.merge_file(),
            "--load",
            str(save_dir),
            "--prompts",
            "ROMEO:",
            "First Citizen: Before we proceed any further,",
            "--num-tokens-to-generate",
            "6",
            "--top_k",
            "1",
            "--return-log-probs",
        ]
        result = run_pretrain(flags, nproc, entry_point=script)
        lines = [json.loads(line) for line in result.output.splitlines() if line.startswith('{"prompt"')]
        assert len(lines) == 2, result.describe()
        outputs.append(lines)
    for expected, actual in zip(*outputs):
        assert len(expected["generated_tokens"]) == 6
        assert actual["generated_tokens"] == expected["generated_tokens"]
        assert actual["generated_log_probs"] == pytest.approx(expected["generated_log_probs"], abs=1e-4)


def test_text_generation_server_serves_a_hybrid_checkpoint(hybrid_run, cpu_data_flags):
    """tools/run_text_generation_server.py at TP2 over the hybrid checkpoint: a greedy completion through the openai
    client gives generate_from_checkpoint.py's text at TP1 (the same model, engine and tokenizer)."""
    from tests.functional_tests.test_text_generation_server import _Server

    _, save_dir = hybrid_run
    model_flags = HYBRID_FLAGS[: HYBRID_FLAGS.index("--tensor-model-parallel-size")]
    generated = run_pretrain(
        model_flags
        + cpu_data_flags[: cpu_data_flags.index("--data-path")]
        + cpu_data_flags[cpu_data_flags.index("--tokenizer-type") :][:6]
        + ["--load", str(save_dir), "--prompts", "ROMEO:", "--num-tokens-to-generate", "6", "--top_k", "1"],
        1,
        entry_point=REPO_ROOT / "examples" / "inference" / "generate_from_checkpoint.py",
    )
    expected = [json.loads(line) for line in generated.output.splitlines() if line.startswith('{"prompt"')]
    assert len(expected) == 1 and expected[0]["generated_tokens"], generated.describe()
    server = _Server(
        str(save_dir), cpu_data_flags, nproc=2, model_flags=model_flags, extra=["--tensor-model-parallel-size", "2"]
    )
    try:
        model = server.client.models.list().data[0].id
        choice = server.client.completions.create(model=model, prompt="ROMEO:", max_tokens=6, temperature=0).choices[0]
    finally:
        server.stop()
    assert choice.text == expected[0]["generated_text"]

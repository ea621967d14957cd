"""tools/run_megatron_example.py without starting a job: the launch captured from a bash script, the overrides (and
only those) applied to its flags, the GPU-only list matching what validate_args refuses, and its error messages."""

import sys
import warnings
from pathlib import Path

import pytest

from megatron.training.arguments import parse_args_list, validate_args
from tests.functional_tests.harness import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
import run_megatron_example as example  # noqa: E402

SCRIPTS = REPO_ROOT / "tests" / "functional_tests" / "megatron_style_scripts"
BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32".split()
BASE += (
    "--micro-batch-size 1 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128".split()
)


def _capture(tmp_path, script, *args):
    return example.capture_launch(SCRIPTS / script, args, tmp_path, {"PATH": "/usr/bin:/bin"})


def test_capture_evaluates_arrays_conditionals_and_quoted_entries(tmp_path):
    launch = _capture(tmp_path, "train_moe_fp8_mock.sh")
    assert launch.entry_point == "pretrain_gpt.py"
    assert launch.launcher[:4] == ["--nproc_per_node", "8", "--nnodes", "4"]
    flags = dict(example.split_flags(launch.arguments))
    assert flags["--fp8-format"] == ["hybrid"]  # from the `if [[ $DTYPE == fp8 ]]` block
    assert flags["--split"] == ["'99,1,0'"]  # the quotes stay, as bash passes them
    assert flags["--moe-layer-freq"] == ["[0]*2+[1]*22"]


def test_capture_follows_a_relative_entry_point_and_exported_variables(tmp_path):
    launch = _capture(tmp_path, "train_hybrid_mamba.sh", "data", "tok")
    assert launch.entry_point == "pretrain_hybrid.py" and launch.launcher == ["--nproc_per_node", "8"]
    assert launch.environment == {"NCCL_IB_SL": "1", "TRITON_CACHE_DIR": "./triton-cache/"}
    assert dict(example.split_flags(launch.arguments))["--spec"] == [
        "megatron.core.models.hybrid.hybrid_layer_specs",
        "hybrid_stack_spec",
    ]


def test_overrides_change_only_sizes_layout_batch_data_and_gpu_only_flags(tmp_path):
    launch = _capture(tmp_path, "train_moe_fp8_mock.sh")
    run = example.fit_to_cpu(launch.arguments, iterations=3)
    before, after = dict(example.split_flags(launch.arguments)), dict(example.split_flags(run.arguments))
    changed = {flag for flag in before.keys() | after.keys() if before.get(flag) != after.get(flag)}
    assert changed == {
        *[flag for flag in example.TINY_SIZES if flag in before],
        "--moe-layer-freq",
        "--pipeline-model-parallel-size",
        "--expert-model-parallel-size",
        "--global-batch-size",
        "--train-samples",
        "--log-interval",
        "--eval-iters",
        *example.GPU_ONLY_FLAGS,
    }
    assert after["--moe-layer-freq"] == ["[0,0,1,1]"] and after["--num-layers"] == ["4"]
    # PP2 and EP2 need two data-parallel ranks per stage for the experts: 4 ranks.
    assert (run.world_size, after["--global-batch-size"], after["--train-samples"]) == (4, ["4"], ["12"])
    assert len(run.changes) == len(changed)


def test_data_and_a_missing_tokenizer_become_mock_data_and_null_tokenizer(tmp_path):
    launch = _capture(tmp_path, "train_hybrid_mamba.sh", "corpus_text_document", "missing.model")
    after = dict(example.split_flags(example.fit_to_cpu(launch.arguments, 3).arguments))
    assert "--data-path" not in after and "--tokenizer-model" not in after and after["--mock-data"] == []
    assert after["--tokenizer-type"] == ["NullTokenizer"] and after["--vocab-size"] == ["1024"]


@pytest.mark.parametrize("flag, refused", example.GPU_ONLY_FLAGS.items())
def test_every_gpu_only_flag_is_one_this_project_refuses(flag, refused, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    extra = [flag, (refused or ["hybridep"])[0], "--num-experts", "4"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ValueError, match=rf"not supported yet: .*\({flag}"):
            validate_args(parse_args_list(BASE + extra))


def test_a_script_that_launches_nothing_is_reported_with_its_output(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text('echo "usage: bad.sh DATA" >&2; exit 3\n')
    with pytest.raises(RuntimeError, match=r"exited with status 3 without launching an entry point[\s\S]*usage"):
        example.capture_launch(script, [], tmp_path / "work", {"PATH": "/usr/bin:/bin"})


def test_an_entry_point_this_repository_lacks_is_named(tmp_path):
    script = tmp_path / "bert.sh"
    script.write_text("torchrun --nproc_per_node 8 pretrain_bert.py --num-layers 24\n")
    with pytest.raises(RuntimeError, match="launches pretrain_bert.py, which this repository does not have"):
        example.run_example(script, [], workdir=tmp_path / "work")


def test_flag_values_before_any_flag_are_refused():
    with pytest.raises(ValueError, match="argument 'stray' comes before any --flag"):
        example.split_flags(["stray", "--num-layers", "2"])


def test_script_arguments_follow_the_double_dash(monkeypatch):
    seen = {}

    def fake_run(script, script_args, *rest):
        seen.update(script=script, script_args=script_args)
        raise SystemExit(0)

    monkeypatch.setattr(example, "run_example", fake_run)
    with pytest.raises(SystemExit):
        example.main(["x.sh", "--iterations", "2", "--", "--checkpoint-path", "ck"])
    assert seen == {"script": Path("x.sh"), "script_args": ["--checkpoint-path", "ck"]}

"""Run Megatron-LM's own unit tests (tag core_v0.19.0) on a CPU, against Megatron-Core and against this project.

What it does:

1. extracts ``tests/unit_tests`` of Megatron-LM at ``core_v0.19.0`` (``git archive`` from ``--mirror``, else a copy
   of ``--megatron-path``/tests) into ``--work``/tree;
2. copies ``shims/`` over it: our ``conftest.py`` (CUDA devices mapped to the CPU, one JSON line per result, a per
   test time limit, Megatron's fixtures and a ``mocker``), our ``test_utilities.py`` (Megatron's ``Utils`` on one
   gloo process) and ``cpu_harness.py``. Megatron's test files themselves are run unchanged;
3. runs each group of test files twice with that same tree, one pytest process per group and side, sequentially:
   once against Megatron-Core (``--megatron-python`` with PYTHONPATH=<tree>:<megatron-path>) and once against this
   project (this interpreter with PYTHONPATH=<tree>:<this checkout>), each under ``timeout`` (a group cut off or
   crashed is resumed past the tests it finished);
4. writes ``--work``/report.md: per file, the tests passed on Megatron-Core, passed here, passed on both and passed
   only on Megatron-Core, then each "only Megatron-Core" test id with the first line of its error here.

Everything runs in one process per side (world size 1). Tests that ask for more ranks or a parallel layout needing
more ranks are skipped by the shim on both sides; ``torch.cuda.is_available()`` stays False, so GPU-only tests skip
on both sides too. Directories left out (SKIPPED_DIRS, SKIPPED_FILES) are features this project does not build.

Usage (Megatron-Core 0.19 needs a virtual environment of its own, as in
tools/checkpoint/make_megatron_optimizer_fixtures.py)::

    python tools/megatron_unit_tests/run.py                       # every group, both sides, then the report
    python tools/megatron_unit_tests/run.py --groups optimizer    # some groups
    python tools/megatron_unit_tests/run.py --report-only         # the report from the results already there
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent
TAG = "core_v0.19.0"
SIDES = ("megatron", "ours")

# Group name -> test paths under tests/unit_tests (directories are walked by pytest).
GROUPS = {
    "top": [
        "test_basic.py",
        "test_imports.py",
        "test_model_parallel_config.py",
        "test_num_microbatches_calculator.py",
        "test_optimizer_param_scheduler.py",
        "test_parallel_state.py",
        "test_process_groups_config.py",
        "test_hyper_comm_grid.py",
        "test_utils.py",
        "test_argument_utils.py",
        "test_num_floating_point_operations.py",
        "test_training.py",
        "test_checkpointing.py",
        "test_optimizer.py",
        "test_fp8_utils.py",
        "test_start_eval_at_iter.py",
        "test_eval_batch_size.py",
        "test_local_multi_tensor_fns.py",
        "test_typed_torch.py",
        "test_wrap_model_chunks_with_ddp.py",
        "test_model_configs.py",
        "test_activation_logging.py",
        "test_lion_optimizer.py",
        "test_emerging_optimizers.py",
        "test_layer_wise_optimizer.py",
    ],
    "tensor_parallel": ["tensor_parallel"],
    "transformer": ["transformer"],
    "models": ["models"],
    "dist_checkpointing": ["dist_checkpointing"],
    "distributed": ["distributed"],
    "optimizer": ["optimizer"],
    "pipeline_parallel": ["pipeline_parallel"],
    "data": ["data"],
    "training": ["training"],
    "tokenizers": ["tokenizers"],
    "utils": ["utils"],
}

# Left out, with why: features this project does not build, or tests that need hardware or packages absent here.
SKIPPED_DIRS = {
    "a2a_overlap": "all-to-all overlap of MoE with Transformer Engine on CUDA streams",
    "determinism": "bit-exact GPU kernels",
    "elastification": "elastic model variants (not built)",
    "export": "TensorRT-LLM export",
    "extension": "Transformer Engine / NVIDIA Kitchen extensions",
    "fusions": "fused CUDA/Triton/TE kernels",
    "generalized_tensor_parallel": "generalized tensor parallelism (not built)",
    "inference": "inference engines and GPU kernels (CUDA graphs, dynamic batching)",
    "post_training": "ModelOpt quantization/distillation",
    "resharding": "live weight resharding between jobs (not built)",
    "rl": "reinforcement learning loop (not built)",
    "ssm": "Mamba kernels (mamba_ssm, causal_conv1d)",
    "tools": "Megatron's checkpoint converter scripts (tools/checkpoint), run as subprocesses on GPUs",
    "distributed/mfsdp_v1": "Megatron-FSDP (not built)",
    "distributed/mfsdp_v2": "Megatron-FSDP (not built)",
    "models/mimo": "MIMO multimodal models (not built)",
    "transformer/experimental_attention_variant": "DeepSeek sparse attention kernels (tilelang)",
}
SKIPPED_FILES = {
    "distributed/test_torch_fully_sharded_parallel.py": "torch FSDP2 path (not built)",
    "transformer/test_cuda_graphs.py": "CUDA graphs",
    "transformer/test_full_cuda_graph.py": "CUDA graphs",
    "transformer/test_vision_cuda_graphs.py": "CUDA graphs",
    "transformer/test_fsdp_dtensor_checkpoint.py": "Megatron-FSDP DTensor checkpoints (not built)",
    "transformer/test_te_fused_mlp_with_grouped_linear_spec.py": "Transformer Engine",
    "transformer/test_te_layers_batch_invariant.py": "Transformer Engine",
    "transformer/test_transformer_engine_grouped_linear.py": "Transformer Engine",
    "models/test_audio_modules.py": "audio models (not built)",
    "models/test_clip_vit_model.py": "vision models (not built)",
    "models/test_fastconformer_model.py": "audio models (not built)",
    "models/test_llava_model.py": "multimodal models (not built)",
    "models/test_llava_sound.py": "multimodal models (not built)",
    "models/test_multimodal_context_parallel.py": "multimodal models (not built)",
    "models/test_multimodal_projector.py": "multimodal models (not built)",
    "models/test_nemo_audio_preprocessor.py": "audio models (not built)",
    "models/test_nemo_audio_processor.py": "audio models (not built)",
    "models/test_nemo_transformer_audio.py": "audio models (not built)",
    "models/test_radio_model.py": "vision models (not built)",
    "models/test_gpt_model_quantization.py": "ModelOpt quantization",
    "data/test_multimodal_dataset.py": "multimodal data (not built)",
    "data/test_preprocess_mmdata.py": "multimodal data (not built)",
    "dist_checkpointing/test_msc.py": "Multi-Storage Client (not installed)",
    "dist_checkpointing/test_fp8.py": "FP8 tensors (Transformer Engine)",
    "training/test_setup_model_and_optimizer_mimo.py": "MIMO multimodal models (not built)",
}


def extract(tree: Path, mirror: Path, megatron_path: Path) -> None:
    """A fresh copy of Megatron's tests/ at TAG, with our shims over it."""
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    if (mirror / "HEAD").exists():
        archive = subprocess.run(
            ["git", "--git-dir", str(mirror), "archive", "--format=tar", TAG, "tests/__init__.py", "tests/unit_tests"],
            check=True,
            capture_output=True,
        ).stdout
        with tempfile.TemporaryFile() as tar:
            tar.write(archive)
            tar.seek(0)
            tarfile.open(fileobj=tar).extractall(tree, filter="data")
    elif (megatron_path / "tests" / "unit_tests").is_dir():
        shutil.copytree(megatron_path / "tests" / "unit_tests", tree / "tests" / "unit_tests")
        (tree / "tests" / "__init__.py").touch()
    else:
        sys.exit(f"no Megatron-LM tests: neither {mirror} (git mirror) nor {megatron_path}/tests exists; pass --mirror")
    for shim in (HERE / "shims").glob("*.py"):
        shutil.copy(shim, tree / "tests" / "unit_tests" / shim.name)


def _pytest_args(group: str) -> list:
    unit = "tests/unit_tests"
    args = [f"{unit}/{path}" for path in GROUPS[group]]
    for skipped in [*SKIPPED_DIRS, *SKIPPED_FILES]:
        if any(skipped.startswith(path + "/") for path in GROUPS[group]):
            args.append(f"--ignore={unit}/{skipped}")
    return args


def _finished(results: Path) -> tuple:
    """Node ids with an outcome, and the one started last without one (the test a kill or crash cut off)."""
    done, last_started = set(), None
    if results.exists():
        for line in results.read_text().splitlines():
            record = json.loads(line)
            if record["outcome"] == "started":
                last_started = record["nodeid"]
            else:
                done.add(record["nodeid"])
    return done, (last_started if last_started not in done else None)


def run_group(tree: Path, group: str, side: str, python: str, package_root: Path, results_dir: Path, limit: int):
    results = results_dir / side / f"{group}.jsonl"
    results.parent.mkdir(parents=True, exist_ok=True)
    results.unlink(missing_ok=True)
    results.with_suffix(".log").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{tree}:{package_root}", "MLM_UT_RESULTS": str(results)}
    env.pop("WORLD_SIZE", None)
    env.pop("LOCAL_RANK", None)
    base = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors", "-rN"]
    for attempt in range(4):
        done, cut_off = _finished(results)
        if cut_off is not None:
            with open(results, "a") as out:
                out.write(json.dumps({"nodeid": cut_off, "outcome": "failed", "error": "killed (time or crash)"}))
                out.write("\n")
            done.add(cut_off)
        deselect = [f"--deselect={nodeid}" for nodeid in sorted(done)] if attempt else []
        command = ["timeout", str(limit), *base, *_pytest_args(group), *deselect]
        with open(results.with_suffix(".log"), "a") as log:
            code = subprocess.run(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"  {side:8s} {group}: exit {code}", flush=True)
        if code == 4:  # a conftest of the group failed to import: nothing ran, say why for each path
            _record_group_error(results, group)
        if code in (0, 1, 2, 3, 4, 5):  # the run finished (passed, failed, interrupted, internal or usage error)
            return
    print(f"  {side:8s} {group}: gave up after {attempt + 1} tries", flush=True)


def _record_group_error(results: Path, group: str) -> None:
    log = results.with_suffix(".log").read_text().splitlines()
    marked = [line[1:].strip() for line in log if line.startswith("E ")]
    with open(results, "a") as out:
        for path in GROUPS[group]:
            error = marked[-1] if marked else "pytest exited with a usage error"
            out.write(json.dumps({"nodeid": f"tests/unit_tests/{path}", "outcome": "collect-error", "error": error}))
            out.write("\n")


def load(results_dir: Path, side: str) -> dict:
    """nodeid -> (outcome, first error line), over all groups of one side."""
    outcomes = {}
    for path in sorted((results_dir / side).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["outcome"] != "started":
                outcomes[record["nodeid"]] = (record["outcome"], record.get("error", ""))
    return outcomes


def _file_of(nodeid: str) -> str:
    return nodeid.split("::")[0].removeprefix("tests/unit_tests/")


def _collect_error(collect_errors: dict, nodeid: str) -> str:
    """The import error of the file or directory a test that did not run belongs to."""
    path = nodeid.split("::")[0]
    owners = [owner for owner in collect_errors if path == owner or path.startswith(owner + "/")]
    return collect_errors[max(owners, key=len)] if owners else ""


def report(results_dir: Path) -> str:
    megatron, ours = load(results_dir, "megatron"), load(results_dir, "ours")
    passed = {side: {n for n, (o, _) in res.items() if o == "passed"} for side, res in (("m", megatron), ("o", ours))}
    collect_errors_here = {n: e for n, (o, e) in ours.items() if o == "collect-error"}
    files = sorted({_file_of(n) for n in passed["m"] | passed["o"]})
    rows = ["| file | passed on Megatron-Core | passed here | both | only Megatron-Core |", "|---|--:|--:|--:|--:|"]
    totals = [0, 0, 0, 0]
    only_megatron = []
    for name in files:
        on_m = {n for n in passed["m"] if _file_of(n) == name}
        here = {n for n in passed["o"] if _file_of(n) == name}
        counts = [len(on_m), len(here), len(on_m & here), len(on_m - here)]
        totals = [a + b for a, b in zip(totals, counts)]
        rows.append(f"| {name} | " + " | ".join(map(str, counts)) + " |")
        for nodeid in sorted(on_m - here):
            outcome, error = ours.get(nodeid, ("not run", _collect_error(collect_errors_here, nodeid)))
            only_megatron.append(f"- `{nodeid}`: {outcome}: {error}")
    rows.append("| **total** | " + " | ".join(f"**{n}**" for n in totals) + " |")
    return "\n".join(rows) + "\n\nOnly on Megatron-Core (why it fails here):\n\n" + "\n".join(only_megatron) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/mlm_unit_tests"), help="scratch folder")
    parser.add_argument("--mirror", type=Path, default=Path("/work/.mirror/NVIDIA+Megatron-LM/repo"))
    parser.add_argument("--megatron-path", type=Path, default=Path("/tmp/mlm"), help="Megatron-LM checkout")
    parser.add_argument("--megatron-python", default="/tmp/mvenv/bin/python")
    parser.add_argument("--groups", nargs="+", choices=sorted(GROUPS), default=list(GROUPS))
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per group and side")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    tree, results_dir = args.work / "tree", args.work / "results"
    if not args.report_only:
        extract(tree, args.mirror, args.megatron_path)
        pythons = {"megatron": (args.megatron_python, args.megatron_path), "ours": (sys.executable, CHECKOUT)}
        for group in args.groups:
            for side in args.sides:
                python, package_root = pythons[side]
                run_group(tree, group, side, python, package_root, results_dir, args.timeout)
    text = report(results_dir)
    (args.work / "report.md").write_text(text)
    print(text.split("\n\nOnly on")[0])


if __name__ == "__main__":
    main()

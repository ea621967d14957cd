"""No checkpoint file is unpickled without the allow-list of megatron.core.safe_globals.

What a real training checkpoint holds (arguments, paths, NumPy RNG state, Megatron's enums and configs, a torch
Generator) loads; anything else is refused with an error naming the class and the file, and a crafted payload --
an object whose ``__reduce__`` would run a shell command -- does not run, whether it hides in the common state, in a
ShardedObject, in a legacy ``common.pt`` or in DCP's ``.metadata``.
"""

import argparse
import io
import os
import pathlib
import pickle
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.core import safe_globals
from megatron.core.dist_checkpointing.checksums import verification
from megatron.core.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    load,
    load_common_state_dict,
    save,
)
from megatron.core.enums import ModelType
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.enums import AttnBackend


class RunsACommand:
    """Unpickling this runs ``touch <marker>`` (pickle calls os.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Harmless:
    def __init__(self, value=1):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Harmless) and other.value == self.value


def _tensor():
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3))}


def _request():
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}


def _training_like_common_state():
    return {
        "args": argparse.Namespace(
            lr=1e-3,
            save=pathlib.Path("/ckpt"),
            params_dtype=torch.bfloat16,
            attention_backend=AttnBackend.auto,
            model_type=ModelType.encoder_or_decoder,
            data_path=["1.0", "/data/x"],
            rampup=None,
        ),
        "extra": types.SimpleNamespace(note="x"),
        "np_rng_state": np.random.get_state(),
        "np_scalar": np.float64(0.25),
        "generator": torch.Generator().manual_seed(3),
        "optimizer_config": OptimizerConfig(lr=0.1),
        "checkpoint_version": 3.0,
        "iteration": 5,
    }


def test_what_a_training_checkpoint_holds_loads(tmp_path):
    common = _training_like_common_state()
    save({**_tensor(), **common, "rng": ShardedObject("rng", [common["np_rng_state"]], (1,), (0,))}, tmp_path)
    loaded = load({**_request(), "rng": ShardedObject("rng", None, (1,), (0,))}, tmp_path)
    assert loaded["args"] == common["args"] and loaded["extra"] == common["extra"]
    assert loaded["optimizer_config"] == common["optimizer_config"]
    state = loaded["np_rng_state"]
    assert state[0] == "MT19937" and np.array_equal(state[1], common["np_rng_state"][1])
    assert np.array_equal(loaded["rng"][0][1], common["np_rng_state"][1])
    assert loaded["np_scalar"] == 0.25
    assert torch.equal(loaded["generator"].get_state(), common["generator"].get_state())


def test_a_real_training_checkpoint_loads(tmp_path):
    """pretrain_gpt.py's own common state (its full argument Namespace) and RNG state, from a 1-iteration run."""
    from tests.functional_tests.configs import GOLDEN_FLAGS, with_flag
    from tests.functional_tests.harness import CPU_FLAGS, builtin_data_flags, run_pretrain

    flags = with_flag(with_flag(GOLDEN_FLAGS, "--train-iters", "1"), "--eval-iters", "0")
    run_pretrain(
        CPU_FLAGS
        + flags
        + builtin_data_flags()
        + ["--save", str(tmp_path), "--save-interval", "1", "--num-workers", "0"]
    )
    checkpoint = tmp_path / "iter_0000001"
    assert not (checkpoint / "common.pt").exists()
    common = load_common_state_dict(checkpoint)
    assert isinstance(common["args"], argparse.Namespace) and common["iteration"] == 1
    rng = load({"rng_state": ShardedObject("rng_state", None, (1, 1), (0, 0))}, checkpoint)["rng_state"]
    assert rng[0]["np_rng_state"][0] == "MT19937"


def _refused(name_pattern):
    return pytest.raises(
        CheckpointingException,
        match=rf"holds an object of {name_pattern}, which is not in the allow-list of megatron.core.safe_globals",
    )


def test_a_class_outside_the_allow_list_is_refused_naming_it_and_the_file(tmp_path):
    save({**_tensor(), "custom": Harmless(2)}, tmp_path)
    name = f"{__name__}.Harmless"
    with pytest.raises(
        CheckpointingException,
        match=rf"ShardedObject 'common_state/shard_0_1' in {tmp_path}/__0_0"
        rf".distcp of checkpoint {tmp_path} holds an object of {re.escape(name)}",
    ):
        load_common_state_dict(tmp_path)
    torch.serialization.add_safe_globals([Harmless])  # the documented way to allow a trusted class
    try:
        assert load_common_state_dict(tmp_path)["custom"] == Harmless(2)
    finally:
        torch.serialization.clear_safe_globals()


@pytest.mark.parametrize("where", ["common state", "sharded object", "legacy common.pt"])
def test_a_crafted_payload_is_not_executed(tmp_path, where):
    marker = tmp_path / "marker"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    payload = RunsACommand(marker)
    state = _tensor()
    if where == "sharded object":
        state["rng"] = ShardedObject("rng", payload, (1,), (0,))
    else:
        state["evil"] = payload
    save(state, checkpoint)
    if where == "legacy common.pt":
        torch.save({"evil": payload}, checkpoint / "common.pt")
    assert not marker.exists()  # saving only records the call
    request = _request()
    if where == "sharded object":
        request["rng"] = ShardedObject("rng", None, (1,), (0,))
    with _refused(r"posix\.system"):
        load(request, checkpoint)
    if where != "sharded object":
        with _refused(r"posix\.system"):
            load_common_state_dict(checkpoint)
    assert not marker.exists()
    # The same bytes do run the command when unpickled without the allow-list: the test payload is real.
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.loads({pickle.dumps(payload)!r})"], check=True)
    assert marker.exists()


def test_a_crafted_dcp_metadata_file_is_not_executed(tmp_path):
    marker = tmp_path / "marker"
    save(_tensor(), tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    # With --no-ckpt-verify (the checksums would refuse the file first), the allow-list still refuses it.
    with verification(False), pytest.raises(CheckpointingException, match=r"\.metadata holds an object of posix"):
        load(_request(), tmp_path)
    assert not marker.exists()


def test_safe_unpickler_and_numpy_loader(tmp_path):
    data = pickle.dumps({"state": np.random.get_state(), "path": pathlib.PosixPath("/x"), "dtype": torch.float16})
    loaded = safe_globals.safe_load_from_bytes(data)
    assert loaded["path"] == pathlib.PosixPath("/x") and loaded["dtype"] is torch.float16
    with pytest.raises(pickle.UnpicklingError, match="GLOBAL posix.system is not in megatron.core.safe_globals"):
        safe_globals.safe_load_from_bytes(pickle.dumps(RunsACommand(tmp_path / "m")))
    with pytest.raises(pickle.UnpicklingError, match=r"GLOBAL .*Harmless"):
        safe_globals.SafeUnpickler(io.BytesIO(pickle.dumps(Harmless()))).load()
    np.save(tmp_path / "a.npy", np.arange(3))
    assert safe_globals.safe_numpy_load(tmp_path / "a.npy").tolist() == [0, 1, 2]
    np.save(tmp_path / "o.npy", np.array([Harmless()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        safe_globals.safe_numpy_load(tmp_path / "o.npy")
    # With allow_pickle the object array's pickle goes through the allow-list: a foreign class is refused...
    with pytest.raises(pickle.UnpicklingError, match=r"Refusing to unpickle disallowed class '.*Harmless'"):
        safe_globals.safe_numpy_load(tmp_path / "o.npy", allow_pickle=True)
    assert pickle.load is not safe_globals._safe_pickle_load  # and pickle.load is restored after the call
    # ... and an allow-listed one loads.
    np.save(tmp_path / "p.npy", np.array([pathlib.PosixPath("/x")], dtype=object), allow_pickle=True)
    assert safe_globals.safe_numpy_load(tmp_path / "p.npy", allow_pickle=True)[0] == pathlib.PosixPath("/x")


def test_importing_safe_globals_registers_the_allow_list(tmp_path):
    # Megatron-Core registers on import, so a plain torch.load (weights_only=True by default) reads a Namespace.
    torch.save({"args": argparse.Namespace(lr=0.1), "buffer": io.BytesIO(b"abc")}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert loaded["args"].lr == 0.1 and loaded["buffer"].getvalue() == b"abc"


def test_no_checkpoint_reader_in_the_repository_unpickles_without_weights_only():
    root = Path(__file__).resolve().parents[3]
    offenders = []
    for folder in ("megatron", "tools"):
        for path in (root / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if "weights_only=False" in line or re.search(r"\bpickle\.loads?\(", line):
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    # The async worker's result pipe carries this process's own pickles, never a file's.
    offenders = [o for o in offenders if not o.startswith("megatron/core/dist_checkpointing/strategies/async_utils.py")]
    assert offenders == []

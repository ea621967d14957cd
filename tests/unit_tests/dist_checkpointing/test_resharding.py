"""Save at one sharding on several ranks, load at another: every rank gets exactly the slices it asks for.

The reference values are global tensors every rank can rebuild (``_reference``); a rank saves the pieces its
layout gives it and a loading rank compares what it reads with the same slices of the reference.
"""

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    load,
    load_plain_tensors,
    save,
)
from tests.unit_tests.test_utilities import run_distributed

NUM_LAYERS = 4


def _reference():
    return {
        "grid": torch.arange(24.0).view(4, 6),
        "column_parallel": torch.arange(48.0).view(6, 8) * -1,
        "norm": torch.linspace(0, 1, 5),
        "layers.weight": torch.arange(NUM_LAYERS * 12.0).view(NUM_LAYERS, 4, 3) + 100,
        "optimizer.exp_avg": torch.arange(48.0).view(8, 6) / 7,
    }


def _piece(key, index, rank_offsets, prepend_axis_num=0, replica_id=0):
    return ShardedTensor.from_rank_offsets(
        key, _reference()[key][index].clone(), *rank_offsets, prepend_axis_num=prepend_axis_num, replica_id=replica_id
    )


def _save_on_four_ranks(checkpoint_dir):
    """TP=2 x PP=2 style: a 2x2 grid, a column split over all ranks, a norm replicated everywhere, stacked layers
    split by pipeline stage (layers) and TP (rows), a flat optimizer state split unevenly within TP pairs, and one
    object per rank."""
    rank = dist.get_rank()
    row, col = divmod(rank, 2)
    pp, tp = divmod(rank, 2)
    state = {
        "grid": _piece("grid", (slice(2 * row, 2 * row + 2), slice(3 * col, 3 * col + 3)), [(0, row, 2), (1, col, 2)]),
        "column_parallel": _piece("column_parallel", (slice(None), slice(2 * rank, 2 * rank + 2)), [(1, rank, 4)]),
        "norm": _piece("norm", slice(None), [], replica_id=rank),
        "layers": [
            _piece("layers.weight", (layer, slice(2 * tp, 2 * tp + 2)), [(0, layer, NUM_LAYERS), (1, tp, 2)], 1)
            for layer in range(2 * pp, 2 * pp + 2)
        ],
        "rng": ShardedObject("rng_state", {"rank": rank}, (4,), (rank,)),
        "iteration": 3,
    }
    # Distributed-optimizer style: pp picks the row block of the (8, 6) state, and the two ranks of a pair hold
    # the uneven flat halves [0, 10) and [10, 24) of that (4, 6) block.
    block = _reference()["optimizer.exp_avg"][4 * pp : 4 * pp + 4].flatten()
    flat = slice(0, 10) if tp == 0 else slice(10, 24)
    state["exp_avg"] = ShardedTensor.from_rank_offsets_flat(
        "optimizer.exp_avg", block[flat].clone(), (4, 6), (0, pp, 2), flattened_range=flat
    )
    save(state, checkpoint_dir)
    return True


def _check_against_reference(loaded, slices):
    """``{state key: (checkpoint key, index)}`` -> ``{state key: loaded value equals that slice of the reference}``."""
    reference = _reference()
    return {key: torch.equal(loaded[key], reference[ckpt_key][index]) for key, (ckpt_key, index) in slices.items()}


def _load_on_two_ranks_along_other_axes(checkpoint_dir):
    """Two ranks: the grid split by columns, the column-parallel weight by rows, layers by rank (interleaved),
    the optimizer state as flat ranges of the whole tensor at other boundaries."""
    rank = dist.get_rank()
    zeros = {key: torch.zeros_like(value) for key, value in _reference().items()}
    flat = slice(0, 17) if rank == 0 else slice(17, 48)
    request = {
        "grid": ShardedTensor.from_rank_offsets("grid", zeros["grid"][:, :3].clone(), (1, rank, 2)),
        "column_parallel": ShardedTensor.from_rank_offsets(
            "column_parallel", zeros["column_parallel"][:3].clone(), (0, rank, 2)
        ),
        "norm": ShardedTensor.from_rank_offsets("norm", zeros["norm"].clone(), replica_id=rank),
        "layer": ShardedTensor.from_rank_offsets(
            "layers.weight", torch.zeros(4, 3), (0, rank + 2, NUM_LAYERS), prepend_axis_num=1, replica_id=0
        ),
        "exp_avg": ShardedTensor.from_rank_offsets_flat(
            "optimizer.exp_avg", torch.zeros(flat.stop - flat.start), (8, 6), flattened_range=flat
        ),
        "rng": ShardedObject("rng_state", None, (4,), (3 - rank,)),
    }
    loaded = load(request, checkpoint_dir, validate_access_integrity=False)
    checks = _check_against_reference(
        loaded,
        {
            "grid": ("grid", (slice(None), slice(3 * rank, 3 * rank + 3))),
            "column_parallel": ("column_parallel", slice(3 * rank, 3 * rank + 3)),
            "norm": ("norm", slice(None)),
            "layer": ("layers.weight", rank + 2),
        },
    )
    checks["exp_avg"] = torch.equal(loaded["exp_avg"], _reference()["optimizer.exp_avg"].flatten()[flat])
    checks["rng"] = loaded["rng"] == {"rank": 3 - rank}
    checks["iteration"] = loaded["iteration"] == 3
    return checks


def _load_uneven_rows_on_three_ranks(checkpoint_dir):
    rank = dist.get_rank()
    bounds = [(0, 1), (1, 4), (4, 8)][rank]
    rows = torch.zeros(bounds[1] - bounds[0], 6)
    request = {
        "exp_avg": ShardedTensor("optimizer.exp_avg", rows, rows.dtype, tuple(rows.shape), (8, 6), (bounds[0], 0), None)
    }
    loaded = load(request, checkpoint_dir)
    return torch.equal(loaded["exp_avg"], _reference()["optimizer.exp_avg"][bounds[0] : bounds[1]])


def test_save_at_tp2_pp2_and_load_at_other_layouts(tmp_path):
    assert run_distributed(4, _save_on_four_ranks, str(tmp_path)) == [True] * 4

    plain = load_plain_tensors(tmp_path)  # one process, whole tensors
    for key, reference in _reference().items():
        assert torch.equal(plain[key], reference), key

    for checks in run_distributed(2, _load_on_two_ranks_along_other_axes, str(tmp_path)):
        assert all(checks.values()), checks
    assert run_distributed(3, _load_uneven_rows_on_three_ranks, str(tmp_path)) == [True] * 3


def _split_columns(key, data, replica_id, flattened_range):
    if dist.get_rank() == 1:
        raise RuntimeError("factory exploded on purpose")
    return {"part": ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)}


def _save_expecting_error(checkpoint_dir, case):
    rank = dist.get_rank()
    if case == "local_failure":
        state = {"f": ShardedTensorFactory("f", torch.zeros(2), _split_columns, lambda x: x, replica_id=rank)}
    elif case == "shape_disagreement":
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2 + rank), (0, rank, 2))}
    else:  # both ranks claim the main replica of the same piece
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    try:
        save(state, checkpoint_dir)
    except CheckpointingException as error:
        return str(error)
    return None


def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    messages = run_distributed(2, _save_expecting_error, str(tmp_path), "local_failure")
    assert all(m is not None and "failed on rank(s) 1: " in m and "factory exploded on purpose" in m for m in messages)
    messages = run_distributed(2, _save_expecting_error, str(tmp_path), "shape_disagreement")
    assert all(m is not None and r"has global shape (4, 2) on rank 0 but (4, 3) on rank 1" in m for m in messages)
    messages = run_distributed(2, _save_expecting_error, str(tmp_path), "overlap")
    assert all(m is not None and "main replicas overlap" in m and "on rank 1" in m for m in messages)
    assert not (tmp_path / "metadata.json").exists()


def _load_with_wrong_shape_on_rank_one(checkpoint_dir):
    rank = dist.get_rank()
    columns = 6 if rank == 0 else 5
    request = {"grid": ShardedTensor.from_rank_offsets("grid", torch.zeros(2, columns), (0, rank, 2), replica_id=0)}
    try:
        load(request, checkpoint_dir, validate_access_integrity=False)
    except CheckpointingException as error:
        return str(error)
    return None


def test_a_load_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    save({"grid": ShardedTensor.from_rank_offsets("grid", _reference()["grid"])}, tmp_path)
    messages = run_distributed(2, _load_with_wrong_shape_on_rank_one, str(tmp_path))
    assert all(
        m is not None and "failed on rank(s) 1" in m and r"expects global shape (4, 5) but the checkpoint" in m
        for m in messages
    )

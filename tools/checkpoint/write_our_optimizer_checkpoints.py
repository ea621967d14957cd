"""Write this project's distributed-optimizer checkpoints for Megatron-Core to read back (run offline).

For each layout, the tiny GPT of ``tests/unit_tests/dist_checkpointing/test_distrib_optimizer_layouts.py`` takes one
step and is saved to ``DIR/<layout>_tp<T>_dp2/``; beside it ``.json`` gives the bucket size and the loss after one
more step, and ``.world.pt`` the optimizer's parameter state gathered over the data-parallel ranks
(``get_parameter_state_dp_zero``), to which Megatron's own after loading is compared element by element::

    python tools/checkpoint/write_our_optimizer_checkpoints.py /tmp/ours
    MEGATRON_PATH=/tmp/mlm /tmp/mvenv/bin/python tools/checkpoint/make_megatron_optimizer_fixtures.py --verify /tmp/ours
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.unit_tests.dist_checkpointing.test_distrib_optimizer_layouts import batch_loss, build, train_step  # noqa: E402
from tests.unit_tests.dist_checkpointing.test_distrib_optimizer_resharding import BUCKETS  # noqa: E402
from tests.unit_tests.test_utilities import run_distributed  # noqa: E402

LAYOUTS = [("dp_reshardable", 1), ("dp_reshardable", 2), ("fully_reshardable", 1), ("fully_reshardable", 2)]


def _save(layout: str, tp: int, checkpoint: str):
    """One step, the checkpoint and the gathered parameter state of that moment, one more step and its loss."""
    from megatron.core import dist_checkpointing

    gpt, model, optimizer, model_args = build(tp, BUCKETS[layout])
    train_step(model, optimizer, model_args, seed=1)
    metadata = {"distrib_optim_sharding_type": layout, "singleton_local_shards": False}
    model_state = gpt.sharded_state_dict(metadata=metadata)
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict({"model": model_state}, metadata=metadata),
        "iteration": 1,
    }
    dist_checkpointing.save(state, checkpoint, content_metadata=metadata)
    world = optimizer.get_parameter_state_dp_zero(return_on_all_ranks=True)
    train_step(model, optimizer, model_args, seed=2)
    with torch.no_grad():
        return batch_loss(model, model_args, seed=3).item(), world


if __name__ == "__main__":
    out_dir = sys.argv[1]
    for layout, tp in LAYOUTS:
        name = f"{layout}_tp{tp}_dp2"
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        results = run_distributed(2 * tp, _save, layout, tp, os.path.join(out_dir, name))
        with open(os.path.join(out_dir, f"{name}.json"), "w") as file:
            json.dump({"bucket_size": BUCKETS[layout], "loss_after_step_2": results[0][0]}, file)
        # Ranks 0 .. tp-1 are data-parallel rank 0 of each tensor-parallel rank (tensor parallelism is innermost).
        torch.save([world for _, world in results[:tp]], os.path.join(out_dir, f"{name}.world.pt"))
        print(name, results[0][0])

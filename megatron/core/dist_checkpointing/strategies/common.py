"""The common (non-sharded) state of a checkpoint: where Megatron-Core 0.19 stores it, and the legacy ``common.pt``.

Since Megatron-Core 0.19 the common state is one :class:`ShardedObject` with key ``common_state`` (global shape
(1,), offset (0,), replica id = the saving rank, so rank 0's copy is the one written) inside the sharded files:
for ``torch_dist`` the bytes of ``torch.save([common_state_dict])`` under ``common_state/shard_0_1``. Checkpoints
of earlier versions (of this project and of Megatron) have it in ``common.pt`` instead, which is read when present.
"""

from pathlib import Path

from ..mapping import CommonStateDict, ShardedObject
from ..safe_load import safe_torch_load
from .base import LoadCommonStrategy, StrategyAction, register_default_strategy

COMMON_STATE_KEY = "common_state"
COMMON_STATE_FNAME = "common.pt"  # legacy: read, never written


def common_state_sharded_object(common_state_dict: CommonStateDict, rank: int) -> ShardedObject:
    """The ShardedObject a rank saves its common state as (only rank 0's, the main replica, is written)."""
    return ShardedObject(COMMON_STATE_KEY, common_state_dict, (1,), (0,), replica_id=rank)


def has_legacy_common_state(checkpoint_dir: Path) -> bool:
    return (Path(checkpoint_dir) / COMMON_STATE_FNAME).exists()


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads a legacy ``common.pt`` (``torch.save`` of the common state dict), with the safe-globals allow-list."""

    def load_common(self, checkpoint_dir: Path) -> CommonStateDict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        return safe_torch_load(str(path), f"the common state {path} of checkpoint {checkpoint_dir}")


register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy("torch", 1))

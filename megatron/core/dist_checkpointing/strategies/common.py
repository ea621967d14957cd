"""The ``torch`` common backend: the non-sharded state in ``common.pt`` (one ``torch.save``, by rank 0)."""

import logging
from pathlib import Path

import torch

from ..core import CheckpointingException
from ..mapping import CommonStateDict
from .base import LoadCommonStrategy, SaveCommonStrategy, StrategyAction, register_default_strategy

COMMON_STATE_FNAME = "common.pt"

logger = logging.getLogger(__name__)


class TorchCommonSaveStrategy(SaveCommonStrategy):
    def save_common(self, common_state_dict: CommonStateDict, checkpoint_dir: Path) -> None:
        torch.save(common_state_dict, Path(checkpoint_dir) / COMMON_STATE_FNAME)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    def load_common(self, checkpoint_dir: Path) -> CommonStateDict:
        """Unpickles ``common.pt`` (arbitrary objects, e.g. the training arguments): load only trusted checkpoints."""
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.exists():
            raise CheckpointingException(f"{path} is missing: the checkpoint {checkpoint_dir} has no common state")
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:
            raise CheckpointingException(f"{path} cannot be read ({type(error).__name__}: {error})") from error


register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1))
register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy("torch", 1))

"""Small shared pieces of the dataset stack: the split enum, weight normalisation, `--data-path` parsing, logging."""

import enum
import logging
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch


class Split(enum.Enum):
    """The three dataset splits, in the order of the split string ("949,50,1") and of the builder's result."""

    train = 0
    valid = 1
    test = 2


def log_single_rank(logger: logging.Logger, level: int, message: str) -> None:
    """Log `message` on global rank 0 only (on every process before torch.distributed is initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != 0:
            return
    logger.log(level, message)


def normalize(weights: Sequence[float]) -> List[float]:
    """Scale `weights` to sum to 1, in float64 exactly as Megatron-LM does (the blending greedy depends on the bits).

    Raises ValueError for a negative, NaN or infinite weight, or when the weights sum to 0.
    """
    array = np.asarray(weights, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"weights must be a non-empty list of numbers, got {list(weights)!r}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)!r}")
    total = np.sum(array)
    if total <= 0:
        raise ValueError(
            f"weights must not all be 0, got {list(weights)!r}: give at least one dataset a positive weight"
        )
    return (array / total).tolist()


def _parse_weight(text: str) -> Optional[float]:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def get_blend_from_list(blend: Optional[List[str]]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Turn a `--data-path`-style list into `(prefixes, weights)`.

    `["0.3", "a", "0.7", "b"]` gives `(["a", "b"], [0.3, 0.7])`; `["a", "b"]` gives `(["a", "b"], None)`;
    `None` gives `None`. Weights are returned as given (not normalised). A list whose even positions are partly
    numbers and partly not is ambiguous and raises ValueError.
    """
    if blend is None:
        return None
    blend = [str(item) for item in blend]
    if len(blend) == 0:
        raise ValueError("blend (--data-path) is empty: give at least one dataset prefix")
    if len(blend) % 2 == 1:
        return [prefix.strip() for prefix in blend], None
    candidate_weights = [_parse_weight(text) for text in blend[0::2]]
    if all(weight is None for weight in candidate_weights):
        return [prefix.strip() for prefix in blend], None
    if any(weight is None for weight in candidate_weights):
        raise ValueError(
            f"cannot tell weights from prefixes in blend {blend!r}: give a weight before every prefix "
            f"(e.g. ['0.3', 'a', '0.7', 'b']) or no weights at all (e.g. ['a', 'b'])"
        )
    return [prefix.strip() for prefix in blend[1::2]], candidate_weights


def compile_helpers():
    """Megatron-LM compiles its C++ index helpers here; this project's index helpers are numpy code
    (`index_helpers.py`), so there is nothing to build: this only checks that they import."""
    import megatron.core.datasets.index_helpers  # noqa: F401 -- raises if the helpers are unavailable

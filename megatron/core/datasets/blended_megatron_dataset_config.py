"""BlendedMegatronDatasetConfig: what to read, how to split and blend it, where to cache the indices."""

import logging
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

Blend = Tuple[List[str], Optional[List[float]]]
SplitMatrix = List[Optional[Tuple[float, float]]]

_MOCK_SPLIT = "1,1,1"


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration shared by every dataset the BlendedMegatronDatasetBuilder makes."""

    random_seed: int
    """Seed of the numpy RandomState that shuffles the document and sample indices (`--seed`)."""

    sequence_length: int
    """Tokens per sample, not counting the extra label token (`--seq-length`)."""

    blend: Optional[Blend] = None
    """`(prefixes, weights or None)` shared by all splits and cut by `split` (`--data-path`)."""

    blend_per_split: Optional[List[Optional[Blend]]] = None
    """One blend per split, train/valid/test (`--train-data-path`, `--valid-data-path`, `--test-data-path`)."""

    multiple_validation_sets: Optional[bool] = None
    """Megatron: one validation dataset per validation blend entry instead of their blend
    (`--multiple-validation-sets`). Not supported yet: True is refused."""

    full_validation: Optional[bool] = None
    """Megatron: evaluate on the whole validation set (`--full-validation`). Not supported yet: True is refused."""

    split: Optional[str] = None
    """Relative split sizes such as "949,50,1"; required with `blend` (`--split`)."""

    split_matrix: Optional[SplitMatrix] = field(init=False, default=None)
    """Derived from `split`: the `(begin, end)` fraction of each split, None for an empty split."""

    num_dataset_builder_threads: int = 1
    """Threads that build the per-prefix datasets of a blend (`--num-dataset-builder-threads`)."""

    path_to_cache: Optional[str] = None
    """Directory for the index caches; default `<dir of prefix>/cache/<class>_indices` (`--data-cache-path`)."""

    mmap_bin_files: bool = True
    """Memory-map the `.bin` files (`--no-mmap-bin-files` turns it off)."""

    mock: bool = False
    """Use synthetic data; set automatically when neither `blend` nor `blend_per_split` is given (`--mock-data`)."""

    tokenizer: Optional[Any] = None
    """Any object with `eod` and `pad` (and `unique_identifiers` for the cache description)."""

    mid_level_dataset_surplus: float = 0.005
    """Extra fraction of samples each blended dataset builds beyond its share (`--mid-level-dataset-surplus`)."""

    allow_ambiguous_pad_tokens: bool = False
    """Allow a tokenizer whose padding id is also a real token id (e.g. pad == eod): padding positions then cannot
    be told from real tokens, so by default such a tokenizer is refused (`--allow-ambiguous-pad-tokens`)."""

    fast_cache_load: bool = False
    """Megatron's faster start-up path for the index caches (`--dataloader-fast-cache-load`); accepted, no effect:
    the caches are memory-mapped `.npy` files read on demand."""

    defer_npy_index_mmap: bool = False
    """Megatron: memory-map the index caches only on first access (`--dataloader-defer-npy-index-mmap`); accepted,
    no effect: mapping them costs no reads here."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the final partial sample of the validation split (`--no-drop-last-partial-validation-sequence`)."""

    add_extra_token_to_sequence: bool = True
    """Read `sequence_length + 1` tokens per sample so labels are the tokens shifted by one."""

    def __post_init__(self):
        for name, feature in (
            ("multiple_validation_sets", "separate validation datasets per blend entry"),
            ("full_validation", "validation over the whole validation set"),
        ):
            if getattr(self, name):
                raise ValueError(f"not supported yet: {feature} ({name}={getattr(self, name)!r})")
        _check_seed_and_length(self.random_seed, self.sequence_length)
        _check_builder_options(self.num_dataset_builder_threads, self.mid_level_dataset_surplus)
        if self.blend_per_split is not None and any(self.blend_per_split):
            _check_blend_per_split(self)
            log_single_rank(logger, logging.INFO, "blend_per_split is set: each split reads its own blend")
            return
        if self.blend is not None:
            _check_blend("blend", self.blend)
            if self.mock:
                raise ValueError("mock=True cannot be combined with blend: drop blend (--data-path) or mock")
            if self.split is None:
                raise ValueError("split is required with blend: give e.g. split='949,50,1' (--split)")
        else:
            self.mock = True
            if self.split is None:
                self.split = _MOCK_SPLIT
            log_single_rank(logger, logging.INFO, f"no blend given: using mock data with split {self.split!r}")
        self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))


def _check_seed_and_length(random_seed, sequence_length) -> None:
    if not isinstance(random_seed, numbers.Integral) or not 0 <= random_seed < 2**32:
        raise ValueError(
            f"random_seed must be an integer in [0, 2**32) (numpy RandomState's range), got {random_seed!r}"
        )
    if not isinstance(sequence_length, numbers.Integral) or sequence_length < 1:
        raise ValueError(f"sequence_length must be a positive integer, got {sequence_length!r}")


def _check_builder_options(num_threads, surplus) -> None:
    if not isinstance(num_threads, numbers.Integral) or num_threads < 1:
        raise ValueError(f"num_dataset_builder_threads must be an integer >= 1, got {num_threads!r}")
    if not isinstance(surplus, numbers.Real) or not math.isfinite(surplus) or surplus < 0:
        raise ValueError(f"mid_level_dataset_surplus must be a number >= 0 (e.g. 0.005), got {surplus!r}")


def _check_blend_per_split(config: BlendedMegatronDatasetConfig) -> None:
    if config.blend is not None:
        raise ValueError("blend and blend_per_split are mutually exclusive: set only one of them")
    if config.split is not None:
        raise ValueError(
            f"split ({config.split!r}) does not apply with blend_per_split (each split has its own blend): "
            f"set split=None"
        )
    if config.mock:
        raise ValueError("mock=True cannot be combined with blend_per_split: drop one of them")
    if len(config.blend_per_split) != len(Split):
        raise ValueError(
            f"blend_per_split must hold {len(Split)} entries (train, valid, test; None for an unused split), "
            f"got {len(config.blend_per_split)}"
        )
    for split in Split:
        blend = config.blend_per_split[split.value]
        if blend is not None:
            _check_blend(f"blend_per_split[{split.value}] ({split.name})", blend)


def _check_blend(name: str, blend) -> None:
    if not isinstance(blend, (tuple, list)) or len(blend) != 2:
        raise ValueError(
            f"{name} must be a pair (prefixes, weights or None), got {blend!r}; "
            f"build it from a --data-path list with get_blend_from_list"
        )
    prefixes, weights = blend
    if isinstance(prefixes, str) or not isinstance(prefixes, (list, tuple)) or len(prefixes) == 0:
        raise ValueError(f"{name}: prefixes must be a non-empty list of path prefixes, got {prefixes!r}")
    if not all(isinstance(prefix, str) and prefix for prefix in prefixes):
        raise ValueError(f"{name}: every prefix must be a non-empty string, got {prefixes!r}")
    if weights is None:
        return
    if len(weights) != len(prefixes):
        raise ValueError(
            f"{name}: {len(weights)} weights for {len(prefixes)} prefixes; give one weight per prefix or None"
        )
    try:
        normalize(weights)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def parse_and_normalize_split(split: str) -> List[float]:
    """Parse a split string such as "949,50,1" into three fractions summing to 1 (missing values count as 0)."""
    if not isinstance(split, str):
        raise ValueError(f"split must be a string such as '949,50,1', got {split!r}")
    numbers = re.findall(r"[.0-9]+", split)
    try:
        values = [float(number) for number in numbers]
    except ValueError:
        raise ValueError(f"split {split!r} holds a malformed number; expected e.g. '949,50,1'") from None
    if len(values) == 0:
        raise ValueError(f"split {split!r} holds no numbers; expected e.g. '949,50,1'")
    if len(values) > len(Split):
        raise ValueError(
            f"split {split!r} has {len(values)} values but there are only {len(Split)} splits (train, valid, test)"
        )
    values += [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise ValueError(f"split {split!r} gives every split 0; give the train split a positive share")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: List[float], vector_b: Optional[List[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Turn split fractions into `(begin, end)` book-ends, e.g. [.949, .05, .001] -> [(0, .949), (.949, .999), ...].

    With `vector_b`, each entry is the overlap of the two vectors' book-ends. A zero-width split becomes None.
    The running sums are left-to-right float additions from 0, which fixes the exact book-end values.
    """
    if vector_b is None:
        vector_b = vector_a
    bookends_a = _bookends(vector_a)
    bookends_b = _bookends(vector_b)
    matrix: SplitMatrix = []
    for (begin_a, end_a), (begin_b, end_b) in zip(bookends_a, bookends_b):
        if min(end_a - begin_a, end_b - begin_b) == 0:
            matrix.append(None)
        else:
            matrix.append((max(begin_a, begin_b), min(end_a, end_b)))
    return matrix


def _bookends(vector: Sequence[float]) -> List[Tuple[float, float]]:
    edges = [0]
    for fraction in vector:
        edges.append(edges[-1] + fraction)
    return list(zip(edges[:-1], edges[1:]))

"""BlendedMegatronDatasetBuilder: turn a config into the train/valid/test datasets (spec d3 and d5).

For each prefix of the blend it opens the low-level dataset once, cuts it into the three splits by the split
book-ends, and builds one mid-level dataset (e.g. GPTDataset) per split; with several prefixes it then blends each
split with a BlendedDataset. When torch.distributed is initialised, global rank 0 builds first (writing the index
caches) while the other ranks wait; then they build too, reading those caches.
"""

import logging
import math
import numbers
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Sequence, Type, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import (
    Blend,
    BlendedMegatronDatasetConfig,
    SplitMatrix,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize
from megatron.core.utils import get_current_device

logger = logging.getLogger(__name__)

Sizes = List[Optional[int]]


class BlendedMegatronDatasetBuilder:
    """Build the train, valid and test datasets of class `cls` described by `config`.

    Args:
        cls: the mid-level dataset class (GPTDataset, MockGPTDataset, ...).
        sizes: requested samples per split, train/valid/test; None means one epoch (only without weights).
        is_built_on_rank: called on each rank; ranks where it returns False get None datasets (it must return
            True on global rank 0).
        config: the dataset config.
    """

    def __init__(
        self,
        cls: Type[MegatronDataset],
        sizes: Sequence[Optional[int]],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.cls = cls
        self.sizes = _check_sizes(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        self._check_weights_have_sizes()
        if _distributed() and torch.distributed.get_rank() == 0 and not is_built_on_rank():
            raise ValueError("is_built_on_rank must return True on global rank 0, which builds the index caches")
        log_single_rank(logger, logging.INFO, f"building {cls.__name__} splits with sizes={self.sizes}")

    def build(self) -> List[Optional[Any]]:
        """The `[train, valid, test]` datasets; None for a split that is empty or not built on this rank."""
        if self.config.mock:
            return self._build_blend(([None], None), self.config.split_matrix, self.sizes)
        if self.config.blend is not None:
            return self._build_blend(self.config.blend, self.config.split_matrix, self.sizes)
        datasets: List[Optional[Any]] = [None] * len(Split)
        for split in Split:
            blend = self.config.blend_per_split[split.value]
            if blend is None:
                continue
            whole_for_this_split: SplitMatrix = [None] * len(Split)
            whole_for_this_split[split.value] = (0.0, 1.0)
            datasets[split.value] = self._build_blend(blend, whole_for_this_split, self.sizes)[split.value]
        return datasets

    def _check_weights_have_sizes(self) -> None:
        """Weighted blending needs a target size: the weights say what share of it each prefix gives."""
        if self.config.mock:
            return
        for split in Split:
            if self.sizes[split.value] is not None:
                continue
            if self.config.blend_per_split is not None and any(self.config.blend_per_split):
                blend = self.config.blend_per_split[split.value]
                built = blend is not None
            else:
                blend = self.config.blend
                built = self.config.split_matrix[split.value] is not None
            if built and blend[1] is not None:
                raise ValueError(
                    f"sizes[{split.value}] ({split.name}) is None but its blend has weights: give the number of "
                    f"{split.name} samples, or drop the weights to use each dataset once"
                )

    def _build_blend(self, blend: Blend, split_matrix: SplitMatrix, sizes: Sizes) -> List[Optional[Any]]:
        prefixes, weights = blend
        if len(prefixes) == 1:
            return self._build_mid_level_datasets(prefixes, split_matrix, [sizes])[0]
        if weights is None:
            sizes_per_prefix = [[None] * len(Split) for _ in prefixes]
        else:
            weights = normalize(weights)
            surplus = self.config.mid_level_dataset_surplus
            sizes_per_prefix = [[_size_with_surplus(size, weight, surplus) for size in sizes] for weight in weights]
        mid_level = self._build_mid_level_datasets(prefixes, split_matrix, sizes_per_prefix)

        def blend_split(split: Split) -> Optional[BlendedDataset]:
            datasets = [per_prefix[split.value] for per_prefix in mid_level]
            if all(dataset is None for dataset in datasets):
                return None
            for prefix, dataset in zip(prefixes, datasets):
                if dataset is None:
                    raise ValueError(
                        f"{prefix} has no sequences in the {split.name} split (split {self.config.split!r}), so it "
                        f"cannot be blended into it: give that split a larger share or drop the prefix"
                    )
            size = sizes[split.value]
            if weights is None:
                available = sum(len(dataset) for dataset in datasets)
                if size is not None and size > available:
                    log_single_rank(
                        logger,
                        logging.WARNING,
                        f"{split.name}: {size} samples requested but the unweighted blend holds {available}",
                    )
                size = available if size is None else min(size, available)
            return BlendedDataset(datasets, weights, size, self.config)

        built_splits = [split for split in Split if split_matrix[split.value] is not None]
        blended = self._build_rank_0_first([lambda split=split: blend_split(split) for split in built_splits])
        result: List[Optional[Any]] = [None] * len(Split)
        for split, dataset in zip(built_splits, blended):
            result[split.value] = dataset
        return result

    def _build_mid_level_datasets(
        self, prefixes: Sequence[Optional[str]], split_matrix: SplitMatrix, sizes_per_prefix: List[Sizes]
    ) -> List[List[Optional[MegatronDataset]]]:
        """For each prefix, its `[train, valid, test]` mid-level datasets."""
        tasks = [
            lambda prefix=prefix, sizes=sizes: self._build_splits_of_prefix(prefix, split_matrix, sizes)
            for prefix, sizes in zip(prefixes, sizes_per_prefix)
        ]
        built = self._build_rank_0_first(tasks)
        return [per_prefix if per_prefix is not None else [None] * len(Split) for per_prefix in built]

    def _build_splits_of_prefix(
        self, prefix: Optional[str], split_matrix: SplitMatrix, sizes: Sizes
    ) -> List[Optional[MegatronDataset]]:
        low_level_dataset = self.cls.build_low_level_dataset(prefix, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets: List[Optional[MegatronDataset]] = []
        for split in Split:
            bookends = split_matrix[split.value]
            if bookends is None:
                datasets.append(None)
                continue
            begin = int(round(bookends[0] * float(num_elements)))
            end = int(round(bookends[1] * float(num_elements)))
            if begin == end:
                log_single_rank(
                    logger,
                    logging.WARNING,
                    f"{prefix}: the {split.name} split {bookends} of its {num_elements} sequences is empty; "
                    f"no {split.name} dataset is built from it",
                )
                datasets.append(None)
                continue
            indices = np.arange(start=begin, stop=end, step=1, dtype=np.int32)
            datasets.append(self.cls(low_level_dataset, prefix, indices, sizes[split.value], split, self.config))
        return datasets

    def _build_rank_0_first(self, tasks: List[Callable[[], Any]]) -> List[Any]:
        """Run `tasks` on global rank 0, then (once all ranks know it succeeded) on the other building ranks;
        ranks that do not build get a None per task."""
        results = _rank_0_first(lambda: self._run(tasks), self.is_built_on_rank)
        return [None] * len(tasks) if results is None else results

    @staticmethod
    def build_generic_dataset(
        cls: Union[Type[Union[BlendedDataset, MegatronDataset, IndexedDataset, Iterable, Dataset]], Callable],
        is_built_on_rank: Callable,
        synchronize_ranks: bool,
        *args: Any,
    ) -> Optional[Union[BlendedDataset, MegatronDataset, IndexedDataset, Iterable, Dataset]]:
        """`cls(*args)` on the ranks where `is_built_on_rank()` is True, None elsewhere.

        With `synchronize_ranks` (and torch.distributed initialised) global rank 0 builds first, so whatever it
        caches on disk is there when the other ranks build; every rank must then call this, and a failure on any
        rank is raised on every rank. Without it each rank builds on its own, with no collective.
        """
        if not synchronize_ranks or not _distributed():
            return cls(*args) if is_built_on_rank() else None
        return _rank_0_first(lambda: cls(*args), is_built_on_rank)

    def _run(self, tasks: List[Callable[[], Any]]) -> List[Any]:
        threads = min(self.config.num_dataset_builder_threads, len(tasks))
        if threads <= 1:
            return [task() for task in tasks]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(lambda task: task(), tasks))


def _rank_0_first(build: Callable[[], Any], is_built_on_rank: Callable[[], bool]) -> Any:
    """`build()` on global rank 0, then on the other ranks where `is_built_on_rank()`; None where nothing is built.

    Every rank calls this the same number of times, whatever `is_built_on_rank` says, because it holds
    collectives. After each phase the ranks agree on whether any of them failed; the failing rank re-raises its
    error and the others raise a RuntimeError, so no rank is left waiting in a later collective.
    """
    if not _distributed():
        return build() if is_built_on_rank() else None
    rank = torch.distributed.get_rank()
    result = None
    for phase in ("global rank 0", "the other ranks"):
        failure: Optional[BaseException] = None
        if (rank == 0) == (phase == "global rank 0") and is_built_on_rank():
            try:
                result = build()
            except Exception as error:  # re-raised below, once every rank knows to stop
                failure = error
        if _any_rank_failed(failure is not None):
            if failure is not None:
                raise failure
            raise RuntimeError(f"{phase} failed to build the datasets (see that rank's error); stopping")
    return result


def _size_with_surplus(target: Optional[int], weight: float, surplus: float) -> Optional[int]:
    """A prefix's share of `target` samples plus the surplus: `ceil(ceil(target * weight) * (1 + surplus))`."""
    if target is None:
        return None
    return int(math.ceil(math.ceil(target * weight) * (1 + surplus)))


def _check_sizes(sizes: Sequence[Optional[int]]) -> Sizes:
    if isinstance(sizes, (str, bytes)) or len(sizes) != len(Split):
        raise ValueError(f"sizes must hold {len(Split)} entries (train, valid, test samples), got {sizes!r}")
    for split, size in zip(Split, sizes):
        if size is not None and (not isinstance(size, numbers.Integral) or size < 0):
            raise ValueError(f"sizes[{split.value}] ({split.name}) must be None or an integer >= 0, got {size!r}")
    return [None if size is None else int(size) for size in sizes]


def _any_rank_failed(failed_here: bool) -> bool:
    flag = torch.tensor([1 if failed_here else 0], dtype=torch.int32, device=get_current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()

"""BlendedDataset: interleave several datasets of one split by weight, with Megatron-LM's greedy order (spec d5)."""

import logging
import math
import numbers
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import IndexCacheError, cache_file_paths, load_or_build
from megatron.core.datasets.index_helpers import build_blending_indices, build_exhaustive_blending_indices
from megatron.core.datasets.megatron_dataset import MegatronDataset, describe, md5_hex
from megatron.core.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)

_INDEX_NAMES = ("dataset_index", "dataset_sample_index")
_MAX_DATASETS = np.iinfo(np.int16).max + 1


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights`.

    Sample `k` comes from the dataset `i` that maximises `w_i * max(k, 1) - drawn_i` (the first on ties), as its
    `drawn_i`-th sample. With `weights=None` every sample of every dataset is used once, interleaved in proportion
    to their sizes ("exhaustive"); `size` then defaults to their total. Weights must already be normalised
    (`megatron.core.datasets.utils.normalize`), because renormalising changes the float bits that break ties.

    A sample is the chosen dataset's sample dict plus `dataset_id`.
    """

    def __init__(
        self,
        datasets: List[MegatronDataset],
        weights: Optional[List[float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        _check_arguments(datasets, weights, size)
        self.datasets = list(datasets)
        self.split = self.datasets[0].index_split
        self.weights = None if weights is None else [float(weight) for weight in weights]
        if self.weights is None:
            total = sum(len(dataset) for dataset in self.datasets)
            if size is not None and size > total:
                raise ValueError(
                    f"size {size} exceeds the {total} samples of the {len(self.datasets)} datasets blended without "
                    f"weights: ask for at most {total} or give weights"
                )
            size = total if size is None else size
        self.size = int(size)
        self.config = config
        self.built_anew_on_cache_miss = False

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        self.unique_identifiers["weights"] = self.weights
        self.unique_identifiers["size"] = self.size
        self.unique_description = describe(self.unique_identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)

        self.dataset_index, self.dataset_sample_index = self._build_indices()
        self._check_draws_fit_datasets()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample_id = int(self.dataset_sample_index[idx])
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][sample_id]}

    def _build_indices(self) -> Tuple[np.ndarray, np.ndarray]:
        def build() -> Dict[str, np.ndarray]:
            log_single_rank(
                logger, logging.INFO, f"building {type(self).__name__} {self.split.name} indices ({self.size} samples)"
            )
            if self.weights is None:
                dataset_index, sample_index = build_exhaustive_blending_indices([len(d) for d in self.datasets])
                dataset_index, sample_index = dataset_index[: self.size], sample_index[: self.size]
            else:
                dataset_index, sample_index = build_blending_indices(self.weights, self.size)
            return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

        paths = None
        if self.config.path_to_cache:
            paths = cache_file_paths(
                self.config.path_to_cache,
                self.unique_description_hash,
                type(self).__name__,
                self.split.name,
                _INDEX_NAMES,
            )
        arrays, self.built_anew_on_cache_miss = load_or_build(paths, self.unique_description, build, self._check_cached)
        return arrays["dataset_index"], arrays["dataset_sample_index"]

    def _check_cached(self, arrays: Dict[str, np.ndarray], paths: Dict[str, str]) -> None:
        for name in _INDEX_NAMES:
            if arrays[name].shape != (self.size,):
                raise IndexCacheError(
                    f"{paths[name]} has shape {arrays[name].shape}, expected ({self.size},); delete these cache "
                    f"files and rerun"
                )

    def _check_draws_fit_datasets(self) -> None:
        """Each dataset must hold as many samples as the blend draws from it."""
        draws = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for dataset_id, (drawn, dataset) in enumerate(zip(draws, self.datasets)):
            if drawn > len(dataset):
                raise ValueError(
                    f"the {self.split.name} blend draws {drawn} samples from dataset {dataset_id} "
                    f"({dataset.dataset_path}), which has only {len(dataset)}: raise mid_level_dataset_surplus "
                    f"(--mid-level-dataset-surplus, now {self.config.mid_level_dataset_surplus})"
                )


def _check_arguments(datasets: Sequence[Any], weights: Optional[Sequence[float]], size: Optional[int]) -> None:
    if len(datasets) == 0:
        raise ValueError("BlendedDataset needs at least one dataset")
    if len(datasets) > _MAX_DATASETS:
        raise ValueError(f"BlendedDataset takes at most {_MAX_DATASETS} datasets (int16 ids), got {len(datasets)}")
    splits = {dataset.index_split for dataset in datasets}
    if len(splits) != 1:
        raise ValueError(f"all blended datasets must belong to one split, got {sorted(s.name for s in splits)}")
    if size is not None and (not isinstance(size, numbers.Integral) or size < 0):
        raise ValueError(f"size must be None or an integer >= 0, got {size!r}")
    if weights is None:
        return
    if size is None:
        raise ValueError("size is required when weights are given (size=None is only for weights=None)")
    if len(weights) != len(datasets):
        raise ValueError(f"{len(weights)} weights for {len(datasets)} datasets; give one weight per dataset")
    if not all(isinstance(w, numbers.Real) and math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"weights must be finite numbers >= 0, got {list(weights)!r}")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(
            f"weights must be normalised to sum to 1, got sum {sum(weights)!r}; "
            f"use megatron.core.datasets.utils.normalize(weights)"
        )

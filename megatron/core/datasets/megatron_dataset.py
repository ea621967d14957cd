"""MegatronDataset: the abstract "mid-level" dataset, one split of one low-level dataset, with a unique description."""

import hashlib
import json
import numbers
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.utils import Split


def identifiers_for_json(obj: Any) -> Any:
    """JSON stand-in for objects in a dataset description: their `unique_identifiers`, else their class name.

    The tokenizer is the usual such object. Without `unique_identifiers` its class name is used; the indices do not
    depend on the tokenizer, so that can never select a wrong cache.
    """
    identifiers = getattr(obj, "unique_identifiers", None)
    if identifiers is not None:
        return identifiers
    return {"class": f"{type(obj).__module__}.{type(obj).__qualname__}"}


def describe(identifiers: Dict[str, Any]) -> str:
    """The JSON description whose md5 names a dataset's cache files."""
    return json.dumps(identifiers, indent=4, default=identifiers_for_json)


def md5_hex(text: str) -> str:
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split of a low-level dataset, sampled `num_samples` times (None: one epoch).

    Args:
        dataset: the low-level dataset (e.g. an IndexedDataset).
        dataset_path: its path prefix (None for synthetic data).
        indices: the ids of the low-level dataset's elements that belong to this split.
        num_samples: how many samples to build at least (None: one epoch).
        index_split: which split this is.
        config: the dataset config.
    """

    def __init__(
        self,
        dataset: Any,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if num_samples is not None and (not isinstance(num_samples, numbers.Integral) or num_samples < 0):
            raise ValueError(
                f"num_samples must be None (one epoch) or an integer >= 0, got {num_samples!r} "
                f"for the {getattr(index_split, 'name', index_split)} split of {dataset_path}"
            )
        if not isinstance(index_split, Split):
            raise ValueError(f"index_split must be a Split (train, valid or test), got {index_split!r}")
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices)
        self.num_samples = None if num_samples is None else int(num_samples)
        self.index_split = index_split
        self.config = config
        self.built_anew_on_cache_miss = False

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attribute in self._key_config_attributes():
            self.unique_identifiers[attribute] = getattr(self.config, attribute)
        self.unique_description = describe(self.unique_identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)

    @staticmethod
    @abstractmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """How many elements (for GPT: sequences) the low-level dataset holds; the split fractions cut these."""

    @staticmethod
    @abstractmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: BlendedMegatronDatasetConfig) -> Any:
        """Open the low-level dataset at `dataset_path`."""

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config fields that change this dataset's indices, so they are part of its cache description."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @abstractmethod
    def __len__(self) -> int:
        """The number of samples."""

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Any]:
        """Sample `idx` as a dict of tensors."""

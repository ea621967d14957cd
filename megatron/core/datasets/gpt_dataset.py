"""GPTDataset: fixed-length samples cut from a shuffled stream of documents, in Megatron-LM's order.

A split's documents are repeated for as many epochs as the requested samples need, shuffled (document index), cut
into samples of `sequence_length + 1` tokens that overlap by one token (sample index), and the samples are shuffled
(shuffle index). The three indices come from `index_helpers` and are cached on disk (`index_cache`). MockGPTDataset
runs the same machinery on synthetic documents, for `--mock-data`.
"""

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import IndexCacheError, cache_file_paths, load_or_build
from megatron.core.datasets.index_helpers import (
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    count_samples,
)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """BlendedMegatronDatasetConfig plus what shapes a GPT sample."""

    reset_position_ids: Optional[bool] = None
    """Restart position ids after every end-of-document token (`--reset-position-ids`). Megatron-Core requires it
    set; None is taken as False here."""

    reset_attention_mask: Optional[bool] = None
    """Block-diagonal attention: no token attends across an end-of-document token (`--reset-attention-mask`);
    None is taken as False."""

    eod_mask_loss: Optional[bool] = None
    """Give end-of-document tokens no loss (`--eod-mask-loss`); None is taken as False."""

    create_attention_mask: bool = True
    """Put the `[1, S, S]` attention mask in each sample (`--no-create-attention-mask-in-dataloader` turns it off)."""

    object_storage_cache_path: Optional[str] = None
    """Megatron: local cache for datasets in object storage (`--object-storage-cache-path`). Not supported yet."""

    data_parallel_size: int = 1
    """Data-parallel size of the job; Megatron uses it only to pack sequences for hybrid context parallelism."""

    sequence_parallel_size: int = 0
    """Megatron: sequence-packing parallel size for hybrid context parallelism; only 0 (off) here."""

    hybrid_context_parallel: bool = False
    """Megatron: pack variable-length sequences for hybrid context parallelism. Not supported yet."""

    sequences_per_dataset: Optional[Dict[str, Tuple[int, int]]] = None
    """Megatron: known (sequence, document) counts per dataset, to skip reading the index headers at start-up
    (`--per-dataset-sequences-path`). Not supported yet."""

    token_dtype_code: Optional[int] = None
    """Megatron: the known `.idx` token dtype code of every dataset, with `sequences_per_dataset`. Not supported yet."""

    context_parallel_size: Optional[int] = None
    """Context-parallel size of the job; Megatron uses it only with hybrid context parallelism."""

    inter_document_masking: bool = False
    """Megatron: mask attention between packed documents (with hybrid context parallelism). Not supported yet."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                setattr(self, name, False)
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss", "create_attention_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_unsupported_gpt_fields(self)
        if self.tokenizer is None:
            raise ValueError(
                "GPTDatasetConfig needs a tokenizer (any object with `eod` and `pad`) for the end-of-document and "
                "padding ids: pass tokenizer=..."
            )
        if not hasattr(self.tokenizer, "eod"):
            raise ValueError(
                f"the tokenizer ({type(self.tokenizer).__name__}) has no `eod` attribute; GPTDataset needs the "
                f"end-of-document id"
            )


def _check_unsupported_gpt_fields(config: GPTDatasetConfig) -> None:
    unsupported = {
        "object_storage_cache_path": ("datasets in object storage", None),
        "hybrid_context_parallel": ("hybrid context parallelism", False),
        "sequence_parallel_size": ("sequence packing for hybrid context parallelism", 0),
        "inter_document_masking": ("inter-document attention masking of packed sequences", False),
        "sequences_per_dataset": ("known per-dataset sequence counts", None),
        "token_dtype_code": ("a known token dtype for every dataset", None),
    }
    for name, (feature, default) in unsupported.items():
        if getattr(config, name) != default:
            raise ValueError(f"not supported yet: {feature} ({name}={getattr(config, name)!r})")
    if not isinstance(config.data_parallel_size, int) or config.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {config.data_parallel_size!r}")


def _padding_id(config: GPTDatasetConfig) -> int:
    """The id GPTDataset pads samples with.

    A tokenizer whose pad id is also its end-of-document id would have every real EOD label masked out of the loss
    as padding, so, as in Megatron-LM, such a pad id is replaced by -1 (which no token has), unless
    ``allow_ambiguous_pad_tokens`` asks for the tokenizer's own.
    """
    pad = _pad_token_id(config.tokenizer)
    if pad == _PAD_TOKEN_ID or pad != config.tokenizer.eod or config.allow_ambiguous_pad_tokens:
        return pad
    log_single_rank(
        logger,
        logging.WARNING,
        f"the tokenizer's padding id {pad} is also its end-of-document id; padding with {_PAD_TOKEN_ID} instead, so "
        "end-of-document labels keep their loss (--allow-ambiguous-pad-tokens pads with the tokenizer's id)",
    )
    return _PAD_TOKEN_ID


class GPTDataset(MegatronDataset):
    """Samples of `sequence_length` tokens (plus the label shift) from one split of an IndexedDataset.

    Each sample is a dict of `tokens`, `labels`, `loss_mask`, `position_ids` and, when the config asks for it,
    `attention_mask` (bool `[1, S, S]`, True = masked out). `len()` is the number of samples actually built,
    which is whole epochs' worth, so it can exceed `num_samples`.
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # Without resets or EOD masking the masks do not depend on the tokens, so one copy serves every sample.
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self._cached_masks_and_position_ids = None
        self._pad_token_id = _padding_id(config)
        self._check_indices()
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        if dataset_path is None:
            # The builder passes None when the config fell back to mock data because it was given no blend.
            raise ValueError(
                "GPTDataset needs a dataset path prefix, but the config has no blend or blend_per_split, so it "
                "is a mock-data config (mock=True): give blend=([prefix, ...], weights) or build MockGPTDataset"
            )
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + [
            "add_extra_token_to_sequence",
            "drop_last_partial_validation_sequence",
        ]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """Sample `idx`; `idx=None` gives a padding sample (sample 0 with an all-zero loss mask)."""
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text)
        if self.config.add_extra_token_to_sequence:
            # The sample holds one extra token, so every input position has a real next-token label.
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            # No extra token: the last position has no next token, so its label is padding (masked below).
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        attention_mask, loss_mask, position_ids = self._masks_and_position_ids(tokens)
        loss_mask[labels == self._pad_token_id] = 0.0
        # Padding ids may be negative; the embedding must still be able to look them up.
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask.zero_()

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _masks_and_position_ids(
        self, tokens: torch.Tensor
    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Masks and positions; without resets or EOD masking they are the same for every sample, so cached."""
        if self.masks_and_position_ids_are_cacheable and self._cached_masks_and_position_ids is not None:
            attention_mask, loss_mask, position_ids = self._cached_masks_and_position_ids
            # A copy: __getitem__ zeroes padding labels in loss_mask in place, which would corrupt the cached one.
            return attention_mask, loss_mask.clone(), position_ids
        result = _get_ltor_masks_and_position_ids(
            tokens,
            self.config.tokenizer.eod,
            self.config.reset_position_ids,
            self.config.reset_attention_mask,
            self.config.eod_mask_loss,
            self.config.create_attention_mask,
        )
        if self.masks_and_position_ids_are_cacheable:
            self._cached_masks_and_position_ids = result
            return result[0], result[1].clone(), result[2]
        return result

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        """The `sequence_length + extra` tokens of sample `idx` (padded) and the ids of the documents they span."""
        extra = int(self.config.add_extra_token_to_sequence)
        # Samples are read through the shuffle index; sample_index rows stay in document order.
        sample = int(self.shuffle_index[idx])
        begin_position, begin_offset = (int(value) for value in self.sample_index[sample])
        end_position, end_offset = (int(value) for value in self.sample_index[sample + 1])

        document_ids = [int(self.document_index[p]) for p in range(begin_position, end_position + 1)]
        if begin_position == end_position:
            # + extra: the token past the sample's end, which becomes its last label.
            parts = [self.dataset.get(document_ids[0], offset=begin_offset, length=end_offset - begin_offset + extra)]
        else:
            parts = [self.dataset.get(document_ids[0], offset=begin_offset)]
            parts += [self.dataset.get(document_id) for document_id in document_ids[1:-1]]
            parts.append(self.dataset.get(document_ids[-1], offset=0, length=end_offset + extra))

        missing = self.config.sequence_length + extra - sum(len(part) for part in parts)
        if missing > 0:
            parts.append(np.full(missing, self._pad_token_id, dtype=np.int64))
        return np.concatenate(parts, dtype=np.int64), np.array(document_ids, dtype=np.int64)

    def _check_indices(self) -> None:
        count = len(self.dataset.sequence_lengths)
        if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= count):
            raise ValueError(
                f"indexed_indices for the {self.index_split.name} split of {self.dataset_path} must lie in "
                f"[0, {count}), got [{self.indices.min()}, {self.indices.max()}]"
            )

    def _cache_directory(self) -> Optional[str]:
        if self.config.path_to_cache:
            return self.config.path_to_cache
        if self.dataset_path is None:
            return None
        return os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")

    def _build_document_sample_shuffle_indices(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Load the three indices from the cache, or build them (Megatron-LM's algorithm, spec d4)."""
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        sequence_lengths = self.dataset.sequence_lengths
        tokens_per_epoch = int(np.sum(sequence_lengths[self.indices], dtype=np.int64))
        if tokens_per_epoch == 0:
            raise ValueError(
                f"the {self.index_split.name} split of {self.dataset_path} holds {tokens_per_epoch} tokens in "
                f"{len(self.indices)} sequences, too few for one sample: give this split a larger share in "
                f"split ({self.config.split!r}) or use more data"
            )
        num_epochs = self._num_epochs(tokens_per_epoch)
        separate_final_epoch = False
        # When little of the last epoch is needed, it is shuffled apart and its samples come last: the full
        # epochs are then used completely, and the partial one still draws from every document.
        if num_epochs > 1:
            samples_before_final_epoch = count_samples(
                (num_epochs - 1) * tokens_per_epoch, sequence_length, True, extra
            )
            samples_in_final_epoch = self.num_samples - samples_before_final_epoch
            samples_per_epoch = count_samples(tokens_per_epoch, sequence_length, True, extra)
            separate_final_epoch = samples_in_final_epoch < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch)
        # Validation keeps its trailing partial sequence (padded) unless told to drop it.
        drop_last = self.index_split != Split.valid or self.config.drop_last_partial_validation_sequence

        def build() -> Dict[str, np.ndarray]:
            log_single_rank(
                logger,
                logging.INFO,
                f"building {type(self).__name__} {self.index_split.name} indices: {num_epochs} epoch(s) of "
                f"{tokens_per_epoch} tokens, separate final epoch: {separate_final_epoch}",
            )
            # One generator from the configured seed: every rank builds (or loads) identical indices.
            rng = np.random.RandomState(self.config.random_seed)
            document_index = build_document_index(self.indices, num_epochs, rng, separate_final_epoch)
            sample_index = build_sample_index(
                sequence_lengths, document_index, sequence_length, num_epochs, tokens_per_epoch, drop_last, extra
            )
            total_samples = sample_index.shape[0] - 1
            first_shuffled = samples_before_final_epoch if separate_final_epoch else total_samples
            shuffle_index = build_shuffle_index(first_shuffled, total_samples, rng)
            return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

        cache_directory = self._cache_directory()
        paths = None
        if cache_directory is not None:
            paths = cache_file_paths(
                cache_directory, self.unique_description_hash, type(self).__name__, self.index_split.name, _INDEX_NAMES
            )
        arrays, self.built_anew_on_cache_miss = load_or_build(paths, self.unique_description, build, _check_indices)
        return arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]

    def _num_epochs(self, tokens_per_epoch: int) -> int:
        """Epochs needed for `num_samples` samples of `sequence_length` tokens plus the extra token (at least 1)."""
        if self.num_samples is None:
            return 1
        tokens_needed = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        # Ceiling division.
        return max(1, -(-tokens_needed // tokens_per_epoch))


def _check_indices(arrays: Dict[str, np.ndarray], paths: Dict[str, str]) -> None:
    """Cached indices must fit together; anything else is a damaged or foreign cache."""
    sample_index, shuffle_index = arrays["sample_index"], arrays["shuffle_index"]
    if sample_index.ndim != 2 or sample_index.shape[1] != 2 or sample_index.shape[0] < 1:
        raise IndexCacheError(
            f"{paths['sample_index']} has shape {sample_index.shape}, expected [num_samples + 1, 2]; delete the "
            f"cache files next to it and rerun"
        )
    if arrays["document_index"].ndim != 1 or shuffle_index.shape != (sample_index.shape[0] - 1,):
        raise IndexCacheError(
            f"{paths['shuffle_index']} has shape {shuffle_index.shape} but {paths['sample_index']} describes "
            f"{sample_index.shape[0] - 1} samples; delete these cache files and rerun"
        )


def _pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, or -1 when it has none (Megatron-LM's fallback)."""
    try:
        pad = tokenizer.pad
    except Exception:  # tokenizers without padding raise all sorts of errors here
        return _PAD_TOKEN_ID
    return _PAD_TOKEN_ID if pad is None else int(pad)


def _get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Left-to-right attention mask (True = masked), loss mask and position ids for the tokens `data` [S].

    A document ends at an EOD token: with `reset_attention_mask` tokens after it cannot see it or anything before
    it, and with `reset_position_ids` positions restart at 0 right after it.
    """
    seq_length = data.numel()
    is_eod = data == eod_token
    loss_mask = torch.ones(seq_length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    positions = torch.arange(seq_length, dtype=torch.long)
    # First position of each token's document: one past the last EOD strictly before it.
    after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
    document_start = torch.cat([positions.new_zeros(1), torch.cummax(after_eod, dim=0).values[:-1]])
    position_ids = positions - document_start if reset_position_ids else positions

    attention_mask = None
    if create_attention_mask:
        # Query q sees keys [start of its document (or 0), q]; everything else is masked.
        keys = positions[None, :]
        masked = keys > positions[:, None]
        if reset_attention_mask:
            masked |= keys < document_start[:, None]
        attention_mask = masked.unsqueeze(0)
    return attention_mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Synthetic documents for `--mock-data`: Megatron-LM's (100000 documents, lengths from seed 0).

    Document `i` is `1, 2, ..., length - 1` followed by the EOD token. With a tokenizer whose `vocab_size` is below
    4096 the ids wrap into `[1, vocab_size - 2]`, so small test vocabularies work (Megatron-LM's ids reach 4094).
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=np.int32)
        vocab_size = getattr(tokenizer, "vocab_size", None)
        self._wrap = None
        if isinstance(vocab_size, int) and 3 <= vocab_size < self.max_sequence_length:
            self._wrap = vocab_size - 2

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        body = np.arange(1, length, dtype=np.int64)
        if self._wrap is not None:
            body = (body - 1) % self._wrap + 1
        return np.concatenate([body, [self.tokenizer.eod]]).astype(np.int64)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset; needs `config.mock`."""

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: np.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs config.mock=True (no blend and no blend_per_split)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)

"""The index algorithms behind GPTDataset and BlendedDataset, in numpy (Megatron-LM compiles C++ for these).

Each function reproduces Megatron-LM's result exactly: the same numpy RandomState calls in the same order for the
shuffles, the same integer arithmetic for the sample index and the same float64 arithmetic for the blending greedy.
That is what lets a run resume from a Megatron-LM checkpoint, or vice versa, and see the same samples in the same
order. The sample-index builder is vectorised (cumulative sums + searchsorted) and works in chunks of documents, so
its temporary memory stays bounded however large the corpus.
"""

from array import array
from typing import List, Optional, Sequence, Tuple

import numpy as np

_DOCUMENTS_PER_CHUNK = 1 << 20


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """The split's document ids repeated `num_epochs` times, shuffled with `rng` (int32).

    With `separate_final_epoch`, the first `num_epochs - 1` epochs are shuffled together and the final epoch on its
    own (in that order, with the same `rng`), so the final partial epoch draws from every document.
    """
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def count_samples(total_tokens: int, sequence_length: int, drop_last: bool, add_extra_token: int) -> int:
    """Samples in `total_tokens` tokens when consecutive samples overlap by `add_extra_token` tokens."""
    usable = total_tokens - add_extra_token
    if drop_last:
        return usable // sequence_length
    return -(-usable // sequence_length)


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: int = 1,
) -> np.ndarray:
    """Start of every sample as `(position in document_index, token offset)`, shape `[num_samples + 1, 2]`.

    Row `s` marks where sample `s` begins and row `s + 1` where it ends; samples overlap by `add_extra_token`
    tokens (the label shift). This equals Megatron-LM's `build_sample_idx` loop: row `s` (s >= 1) is the document
    holding token `s * sequence_length + add_extra_token - 1` of the shuffled token stream, i.e. the first position
    whose cumulative length reaches `s * sequence_length + add_extra_token`, with the offset
    `s * sequence_length` minus the tokens before that document. A final partial sample (when not dropped) ends at
    the last document, `add_extra_token` tokens before its end, as the loop does.
    """
    total_tokens = int(num_epochs) * int(tokens_per_epoch)
    num_samples = count_samples(total_tokens, sequence_length, drop_last_partial_sequence, add_extra_token)
    if num_samples < 0:
        raise ValueError(f"{total_tokens} tokens cannot hold a sample of {sequence_length} + {add_extra_token} tokens")
    largest_length = int(sequence_lengths.max()) if len(sequence_lengths) else 0
    dtype = np.int32 if max(len(document_index), largest_length) <= np.iinfo(np.int32).max else np.int64
    sample_index = np.zeros((num_samples + 1, 2), dtype=dtype)

    tokens_before_chunk = 0
    for chunk_begin in range(0, len(document_index), _DOCUMENTS_PER_CHUNK):
        chunk = document_index[chunk_begin : chunk_begin + _DOCUMENTS_PER_CHUNK]
        cumulative = np.cumsum(sequence_lengths[chunk], dtype=np.int64)
        cumulative += tokens_before_chunk
        tokens_after_chunk = int(cumulative[-1])
        # Samples whose end token `s * S + x` lies in (tokens_before_chunk, tokens_after_chunk].
        first = max(1, (tokens_before_chunk - add_extra_token) // sequence_length + 1)
        last = min(num_samples, (tokens_after_chunk - add_extra_token) // sequence_length)
        if first <= last:
            starts = np.arange(first, last + 1, dtype=np.int64) * sequence_length
            positions = np.searchsorted(cumulative, starts + add_extra_token, side="left")
            tokens_before_document = np.concatenate(([tokens_before_chunk], cumulative[:-1]))[positions]
            sample_index[first : last + 1, 0] = positions + chunk_begin
            sample_index[first : last + 1, 1] = starts - tokens_before_document
        tokens_before_chunk = tokens_after_chunk

    partial_end = num_samples * sequence_length + add_extra_token
    if num_samples > 0 and partial_end > total_tokens:
        last_position = len(document_index) - 1
        sample_index[num_samples, 0] = last_position
        sample_index[num_samples, 1] = sequence_lengths[document_index[last_position]] - add_extra_token
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of `range(total_size)`: the first `num_samples` ids shuffled, then the rest shuffled apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's greedy blend: sample `k` comes from `argmax_i(w_i * max(k, 1) - count_i)`, first index on ties.

    Returns `(dataset_index int16[size], dataset_sample_index int64[size])`. The float64 products are computed
    exactly as Megatron-LM's C++ does, so near-ties break the same way. This greedy is sequential by nature; the
    loop is kept tight (about half a microsecond per sample for a few datasets) and its result is cached.
    """
    weights = [float(weight) for weight in weights]
    counts = [0] * len(weights)
    others = range(1, len(weights))
    chosen = array("h", bytes(2 * size))
    for k in range(size):
        scale = k if k > 1 else 1.0
        best, best_error = 0, weights[0] * scale - counts[0]
        for i in others:
            error = weights[i] * scale - counts[i]
            if error > best_error:
                best, best_error = i, error
        chosen[k] = best
        counts[best] += 1
    dataset_index = np.frombuffer(chosen, dtype=np.int16).copy()
    return dataset_index, _running_counts(dataset_index, len(weights))


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Blend every sample of every dataset exactly once, interleaved in proportion to the dataset sizes.

    The greedy of `build_blending_indices` with weights `size_i / total`, over the datasets not yet used up.
    """
    sizes = [int(size) for size in sizes]
    total = sum(sizes)
    weights = [size / float(total) if total else 0.0 for size in sizes]
    counts = [0] * len(sizes)
    unspent: List[int] = [i for i, size in enumerate(sizes) if size > 0]
    chosen = array("h", bytes(2 * total))
    for k in range(total):
        scale = k if k > 1 else 1.0
        best: Optional[int] = None
        best_error = 0.0
        for i in unspent:
            error = weights[i] * scale - counts[i]
            if best is None or error > best_error:
                best, best_error = i, error
        chosen[k] = best
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    dataset_index = np.frombuffer(chosen, dtype=np.int16).copy()
    return dataset_index, _running_counts(dataset_index, len(sizes))


def _running_counts(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each position, how many earlier positions chose the same dataset (the sample id within that dataset)."""
    order = np.argsort(dataset_index, kind="stable")
    per_dataset = np.bincount(dataset_index, minlength=num_datasets)
    first_position = np.concatenate(([0], np.cumsum(per_dataset)[:-1]))
    running = np.empty(len(dataset_index), dtype=np.int64)
    running[order] = np.arange(len(dataset_index), dtype=np.int64) - np.repeat(first_position, per_dataset)
    return running

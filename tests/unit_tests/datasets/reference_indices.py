"""Straightforward reference implementations of Megatron-LM's index algorithms (spec d4, d5), for the tests.

Plain Python loops that follow the spec text line by line; only the shuffles use numpy's RandomState, which the
spec prescribes, applied to Python lists (so its ndarray fast path in the library is checked against the generic
path too).
"""

import math

import numpy as np


def reference_num_epochs(tokens_per_epoch, num_samples, sequence_length, extra):
    num_epochs = 1
    if num_samples is None:
        return num_epochs
    while num_epochs * tokens_per_epoch < num_samples * sequence_length + extra:
        num_epochs += 1
    return num_epochs


def reference_gpt_indices(sizes, indices, num_samples, sequence_length, extra, seed, drop_last=True):
    """Returns (document_index, sample_index rows, shuffle_index, separate_final_epoch) as Python lists."""
    tokens_per_epoch = 0
    for i in indices:
        tokens_per_epoch += int(sizes[i])
    num_epochs = reference_num_epochs(tokens_per_epoch, num_samples, sequence_length, extra)

    if num_epochs == 1:
        separate = False
    else:
        samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // sequence_length
        samples_final = num_samples - samples_sans_final
        samples_per_epoch = (tokens_per_epoch - extra) // sequence_length
        separate = samples_final < int(0.80 * samples_per_epoch)

    rng = np.random.RandomState(seed)

    def shuffled_epochs(epochs):
        documents = []
        for _ in range(epochs):
            for i in indices:
                documents.append(int(i))
        rng.shuffle(documents)
        return documents

    if not separate:
        document_index = shuffled_epochs(num_epochs)
    else:
        document_index = shuffled_epochs(num_epochs - 1) + shuffled_epochs(1)

    total_tokens = num_epochs * tokens_per_epoch
    if drop_last:
        num_rows = (total_tokens - extra) // sequence_length
    else:
        num_rows = math.ceil((total_tokens - extra) / sequence_length)
    rows = [(0, 0)]
    i, offset = 0, 0
    while len(rows) <= num_rows:
        remaining = sequence_length + extra
        while remaining != 0:
            doc_len = int(sizes[document_index[i]]) - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - extra
                remaining = 0
            else:
                if i == len(document_index) - 1:
                    offset = int(sizes[document_index[i]]) - extra
                    break
                i += 1
                offset = 0
        rows.append((i, offset))

    total = len(rows) - 1
    if separate:
        first = list(range(samples_sans_final))
        rng.shuffle(first)
        last = list(range(samples_sans_final, total))
        rng.shuffle(last)
        shuffle_index = first + last
    else:
        shuffle_index = list(range(total))
        rng.shuffle(shuffle_index)
    return document_index, rows, shuffle_index, separate


def reference_blending(weights, size):
    counts = [0] * len(weights)
    dataset_index, sample_index = [], []
    for k in range(size):
        errors = [weights[i] * max(k, 1) - counts[i] for i in range(len(weights))]
        best = errors.index(max(errors))  # the first index wins ties
        dataset_index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, sample_index


def reference_exhaustive_blending(sizes):
    total = sum(sizes)
    weights = [size / total for size in sizes]
    counts = [0] * len(sizes)
    dataset_index, sample_index = [], []
    for k in range(total):
        unspent = [i for i in range(len(sizes)) if counts[i] < sizes[i]]
        errors = [weights[i] * max(k, 1) - counts[i] for i in unspent]
        best = unspent[errors.index(max(errors))]
        dataset_index.append(best)
        sample_index.append(counts[best])
        counts[best] += 1
    return dataset_index, sample_index

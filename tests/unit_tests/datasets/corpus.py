"""Small on-disk corpora and a stand-in tokenizer for the dataset tests."""

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

EOD = 0
PAD = 1


class ToyTokenizer:
    """The part of a tokenizer the datasets use: `eod`, `pad` and the cache-description identifiers."""

    eod = EOD
    pad = PAD
    unique_identifiers = {"class": "ToyTokenizer"}


class TokenizerWithoutPad:
    eod = EOD


def write_corpus(prefix, documents, dtype=np.uint16):
    """Write `documents` (lists of token ids, one sequence each) as `{prefix}.bin/.idx`; return the prefix."""
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    for document in documents:
        builder.add_document(np.asarray(document, dtype=np.int64), [len(document)])
    builder.finalize(get_idx_path(prefix))
    return prefix


def random_documents(seed, count, max_length=40, allow_empty=True):
    """`count` documents of random length, tokens in [2, 1000), each ending in EOD (empty ones when allowed)."""
    rng = np.random.default_rng(seed)
    documents = []
    for _ in range(count):
        length = int(rng.integers(0 if allow_empty else 1, max_length))
        body = rng.integers(2, 1000, max(length - 1, 0)).tolist()
        documents.append(body + [EOD] if length else [])
    return documents

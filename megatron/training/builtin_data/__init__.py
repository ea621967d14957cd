"""The built-in corpus and tokenizer: Shakespeare's plays and a byte-level BPE trained on them.

They let the quickstart train on real text with no download. See README.md in this directory for the source,
licence and how the files were made. Use with `--tokenizer-type GPT2BPETokenizer --vocab-file vocab_file()
--merge-file merge_file() --data-path data_prefix()`.
"""

import gzip
import json
import os
from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent

VOCAB_SIZE = 8192
EOD_TOKEN = "<|endoftext|>"
JSON_KEY = "text"
# Named as tools/preprocess_data.py names its output for `--output-prefix shakespeare --json-keys text`.
DATA_PREFIX_NAME = "shakespeare_text_document"


def vocab_file():
    """Path of the built-in tokenizer's GPT-2-style `vocab.json`."""
    return str(BUILTIN_DIR / "vocab.json")


def merge_file():
    """Path of the built-in tokenizer's GPT-2-style `merges.txt`."""
    return str(BUILTIN_DIR / "merges.txt")


def corpus_jsonl():
    """Path of the built-in corpus, gzip-compressed JSON lines with the text under `text`."""
    return str(BUILTIN_DIR / "shakespeare.jsonl.gz")


def data_prefix():
    """Prefix (path without `.bin`/`.idx`) of the shipped, already tokenized corpus."""
    return str(BUILTIN_DIR / DATA_PREFIX_NAME)


def build_tokenizer():
    """The built-in tokenizer, as `--tokenizer-type GPT2BPETokenizer` with the shipped files builds it."""
    from megatron.core.tokenizers import GPT2BPETokenizer

    return GPT2BPETokenizer(vocab_file(), merge_file())


def ensure_preprocessed(cache_dir=None):
    """Return the prefix of the tokenized built-in corpus, rebuilding its `.bin/.idx` if they are missing.

    The shipped files are used when both exist. Otherwise the corpus is tokenized again with the shipped tokenizer
    (EOD appended to each document, as `preprocess_data.py --append-eod`) into `cache_dir`, or into this package
    directory when `cache_dir` is None; pass a writable `cache_dir` when the package is installed read-only.
    Both files are written under temporary names and renamed into place, the `.idx` last, so a reader that finds
    the `.idx` also finds a complete `.bin`, and concurrent callers never see a partial file.
    """
    shipped = data_prefix()
    if _exists(shipped):
        return shipped
    prefix = str(Path(cache_dir) / DATA_PREFIX_NAME) if cache_dir is not None else shipped
    if not _exists(prefix):
        _write_indexed_corpus(corpus_jsonl(), prefix)
    return prefix


def _exists(prefix):
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _write_indexed_corpus(corpus_path, prefix):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    tokenizer = build_tokenizer()
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    # The builder writes under temporary names and renames into place at finalize, the .idx last.
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=DType.optimal_dtype(tokenizer.vocab_size))
    try:
        for text in _read_corpus_texts(corpus_path):
            tokens = tokenizer.tokenize(text) + [tokenizer.eod]
            builder.add_document(tokens, [len(tokens)])
        builder.finalize(get_idx_path(prefix))
    except BaseException:
        builder.abort()
        raise


def _read_corpus_texts(corpus_path):
    with gzip.open(corpus_path, "rt", encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            try:
                yield json.loads(line)[JSON_KEY]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{corpus_path}:{line_number}: not a JSON object with a {JSON_KEY!r} string "
                                 f"({error}); restore the file from the package or rerun "
                                 f"tools/make_builtin_corpus.py") from None

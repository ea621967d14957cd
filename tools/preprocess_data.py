"""Tokenize JSON-lines text into Megatron `.bin/.idx` datasets (Megatron-LM's `tools/preprocess_data.py`).

Each input line is one JSON object; the strings under `--json-keys` are tokenized (one sequence per document, or
one per sentence with `--split-sentences`) and written to `{output_prefix}_{key}_document.bin/.idx`
(`_sentence` when splitting). Example:

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

The input is streamed: lines go to a pool of `--workers` processes in small chunks and come back in order, so
memory stays bounded however large the input is. `--input` may be a file (`.gz` too), a directory of `.json` /
`.jsonl` files, or a glob. A malformed line (invalid JSON, not an object, a missing or non-string key) is reported
with its file and line number and skipped; `--strict` makes it fatal. `--partitions N` splits the documents into N
groups (round robin, or contiguous blocks with `--keep-sequential-samples`) processed in parallel and merged at the
end, in partition order. Nothing from the training stack is imported: only the indexed dataset writer and the
tokenizers.
"""

import argparse
import glob
import gzip
import json
import math
import multiprocessing
import os
import queue
import re
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import numpy as np  # noqa: E402

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.core.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402

INPUT_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
ENCODE_CHUNK_SIZE = 32  # lines per task sent to a worker, as Megatron-LM
MAX_REPORTED_MALFORMED_LINES = 20
NULL_TOKENIZER_DEFAULT_VOCAB_SIZE = 786  # Megatron-LM's --vocab-size default in this tool


class MalformedInputError(ValueError):
    """A malformed input line under `--strict`."""


# --- sentence splitting -------------------------------------------------------------------------------------------


class RegexSentenceSplitter:
    """Split after `.`, `!` or `?` (and any closing quotes or brackets) followed by whitespace.

    The fallback when nltk's punkt is unavailable: it does not know abbreviations ("Mr. Smith" is split).
    With `keep_newlines` the whitespace after a sentence stays at its end, so newlines survive tokenization.
    """

    _SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(\s+)")

    def __init__(self, keep_newlines: bool):
        self.keep_newlines = keep_newlines

    def __call__(self, text: str):
        sentences, start = [], 0
        for match in self._SENTENCE_END.finditer(text):
            end = match.end() if self.keep_newlines else match.start(1)
            sentences.append(text[start:end])
            start = match.end()
        sentences.append(text[start:])
        return [sentence for sentence in sentences if sentence]


def load_punkt(lang: str):
    """nltk's pretrained punkt tokenizer for `lang`; raises ImportError or LookupError when unavailable.

    The data is never downloaded here; install it once with `python -m nltk.downloader punkt_tab`.
    """
    from nltk.tokenize import punkt

    if hasattr(punkt, "PunktTokenizer"):  # nltk >= 3.8.2 reads the punkt_tab data
        return punkt.PunktTokenizer(lang)
    import nltk

    return nltk.data.load(f"tokenizers/punkt/{lang}.pickle")


def punkt_splitter(pretrained, keep_newlines: bool):
    """A sentence splitter from a punkt tokenizer; with `keep_newlines` the whitespace (newlines included) that
    follows a sentence end stays with that sentence instead of being dropped, as Megatron-LM's option does."""
    if not keep_newlines:
        return pretrained.tokenize
    from nltk.tokenize import punkt

    class KeepNewlinesLanguageVars(punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # the whitespace after it belongs to this sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or the next token
            ))"""

    return punkt.PunktSentenceTokenizer(train_text=pretrained._params, lang_vars=KeepNewlinesLanguageVars()).tokenize


def choose_sentence_splitter(lang: str) -> str:
    """'punkt' when nltk and its punkt data for `lang` are installed, else 'regex' (with a warning)."""
    try:
        load_punkt(lang)
        return "punkt"
    except ImportError:
        reason = "nltk is not installed (pip install nltk)"
    except LookupError:
        reason = f"nltk's punkt data for {lang!r} is not installed (python -m nltk.downloader punkt_tab)"
    print(
        f"WARNING: {reason}; splitting sentences with a simple regex that does not know abbreviations", file=sys.stderr
    )
    return "regex"


def build_sentence_splitter(kind: str, lang: str, keep_newlines: bool):
    if kind == "punkt":
        return punkt_splitter(load_punkt(lang), keep_newlines)
    return RegexSentenceSplitter(keep_newlines)


# --- encoding (runs in the worker processes) ------------------------------------------------------------------------


class DocumentEncoder:
    """Turns one raw input line into token ids per JSON key, or into the reason the line is malformed."""

    def __init__(self, args, splitter_kind=None):
        self.json_keys = args.json_keys
        self.append_eod = args.append_eod
        self.tokenizer = build_tokenizer(args)
        self.split = build_sentence_splitter(splitter_kind, args.lang, args.keep_newlines) if splitter_kind else None

    def encode(self, item):
        """`(file_index, line_number, raw_line)` -> `(file_index, line_number, n_bytes, documents, error)` where
        `documents` maps each key to `(token ids, sequence lengths)` and `error` is None or what is wrong."""
        file_index, line_number, raw_line = item
        try:
            documents = self._encode_line(raw_line)
            return file_index, line_number, len(raw_line), documents, None
        except MalformedInputError as error:
            return file_index, line_number, len(raw_line), None, str(error)

    def _encode_line(self, raw_line: bytes):
        try:
            record = json.loads(raw_line)
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            raise MalformedInputError(f"not valid JSON ({error})") from None
        if not isinstance(record, dict):
            raise MalformedInputError(f"expected a JSON object, got {type(record).__name__}")
        documents = {}
        for key in self.json_keys:
            if key not in record:
                raise MalformedInputError(f"missing key {key!r} (choose the fields with --json-keys)")
            documents[key] = self._encode_text(key, record[key])
        return documents

    def _encode_text(self, key, value):
        if isinstance(value, str):
            sentences = self.split(value) if self.split else [value]
        elif isinstance(value, list) and all(isinstance(sentence, str) for sentence in value):
            sentences = value  # already split into sentences, as Megatron-LM accepts
        else:
            raise MalformedInputError(f"key {key!r} holds {type(value).__name__}, expected a string")
        ids, lengths = [], []
        for sentence in sentences:
            try:
                sentence_ids = self.tokenizer.tokenize(sentence)
            except ValueError as error:  # e.g. NullTokenizer given words
                raise MalformedInputError(f"key {key!r}: {error}") from None
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
            lengths[-1] += 1
        return np.asarray(ids, dtype=np.int64), lengths


_worker_encoder = None


def _init_worker(args, splitter_kind):
    global _worker_encoder
    _worker_encoder = DocumentEncoder(args, splitter_kind)


def _encode_in_worker(item):
    return _worker_encoder.encode(item)


# --- input ----------------------------------------------------------------------------------------------------------


def resolve_input_files(pattern: str):
    """The input files: the file itself, the JSON-lines files of a directory, or a glob's matches; sorted."""
    if os.path.isdir(pattern):
        paths = [os.path.join(pattern, name) for name in os.listdir(pattern) if name.endswith(INPUT_SUFFIXES)]
    elif os.path.isfile(pattern):
        paths = [pattern]
    else:
        paths = glob.glob(pattern)
    paths = sorted(path for path in paths if os.path.isfile(path))
    if not paths:
        raise FileNotFoundError(
            f"--input {pattern}: no input files (give a JSON-lines file, a directory of {'/'.join(INPUT_SUFFIXES)} "
            f"files, or a glob)"
        )
    return paths


def _open_binary(path):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def iterate_documents(paths, max_documents=None):
    """Yield `(document_ordinal, file_index, line_number, raw_line)` for every non-blank line, in input order."""
    ordinal = 0
    for file_index, path in enumerate(paths):
        line_number = 0
        try:
            with _open_binary(path) as lines:
                for line_number, line in enumerate(lines, start=1):
                    if not line.strip():
                        continue
                    if max_documents is not None and ordinal >= max_documents:
                        return
                    yield ordinal, file_index, line_number, line
                    ordinal += 1
        except (OSError, EOFError) as error:  # e.g. a truncated or mislabeled .gz
            raise ValueError(f"{path}: cannot read past line {line_number} ({error})") from None


def partition_documents(paths, args, partition: int, partition_size):
    """The `(file_index, line_number, raw_line)` items that belong to `partition`."""
    for ordinal, file_index, line_number, line in iterate_documents(paths, args.max_documents):
        owner = ordinal // partition_size if partition_size else ordinal % args.partitions
        if owner == partition:
            yield file_index, line_number, line


# --- one partition: encode and write -------------------------------------------------------------------------------


@dataclass
class Progress:
    """Counts for the progress lines and the final summary."""

    label: str
    log_interval: int
    started: float = field(default_factory=time.time)
    documents: int = 0
    tokens: int = 0
    bytes_read: int = 0
    malformed: int = 0

    def line(self) -> str:
        elapsed = max(time.time() - self.started, 1e-9)
        return (
            f"{self.label}processed {self.documents} documents, {self.tokens} tokens, "
            f"{self.bytes_read / 1e6:.1f} MB in {elapsed:.1f} s ({self.documents / elapsed:.1f} docs/s, "
            f"{self.bytes_read / 1e6 / elapsed:.2f} MB/s, {self.tokens / elapsed:.0f} tokens/s)"
        )

    def add(self, n_bytes, documents):
        self.bytes_read += n_bytes
        if documents is not None:
            self.documents += 1
            self.tokens += sum(len(ids) for ids, _ in documents.values())
            if self.documents % self.log_interval == 0:
                print(self.line(), file=sys.stderr, flush=True)


def output_prefix_for(prefix: str, key: str, level: str) -> str:
    return f"{prefix}_{key}_{level}"


def encode_partition(args, paths, partition: int, partition_size, output_prefix, splitter_kind, token_dtype):
    """Encode one partition's documents into `{output_prefix}_{key}_{level}.bin/.idx`; returns its Progress."""
    label = f"[partition {partition}] " if args.partitions > 1 else ""
    progress = Progress(label, args.log_interval)
    level = "sentence" if args.split_sentences else "document"
    builders = {
        key: IndexedDatasetBuilder(get_bin_path(output_prefix_for(output_prefix, key, level)), dtype=token_dtype)
        for key in args.json_keys
    }
    workers = args.workers // args.partitions
    items = partition_documents(paths, args, partition, partition_size)
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(args, splitter_kind))
            results = pool.imap(_encode_in_worker, items, ENCODE_CHUNK_SIZE)
        else:
            results = map(DocumentEncoder(args, splitter_kind).encode, items)
        for file_index, line_number, n_bytes, documents, error in results:
            if error is not None:
                _report_malformed(args, progress, f"{paths[file_index]}:{line_number}: {error}")
            else:
                for key, (ids, lengths) in documents.items():
                    builders[key].add_document(ids, lengths)
            progress.add(n_bytes, documents)
        for key, builder in builders.items():
            builder.finalize(get_idx_path(output_prefix_for(output_prefix, key, level)))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return progress


def _report_malformed(args, progress, message):
    if args.strict:
        raise MalformedInputError(f"{message} (--strict stops at the first malformed line)")
    progress.malformed += 1
    if progress.malformed <= MAX_REPORTED_MALFORMED_LINES:
        print(f"WARNING: skipping malformed line {message}", file=sys.stderr)
    if progress.malformed == MAX_REPORTED_MALFORMED_LINES:
        print("WARNING: further malformed lines are skipped without a message", file=sys.stderr)


def _partition_process(result_queue, *partition_args):
    try:
        progress = encode_partition(*partition_args)
        result_queue.put((partition_args[2], progress, None))
    except Exception as error:  # reported by the parent, which owns the exit status
        message = str(error) if isinstance(error, (ValueError, OSError)) else f"{type(error).__name__}: {error}"
        result_queue.put((partition_args[2], None, message))


# --- the whole run --------------------------------------------------------------------------------------------------


def count_documents(paths, max_documents):
    return sum(1 for _ in iterate_documents(paths, max_documents))


def run(args):
    """Preprocess per `args`; returns the summed Progress. Raises on bad input (the message says what to fix)."""
    paths = resolve_input_files(args.input)
    tokenizer = build_tokenizer(args)
    if args.append_eod and tokenizer.eod < 0:
        raise ValueError(f"--append-eod: the {args.tokenizer_type} tokenizer has no end-of-document token")
    token_dtype = DType.optimal_dtype(tokenizer.vocab_size)
    splitter_kind = choose_sentence_splitter(args.lang) if args.split_sentences else None
    level = "sentence" if args.split_sentences else "document"
    print(
        f"Tokenizing {len(paths)} file(s) with {args.tokenizer_type} (vocab size {tokenizer.vocab_size}, "
        f"{np.dtype(token_dtype).name} tokens), {args.workers} worker(s), {args.partitions} partition(s)",
        file=sys.stderr,
    )

    if args.partitions == 1:
        total = encode_partition(args, paths, 0, None, args.output_prefix, splitter_kind, token_dtype)
    else:
        total = _run_partitions(args, paths, level, splitter_kind, token_dtype)
    total.label = "done: "
    print(total.line() + (f"; skipped {total.malformed} malformed lines" if total.malformed else ""), file=sys.stderr)
    for key in args.json_keys:
        print(f"wrote {output_prefix_for(args.output_prefix, key, level)}.bin/.idx", file=sys.stderr)
    return total


def _run_partitions(args, paths, level, splitter_kind, token_dtype):
    partition_size = None
    if args.keep_sequential_samples:
        partition_size = max(1, math.ceil(count_documents(paths, args.max_documents) / args.partitions))
    prefixes = [f"{args.output_prefix}_partition{k}" for k in range(args.partitions)]
    total = Progress("", args.log_interval)
    result_queue = multiprocessing.Queue()
    processes = [
        multiprocessing.Process(
            target=_partition_process,
            args=(result_queue, args, paths, k, partition_size, prefixes[k], splitter_kind, token_dtype),
        )
        for k in range(args.partitions)
    ]
    try:
        for process in processes:
            process.start()
        results = sorted(_collect_results(result_queue, processes), key=lambda result: result[0])
        errors = [error for _, _, error in results if error is not None]
        if errors:
            raise RuntimeError("; ".join(errors))
        for _, progress, _ in results:
            total.documents += progress.documents
            total.tokens += progress.tokens
            total.bytes_read += progress.bytes_read
            total.malformed += progress.malformed
        for key in args.json_keys:
            final = output_prefix_for(args.output_prefix, key, level)
            builder = IndexedDatasetBuilder(get_bin_path(final), dtype=token_dtype)
            for prefix in prefixes:
                builder.add_index(output_prefix_for(prefix, key, level))
            builder.finalize(get_idx_path(final))
        return total
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
        for prefix in prefixes:
            for key in args.json_keys:
                for path in (
                    get_bin_path(output_prefix_for(prefix, key, level)),
                    get_idx_path(output_prefix_for(prefix, key, level)),
                ):
                    if os.path.exists(path):
                        os.remove(path)


def _collect_results(result_queue, processes):
    """One result per partition process; a process that dies without reporting is an error, not a hang."""
    results = []
    while len(results) < len(processes):
        try:
            results.append(result_queue.get(timeout=1.0))
        except queue.Empty:
            crashed = [k for k, process in enumerate(processes) if process.exitcode not in (None, 0)]
            if crashed:
                raise RuntimeError(f"partition {crashed[0]} exited with code {processes[crashed[0]].exitcode}")
    return results


# --- command line ---------------------------------------------------------------------------------------------------


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input", type=str, required=True, help="JSON-lines file (.gz allowed), a directory of them, or a glob"
    )
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON object")
    group.add_argument("--split-sentences", action="store_true", help="one sequence per sentence")
    group.add_argument(
        "--keep-newlines", action="store_true", help="keep the newlines between sentences when splitting"
    )
    group.add_argument("--strict", action="store_true", help="stop at the first malformed line instead of skipping")
    group.add_argument(
        "--max-documents",
        type=int,
        default=None,
        help="process only the first N documents (non-blank lines) of the input",
    )

    group = parser.add_argument_group(title="tokenizer")
    group.add_argument(
        "--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES, help="what type of tokenizer to use"
    )
    group.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="SentencePiece .model, HuggingFace directory/tokenizer.json, or TikTokenizer vocabulary",
    )
    group.add_argument("--vocab-file", type=str, default=None, help="path to the vocab file")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"NullTokenizer: ids 0..N-1 (default {NULL_TOKENIZER_DEFAULT_VOCAB_SIZE}, as "
        f"Megatron-LM); TikTokenizer: the whole vocabulary (default 2**17)",
    )
    group.add_argument("--merge-file", type=str, default=None, help="path to the BPE merge file")
    group.add_argument("--append-eod", action="store_true", help="append an end-of-document token to each document")
    group.add_argument("--lang", type=str, default="english", help="language of nltk's punkt sentence splitter")
    group.add_argument(
        "--tiktoken-pattern",
        type=str,
        default=None,
        choices=["v1", "v2"],
        help="TikTokenizer pre-tokenization pattern (default v2)",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="number of special token ids TikTokenizer reserves",
    )
    group.add_argument(
        "--tiktoken-special-tokens",
        type=str,
        nargs="+",
        default=None,
        help="TikTokenizer special tokens (must include <unk>, <s>, </s>)",
    )

    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix",
        type=str,
        required=True,
        help="path prefix of the output files, without the _{key}_{level}.bin/.idx suffix",
    )

    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True, help="number of worker processes to tokenize with")
    group.add_argument("--partitions", type=int, default=1, help="number of partitions to split the input into")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    group.add_argument(
        "--keep-sequential-samples",
        action="store_true",
        help="partition the documents in contiguous blocks so their order is kept",
    )
    args = parser.parse_args(argv)

    for flag, value in (
        ("--workers", args.workers),
        ("--partitions", args.partitions),
        ("--log-interval", args.log_interval),
    ):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.workers % args.partitions != 0:
        parser.error(
            f"--workers {args.workers} must be a multiple of --partitions {args.partitions} "
            f"(each partition gets workers / partitions processes)"
        )
    if args.max_documents is not None and args.max_documents < 1:
        parser.error(f"--max-documents must be at least 1, got {args.max_documents}")
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(output_dir):
        parser.error(f"--output-prefix {args.output_prefix}: directory {output_dir} does not exist")
    # Megatron-LM's default of 786 is meant for NullTokenizer; TikTokenizer keeps its own default instead of
    # failing on a vocabulary smaller than its 1000 special tokens.
    if args.vocab_size is None and args.tokenizer_type == "NullTokenizer":
        args.vocab_size = NULL_TOKENIZER_DEFAULT_VOCAB_SIZE
    # Settings the tokenizer builder reads that have no meaning here (as Megatron-LM's script sets them).
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.vocab_extra_ids = 0
    return args


def main(argv=None):
    run(get_args(argv))
    return 0


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)

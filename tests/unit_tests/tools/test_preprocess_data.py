"""tools/preprocess_data.py and tools/merge_datasets.py, end to end as subprocesses, plus the sentence splitters."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.tokenizers import build_tokenizer
from tests.unit_tests.tokenizers.tiny_tokenizer_files import (
    TIKTOKEN_MERGES,
    write_gpt2_bpe_files,
    write_huggingface_dir,
    write_sentencepiece_model,
    write_tiktoken_file,
)
from tools.preprocess_data import RegexSentenceSplitter, choose_sentence_splitter, punkt_splitter

REPO_ROOT = Path(__file__).resolve().parents[3]
PREPROCESS = REPO_ROOT / "tools" / "preprocess_data.py"
MERGE = REPO_ROOT / "tools" / "merge_datasets.py"
DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog. It was not amused!",
    "Café naïve 東京.\nA second line? Yes.",
    "",
    "To be, or not to be: that is the question.",
    "Numbers 3.14 and 2718 too.",
]


def run_tool(script, *arguments):
    return subprocess.run(
        [sys.executable, str(script), *map(str, arguments)], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT
    )


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


def read_documents(prefix):
    """Each document as the concatenation of its sequences, plus the sequence lengths per document."""
    dataset = IndexedDataset(str(prefix))
    bounds = dataset.document_indices
    tokens = [[int(t) for s in dataset[int(a) : int(b)] for t in s] for a, b in zip(bounds[:-1], bounds[1:])]
    lengths = [dataset.sequence_lengths[int(a) : int(b)].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    return tokens, lengths, dataset


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_tokenizers")
    vocab_file, merge_file = write_gpt2_bpe_files(root / "gpt2")
    return SimpleNamespace(
        gpt2=["--vocab-file", vocab_file, "--merge-file", merge_file],
        hf=["--tokenizer-model", write_huggingface_dir(root / "hf")],
        sp=["--tokenizer-model", write_sentencepiece_model(root / "sp.model")],
        tiktoken=[
            "--tokenizer-model",
            write_tiktoken_file(root / "vocab.tiktoken"),
            "--vocab-size",
            1000 + 256 + len(TIKTOKEN_MERGES),
        ],
    )


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "corpus.jsonl", [{"text": text, "id": i} for i, text in enumerate(DOCUMENTS)])


def tokenizer_for(tokenizer_type, flags):
    args = {"tokenizer_type": tokenizer_type}
    for name, value in zip(flags[::2], flags[1::2]):
        args[name.lstrip("-").replace("-", "_")] = value
    return build_tokenizer(SimpleNamespace(**args))


@pytest.mark.parametrize(
    "tokenizer_type, files_attribute",
    [
        ("GPT2BPETokenizer", "gpt2"),
        ("HuggingFaceTokenizer", "hf"),
        ("SentencePieceTokenizer", "sp"),
        ("GPTSentencePieceTokenizer", "sp"),
        ("Llama2Tokenizer", "sp"),
        ("TikTokenizer", "tiktoken"),
    ],
)
def test_each_tokenizer_end_to_end(tmp_path, corpus, tokenizer_files, tokenizer_type, files_attribute):
    flags = getattr(tokenizer_files, files_attribute)
    result = run_tool(
        PREPROCESS,
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "out",
        "--tokenizer-type",
        tokenizer_type,
        *flags,
        "--append-eod",
        "--workers",
        1,
    )
    assert result.returncode == 0, result.stderr
    tokenizer = tokenizer_for(tokenizer_type, flags)
    encoded = [tokenizer.tokenize(text) for text in DOCUMENTS]
    expected = [ids + [tokenizer.eod] if ids else [] for ids in encoded]  # an empty document stays empty
    tokens, lengths, dataset = read_documents(tmp_path / "out_text_document")
    assert tokens == expected
    assert lengths == [[len(ids)] if ids else [] for ids in expected]  # one sequence per document
    assert dataset.dtype == np.uint16
    assert "done: processed 5 documents" in result.stderr


def test_null_tokenizer_end_to_end(tmp_path):
    corpus = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}, {"text": "70000 4"}])
    result = run_tool(
        PREPROCESS,
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "ids",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        100000,
        "--append-eod",
        "--workers",
        1,
    )
    assert result.returncode == 0, result.stderr
    tokens, _, dataset = read_documents(tmp_path / "ids_text_document")
    assert tokens == [[1, 2, 3, 100000], [70000, 4, 100000]]
    assert dataset.dtype == np.int32  # vocab size 100001 >= 65500


def test_vocab_size_defaults_per_tokenizer(tmp_path, tokenizer_files):
    corpus = write_jsonl(tmp_path / "ids.jsonl", [{"text": "785"}, {"text": "787"}])
    result = run_tool(
        PREPROCESS,
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "ids",
        "--tokenizer-type",
        "NullTokenizer",
        "--append-eod",
        "--workers",
        1,
    )
    assert result.returncode == 0, result.stderr
    assert "skipping malformed line" in result.stderr and "ids [787] are outside [0, 787)" in result.stderr
    assert read_documents(tmp_path / "ids_text_document")[0] == [[785, 786]]  # default 786 ids plus EOD 786

    # Megatron-LM's 786 is NullTokenizer's; TikTokenizer keeps its own 2**17 (so int32 tokens).
    result = run_tool(
        PREPROCESS,
        "--input",
        tmp_path / "ids.jsonl",
        "--output-prefix",
        tmp_path / "tik",
        "--tokenizer-type",
        "TikTokenizer",
        tokenizer_files.tiktoken[0],
        tokenizer_files.tiktoken[1],
        "--workers",
        1,
    )
    assert result.returncode == 0, result.stderr
    assert IndexedDataset(str(tmp_path / "tik_text_document")).dtype == np.int32


def gpt2_run(tokenizer_files, corpus, prefix, *extra):
    return run_tool(
        PREPROCESS,
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        *tokenizer_files.gpt2,
        "--append-eod",
        *extra,
    )


def test_workers_and_sequential_partitions_give_identical_bytes(tmp_path, corpus, tokenizer_files):
    runs = {
        "w1": ["--workers", 1],
        "w2": ["--workers", 2],
        "p2": ["--workers", 2, "--partitions", 2, "--keep-sequential-samples"],
    }
    for name, flags in runs.items():
        result = gpt2_run(tokenizer_files, corpus, tmp_path / name, *flags)
        assert result.returncode == 0, result.stderr
    for suffix in (".bin", ".idx"):
        reference = (tmp_path / f"w1_text_document{suffix}").read_bytes()
        assert (tmp_path / f"w2_text_document{suffix}").read_bytes() == reference
        assert (tmp_path / f"p2_text_document{suffix}").read_bytes() == reference
    assert not [name for name in os.listdir(tmp_path) if "partition" in name or "partial" in name]


def test_round_robin_partitions_group_documents_by_partition(tmp_path, corpus, tokenizer_files):
    assert gpt2_run(tokenizer_files, corpus, tmp_path / "seq", "--workers", 1).returncode == 0
    result = gpt2_run(tokenizer_files, corpus, tmp_path / "rr", "--workers", 2, "--partitions", 2)
    assert result.returncode == 0, result.stderr
    sequential, _, _ = read_documents(tmp_path / "seq_text_document")
    round_robin, _, _ = read_documents(tmp_path / "rr_text_document")
    assert round_robin == sequential[0::2] + sequential[1::2]  # partition 0's documents, then partition 1's


def test_malformed_lines_are_skipped_and_counted(tmp_path, tokenizer_files):
    corpus = write_jsonl(
        tmp_path / "messy.jsonl",
        [
            {"text": "good one"},
            "{not json",
            "",
            "[1, 2]",
            {"title": "no text key"},
            {"text": 42},
            {"text": "good two"},
        ],
    )
    with open(corpus, "ab") as file:
        file.write(b'{"text": "bad \xff utf8"}\n')
    for workers in (1, 2):
        result = gpt2_run(tokenizer_files, corpus, tmp_path / f"messy{workers}", "--workers", workers)
        assert result.returncode == 0, result.stderr
        assert "messy.jsonl:2: not valid JSON" in result.stderr
        assert "messy.jsonl:4: expected a JSON object, got list" in result.stderr
        assert "messy.jsonl:5: missing key 'text'" in result.stderr
        assert "messy.jsonl:6: key 'text' holds int, expected a string" in result.stderr
        assert "messy.jsonl:8: not valid JSON" in result.stderr
        assert "skipped 5 malformed lines" in result.stderr
        tokens, _, _ = read_documents(tmp_path / f"messy{workers}_text_document")
        assert len(tokens) == 2


def test_strict_stops_at_the_first_malformed_line_and_writes_nothing(tmp_path, tokenizer_files):
    corpus = write_jsonl(tmp_path / "strict.jsonl", [{"text": "fine"}] * 40 + ["{oops"] + [{"text": "fine"}] * 40)
    for flags in (["--workers", 1], ["--workers", 2], ["--workers", 2, "--partitions", 2]):
        result = gpt2_run(tokenizer_files, corpus, tmp_path / "strict", "--strict", *flags)
        assert result.returncode == 1
        assert "strict.jsonl:41: not valid JSON" in result.stderr and "--strict" in result.stderr
        assert sorted(os.listdir(tmp_path)) == ["strict.jsonl"]


def test_split_sentences_and_keep_newlines(tmp_path, tokenizer_files):
    corpus = write_jsonl(tmp_path / "s.jsonl", [{"text": "One. Two!\nThree?"}])
    for flag, expected_sentences in (
        ([], ["One.", "Two!", "Three?"]),
        (["--keep-newlines"], ["One. ", "Two!\n", "Three?"]),
    ):
        prefix = tmp_path / ("kept" if flag else "plain")
        result = gpt2_run(tokenizer_files, corpus, prefix, "--split-sentences", *flag, "--workers", 1)
        assert result.returncode == 0, result.stderr
        tokenizer = tokenizer_for("GPT2BPETokenizer", tokenizer_files.gpt2)
        dataset = IndexedDataset(f"{prefix}_text_sentence")
        expected = [tokenizer.tokenize(s) for s in expected_sentences]
        expected[-1].append(tokenizer.eod)
        assert [s.tolist() for s in dataset[:]] == expected
        assert dataset.document_indices.tolist() == [0, 3]


def test_directory_glob_gzip_and_max_documents(tmp_path, tokenizer_files):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [{"text": "alpha"}, {"text": "beta"}])
    with gzip.open(data / "b.jsonl.gz", "wt", encoding="utf-8") as file:
        file.write(json.dumps({"text": "gamma"}) + "\n")
    (data / "notes.txt").write_text("not input")
    tokenizer = tokenizer_for("GPT2BPETokenizer", tokenizer_files.gpt2)
    expected = [tokenizer.tokenize(w) + [tokenizer.eod] for w in ("alpha", "beta", "gamma")]
    for source, extra, count in ((data, [], 3), (data / "*.jsonl*", [], 3), (data, ["--max-documents", 2], 2)):
        result = gpt2_run(tokenizer_files, source, tmp_path / "dir", "--workers", 1, *extra)
        assert result.returncode == 0, result.stderr
        assert read_documents(tmp_path / "dir_text_document")[0] == expected[:count]


def test_several_json_keys(tmp_path, corpus, tokenizer_files):
    result = gpt2_run(tokenizer_files, corpus, tmp_path / "multi", "--json-keys", "text", "id", "--workers", 1)
    assert result.returncode == 0 and "holds int" in result.stderr  # "id" is a number: every line is skipped
    corpus = write_jsonl(tmp_path / "two.jsonl", [{"text": "body", "title": "head"}])
    result = gpt2_run(tokenizer_files, corpus, tmp_path / "two", "--json-keys", "text", "title", "--workers", 1)
    assert result.returncode == 0, result.stderr
    tokenizer = tokenizer_for("GPT2BPETokenizer", tokenizer_files.gpt2)
    assert read_documents(tmp_path / "two_title_document")[0] == [tokenizer.tokenize("head") + [tokenizer.eod]]
    assert read_documents(tmp_path / "two_text_document")[0] == [tokenizer.tokenize("body") + [tokenizer.eod]]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--workers", 3, "--partitions", 2], "--workers 3 must be a multiple of --partitions 2"),
        (["--workers", 0], "--workers must be at least 1, got 0"),
        (["--workers", 1, "--max-documents", 0], "--max-documents must be at least 1, got 0"),
    ],
)
def test_bad_arguments(tmp_path, corpus, tokenizer_files, arguments, message):
    result = gpt2_run(tokenizer_files, corpus, tmp_path / "x", *arguments)
    assert result.returncode == 2 and message in result.stderr


def test_bad_paths(tmp_path, corpus, tokenizer_files):
    result = gpt2_run(tokenizer_files, corpus, tmp_path / "missing_dir" / "x", "--workers", 1)
    assert result.returncode == 2 and "missing_dir does not exist" in result.stderr
    result = gpt2_run(tokenizer_files, tmp_path / "nothing*.jsonl", tmp_path / "x", "--workers", 1)
    assert result.returncode == 1 and "nothing*.jsonl: no input files" in result.stderr
    result = run_tool(
        PREPROCESS,
        "--input",
        corpus,
        "--output-prefix",
        tmp_path / "x",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--workers",
        1,
    )
    assert result.returncode == 1 and "GPT2BPETokenizer needs --vocab-file" in result.stderr
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    result = gpt2_run(tokenizer_files, broken, tmp_path / "x", "--workers", 1)
    assert result.returncode == 1 and "broken.jsonl.gz: cannot read past line 0" in result.stderr


def test_preprocess_imports_no_training_stack():
    code = (
        "import sys, tools.preprocess_data, tools.merge_datasets; print(sorted(m for m in sys.modules "
        "if m == 'torch' or m.startswith('megatron.training')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- sentence splitting ----------------------------------------------------------------------------------------------


def test_regex_sentence_splitter():
    text = 'He said "Stop." Then he left! Did he?  Yes.\n\nThe end'
    assert RegexSentenceSplitter(keep_newlines=False)(text) == [
        'He said "Stop."',
        "Then he left!",
        "Did he?",
        "Yes.",
        "The end",
    ]
    kept = RegexSentenceSplitter(keep_newlines=True)(text)
    assert "".join(kept) == text and kept[3] == "Yes.\n\n"
    assert RegexSentenceSplitter(keep_newlines=False)("") == []


def test_punkt_splitter_keep_newlines_keeps_whitespace():
    punkt = pytest.importorskip("nltk.tokenize.punkt")
    trained = punkt.PunktSentenceTokenizer("Mr. Smith went home. He slept well. " * 20)
    text = "First sentence here.\nSecond one follows. Third."
    assert punkt_splitter(trained, keep_newlines=False)(text) == [
        "First sentence here.",
        "Second one follows.",
        "Third.",
    ]
    kept = punkt_splitter(trained, keep_newlines=True)(text)
    assert kept == ["First sentence here.\n", "Second one follows. ", "Third."]


def test_missing_nltk_falls_back_to_regex_with_a_warning(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "nltk", None)
    monkeypatch.setitem(sys.modules, "nltk.tokenize", None)
    assert choose_sentence_splitter("english") == "regex"
    assert "nltk is not installed (pip install nltk)" in capsys.readouterr().err


# --- merge_datasets ---------------------------------------------------------------------------------------------------


def build_dataset(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(f"{prefix}.idx")


def test_merge_datasets(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    build_dataset(parts / "b", [[3], [4, 5]])
    build_dataset(parts / "a", [[1, 2]])
    build_dataset(tmp_path / "direct", [[1, 2], [3], [4, 5]])
    (tmp_path / "out").mkdir()
    result = run_tool(MERGE, "--input", parts, "--output-prefix", tmp_path / "out" / "merged")
    assert result.returncode == 0, result.stderr
    assert "merged 2 datasets" in result.stderr and "3 documents" in result.stderr
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "out" / f"merged{suffix}").read_bytes() == (tmp_path / f"direct{suffix}").read_bytes()


def test_merge_datasets_errors(tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    (tmp_path / "out").mkdir()
    output = tmp_path / "out" / "merged"
    result = run_tool(MERGE, "--input", parts, "--output-prefix", output)
    assert result.returncode == 1 and "no .bin/.idx pairs to merge" in result.stderr
    build_dataset(parts / "a", [[1]])
    build_dataset(parts / "wide", [[2]], dtype=np.int32)
    result = run_tool(MERGE, "--input", parts, "--output-prefix", output)
    assert result.returncode == 1 and "wide.idx holds int32 tokens but this builder writes uint16" in result.stderr
    assert os.listdir(tmp_path / "out") == []
    os.remove(parts / "wide.idx")
    result = run_tool(MERGE, "--input", parts, "--output-prefix", output)
    assert result.returncode == 1 and "wide.bin has no matching .idx file" in result.stderr
    result = run_tool(MERGE, "--input", parts, "--output-prefix", parts / "merged")
    assert result.returncode == 2 and "is inside --input" in result.stderr

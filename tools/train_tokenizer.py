"""Train a GPT-2-style byte-level BPE tokenizer on JSON-lines text.

The result is saved as `vocab.json` + `merges.txt` in `--output-dir`, the files `--tokenizer-type GPT2BPETokenizer
--vocab-file ... --merge-file ...` reads: the byte-to-unicode alphabet and pre-tokenization regex are GPT-2's
(ByteLevel pre-tokenizer, no prefix space), and each special token (default `<|endoftext|>`) is in `vocab.json`.

Example (how the built-in tokenizer was made):

    python tools/train_tokenizer.py --input megatron/training/builtin_data/shakespeare.jsonl.gz \
        --vocab-size 8192 --output-dir megatron/training/builtin_data

Training is deterministic: the same input and options give byte-identical files.
"""

import argparse
import gzip
import json
import os
from pathlib import Path

DEFAULT_VOCAB_SIZE = 8192
DEFAULT_SPECIAL_TOKENS = ["<|endoftext|>"]


def open_text(path):
    """Open a .jsonl or .jsonl.gz file for reading text."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def iter_texts(input_path, json_keys):
    """Yield the string under each of `json_keys` for every line of a JSON-lines file, in file order."""
    with open_text(input_path) as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{input_path}:{line_number}: not valid JSON ({error.msg}); each line must be one JSON object"
                ) from None
            for key in json_keys:
                value = record.get(key) if isinstance(record, dict) else None
                if not isinstance(value, str):
                    raise ValueError(
                        f"{input_path}:{line_number}: key {key!r} is missing or not a string; "
                        f"pass the right field with --json-keys"
                    )
                yield value


def train_byte_level_bpe(texts, vocab_size, special_tokens):
    """Train and return a `tokenizers.Tokenizer` with a GPT-2 byte-level BPE model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(special_tokens) + len(alphabet)
    if vocab_size <= smallest:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: the {len(special_tokens)} special tokens "
            f"and {len(alphabet)} byte symbols need {smallest}; pass a larger value"
        )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=sorted(alphabet),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_gpt2_files(tokenizer, output_dir):
    """Write `vocab.json` and `merges.txt` to `output_dir` and return their paths."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = tokenizer.model.save(str(output_dir))
    return [Path(path) for path in written]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="JSON-lines file (.jsonl or .jsonl.gz)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields holding the text (default: text)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help=f"total vocabulary size, special tokens included (default: {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument("--output-dir", required=True, help="directory for vocab.json and merges.txt")
    parser.add_argument(
        "--special-tokens",
        nargs="*",
        default=DEFAULT_SPECIAL_TOKENS,
        help="special tokens, given the first ids (default: <|endoftext|>)",
    )
    args = parser.parse_args(argv)

    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    tokenizer = train_byte_level_bpe(iter_texts(args.input, args.json_keys), args.vocab_size, args.special_tokens)
    paths = save_gpt2_files(tokenizer, args.output_dir)
    print(f"vocab size {tokenizer.get_vocab_size()} -> {', '.join(str(path) for path in paths)}")


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)

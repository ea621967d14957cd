"""Small tokenizer files built on the fly for tests (nothing is downloaded): one writer per tokenizer type."""

import base64
import io
import json
import os

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A stitch in time saves nine. Slow and steady wins the race!",
    "To be, or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "Numbers like 3.14 and 2718 appear in text too.",
    "Unicode: café, naïve, Ångström, 東京.",
    "the the the and and and then there they them",
] * 20


def write_gpt2_bpe_files(directory, vocab_size=400):
    """Train a byte-level BPE and save it GPT-2 style; returns (vocab.json path, merges.txt path)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SAMPLE_TEXTS, trainer=trainer)
    os.makedirs(directory, exist_ok=True)
    vocab_path, merges_path = tokenizer.model.save(str(directory))
    return vocab_path, merges_path


def write_huggingface_dir(directory):
    """A `save_pretrained`-like directory: tokenizer.json (BPE whose post-processor adds <s>) + tokenizer_config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SAMPLE_TEXTS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
        json.dump({"eos_token": "</s>", "bos_token": {"content": "<s>"}, "pad_token": "<pad>"}, file)
    return str(directory)


def write_sentencepiece_model(path, vocab_size=320):
    """Train a small BPE SentencePiece model with byte fallback (ids: 0 <unk>, 1 <s>, 2 </s>, no pad)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SAMPLE_TEXTS),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        minloglevel=2,
    )
    with open(path, "wb") as file:
        file.write(model.getvalue())
    return str(path)


TIKTOKEN_MERGES = [b"th", b"he", b"the", b" t", b" the", b"an", b"and", b" and", b"in", b"ing", b"er", b"ou"]


def tiktoken_ranks():
    """The 256 single bytes at ranks 0..255, then a few merges."""
    tokens = [bytes([byte]) for byte in range(256)] + TIKTOKEN_MERGES
    return {token: rank for rank, token in enumerate(tokens)}


def write_tiktoken_file(path):
    """tiktoken's own text format: `<base64 token> <rank>` per line."""
    with open(path, "w") as file:
        for token, rank in tiktoken_ranks().items():
            file.write(f"{base64.b64encode(token).decode()} {rank}\n")
    return str(path)


def write_tiktoken_json(path):
    """Megatron-LM's JSON list format for TikTokenizer vocabularies."""
    entries = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode(), "token_str": token.decode("latin-1")}
        for token, rank in tiktoken_ranks().items()
    ]
    with open(path, "w") as file:
        json.dump(entries, file)
    return str(path)

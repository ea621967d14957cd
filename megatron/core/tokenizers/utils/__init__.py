"""Helpers around the tokenizers: `build_tokenizer` from Megatron-LM's arguments."""

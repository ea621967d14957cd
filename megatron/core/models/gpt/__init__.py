"""GPT-style decoder-only language models."""

from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]

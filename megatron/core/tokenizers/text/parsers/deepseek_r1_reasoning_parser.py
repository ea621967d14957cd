"""Reasoning in ``<think>...</think>``, as DeepSeek-R1 (and vLLM's parser for it) writes and reads it."""

from megatron.core.tokenizers.text.parsers.base_parser import BaseParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class DeepSeekR1ReasoningParser(BaseParser):
    """Splits ``<think>reasoning</think>answer``. Text before the first ``<think>`` is dropped; without a ``<think>``
    the whole text counts as reasoning (the chat template may have opened it), and without a ``</think>`` the model
    was still reasoning when it stopped, so the answer is empty."""

    @staticmethod
    def parse(text: str, **kwargs) -> tuple[str, dict[str, str]]:
        _, opened, after = text.partition(THINK_OPEN)
        remaining = after if opened else text
        reasoning, closed, answer = remaining.partition(THINK_CLOSE)
        if not closed:
            answer = ""
        return answer, ({"reasoning": reasoning} if reasoning else {})

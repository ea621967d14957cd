"""Reasoning of NVIDIA Nemotron 3 (Super and Ultra share it): DeepSeek-R1's ``<think>`` split, except that a client
who turned reasoning off, or asked for a non-empty answer, gets the reasoning as the answer when there is no other."""

from typing import Optional

from megatron.core.tokenizers.text.parsers.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser


class NemotronV3ReasoningParser(DeepSeekR1ReasoningParser):
    """``parse(text, chat_template_kwargs=...)``: the request's ``enable_thinking=False`` or
    ``force_nonempty_content=True`` (inside ``chat_template_kwargs``, as the chat endpoint forwards them) turn an
    empty answer into the reasoning text, so such a client never receives an empty reply."""

    @staticmethod
    def _should_force_content(chat_template_kwargs: Optional[dict]) -> bool:
        if not chat_template_kwargs:
            return False
        return (
            chat_template_kwargs.get("enable_thinking") is False
            or chat_template_kwargs.get("force_nonempty_content") is True
        )

    @staticmethod
    def parse(text: str, **kwargs) -> tuple[str, dict[str, str]]:
        answer, info = DeepSeekR1ReasoningParser.parse(text, **kwargs)
        forced = NemotronV3ReasoningParser._should_force_content(kwargs.get("chat_template_kwargs"))
        if not answer and info.get("reasoning") and forced:
            return info["reasoning"], {}
        return answer, info

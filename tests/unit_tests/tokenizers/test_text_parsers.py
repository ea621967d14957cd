"""megatron.core.tokenizers.text.parsers: reasoning split out of ``<think>`` blocks and Qwen3-Coder tool calls read
into OpenAI-style calls, by the names Megatron registers them under."""

import json

import pytest

from megatron.core.tokenizers.text.parsers import PARSER_MAPPING
from megatron.core.tokenizers.text.parsers.base_parser import BaseParser
from megatron.core.tokenizers.text.parsers.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from megatron.core.tokenizers.text.parsers.nemotron_v3_reasoning_parser import NemotronV3ReasoningParser
from megatron.core.tokenizers.text.parsers.qwen3_coder_tool_parser import Qwen3CoderToolParser, convert_value


def test_registry_names():
    assert PARSER_MAPPING == {
        "deepseek-r1-reasoning": DeepSeekR1ReasoningParser,
        "qwen3-coder-tool": Qwen3CoderToolParser,
        "nemotron-v3-reasoning": NemotronV3ReasoningParser,
    }
    assert BaseParser.parse("as is", anything=1) == ("as is", {})


@pytest.mark.parametrize(
    "text, answer, info",
    [
        ("pre<think>why</think>answer", "answer", {"reasoning": "why"}),
        ("<think>still thinking", "", {"reasoning": "still thinking"}),
        ("opened by the template</think>answer", "answer", {"reasoning": "opened by the template"}),
        ("<think></think>answer", "answer", {}),
    ],
)
def test_deepseek_r1_split(text, answer, info):
    assert DeepSeekR1ReasoningParser.parse(text) == (answer, info)


def test_nemotron_v3_surfaces_reasoning_only_when_asked_and_the_answer_is_empty():
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert NemotronV3ReasoningParser.parse("<think>why", **off) == ("why", {})
    assert NemotronV3ReasoningParser.parse("<think>why</think>", force_nonempty_content=True) == (
        "",
        {"reasoning": "why"},
    )  # the flag counts only inside chat_template_kwargs, where the chat endpoint puts it
    assert NemotronV3ReasoningParser.parse("<think>why</think>ok", **off) == ("ok", {"reasoning": "why"})


def test_qwen3_coder_tool_calls_typed_by_the_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "plan",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "days": {"type": "integer"},
                        "budget": {"type": "number"},
                        "strict": {"type": "boolean"},
                        "stops": {"type": "array"},
                        "note": {"type": "string"},
                    },
                },
            },
        }
    ]
    text = (
        "Let me plan.\n<tool_call>\n<function=plan>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=budget>\n12.5\n</parameter>\n<parameter=strict>\nTrue\n</parameter>\n"
        '<parameter=stops>\n["a", "b"]\n</parameter>\n<parameter=note>\n42\n</parameter>\n'
        "<parameter=extra>\nnull\n</parameter>\n</function>\n</tool_call>"
    )
    content, info = Qwen3CoderToolParser.parse(text, tools=tools)
    assert content == "Let me plan.\n"
    (call,) = info["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["name"] == "plan"
    assert json.loads(call["function"]["arguments"]) == {
        "days": 3,
        "budget": 12.5,
        "strict": True,
        "stops": ["a", "b"],
        "note": "42",
        "extra": None,
    }


def test_qwen3_coder_without_calls_cut_off_and_bad_values():
    assert Qwen3CoderToolParser.parse("no tools here") == ("no tools here", {})
    assert Qwen3CoderToolParser.parse("<function=unterminated") == ("<function=unterminated", {})
    content, info = Qwen3CoderToolParser.parse("<function=f>\n<parameter=x>\n1")
    assert content == "" and json.loads(info["tool_calls"][0]["function"]["arguments"]) == {"x": "1"}
    schemas = {"n": {"type": "int"}, "f": {"type": "float"}, "u": {"anyOf": [{"type": "object"}]}}
    assert convert_value("many", "n", schemas) == "many"
    assert convert_value("2.0", "f", schemas) == 2 and isinstance(convert_value("2.0", "f", schemas), int)
    assert convert_value("{'k': 1}", "u", schemas) == {"k": 1}
    assert convert_value("not json", "u", schemas) == "not json"

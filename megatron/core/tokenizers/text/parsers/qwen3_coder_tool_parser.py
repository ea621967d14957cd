"""Tool calls in Qwen3-Coder's XML-like format (the one vLLM's ``qwen3_coder`` parser reads)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted to the type the request's tool schema gives it (integer, number,
boolean, object/array), and left as text when it does not convert, since a half-right call is more useful to the
client than none. Unterminated blocks (generation cut off) are read up to the end of the text.
"""

import ast
import json
import logging
import re
import uuid
from typing import Any, Optional

from megatron.core.tokenizers.text.parsers.base_parser import BaseParser

logger = logging.getLogger(__name__)

TOOL_CALL_OPEN, FUNCTION_OPEN = "<tool_call>", "<function="
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_PREFIXES = ("object", "array", "arr", "dict", "list")


def _parameter_schemas(function_name: str, tools: Optional[list]) -> dict:
    """{parameter: schema} of ``function_name`` among the request's tools ({} when it is not declared)."""
    for tool in tools or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, dict) or function.get("name") != function_name:
            continue
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            return {}
        return parameters.get("properties", parameters)
    return {}


def _schema_type(schema: Any) -> str:
    if isinstance(schema, dict) and "type" in schema:
        return str(schema["type"]).strip().lower()
    if isinstance(schema, dict) and "anyOf" in schema:
        return "object"  # a union has no single type; its JSON text is the best reading
    return "string"


def _number(value: str):
    number = float(value)
    return int(number) if number.is_integer() else number


def convert_value(value: str, name: str, schemas: dict) -> Any:
    """``value`` as the type ``schemas[name]`` declares; ``null`` is None for every type."""
    if value.lower() == "null":
        return None
    if name not in schemas:
        return value
    kind = _schema_type(schemas[name])
    if kind in _TEXT_TYPES:
        return value
    try:
        if kind.startswith(_INT_PREFIXES):
            return int(value)
        if kind.startswith(("num", "float")):
            return _number(value)
    except ValueError:
        logger.debug("tool parameter %s=%r is not a %s; kept as text", name, value, kind)
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind.startswith(_JSON_PREFIXES):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)  # Python-style literals ('a', True) that are not JSON
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _parse_function(body: str, tools: Optional[list]) -> Optional[dict]:
    """One ``name>...<parameter=...>`` block as an OpenAI tool call, or None when the name never closes."""
    name, closed, parameters = body.partition(">")
    if not closed:
        return None
    schemas = _parameter_schemas(name, tools)
    arguments = {}
    for block in _PARAMETER.findall(parameters):
        parameter, closed, value = block.partition(">")
        if not closed:
            continue  # cut off before the parameter's value began
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[parameter] = convert_value(value, parameter, schemas)
    return {
        "type": "function",
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class Qwen3CoderToolParser(BaseParser):
    """``parse(text, tools=[...])`` -> (the text before the first call, ``{"tool_calls": [...]}``), or the text
    unchanged and ``{}`` when it calls no tool. ``tools`` are the request's OpenAI-style tool definitions."""

    @staticmethod
    def parse(text: str, **kwargs) -> tuple[str, dict[str, list]]:
        if FUNCTION_OPEN not in text:
            return text, {}
        blocks = _TOOL_CALL.findall(text) or [text]  # a model may omit <tool_call> and write the function only
        bodies = [body for block in blocks for body in _FUNCTION.findall(block)]
        calls = [call for call in (_parse_function(body, kwargs.get("tools")) for body in bodies) if call]
        if not calls:
            return text, {}
        start = text.find(TOOL_CALL_OPEN)
        content = text[: start if start >= 0 else text.find(FUNCTION_OPEN)]
        return content, {"tool_calls": calls}

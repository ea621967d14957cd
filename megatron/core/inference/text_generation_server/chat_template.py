"""Chat messages -> the prompt text the model continues.

Which template renders the messages, first match wins:

1. ``--chat-template FILE``: a Jinja template file (the format Hugging Face tokenizers use);
2. the tokenizer's own template (``chat_template`` in a Hugging Face tokenizer directory's
   ``tokenizer_config.json``, or its ``chat_template.jinja``);
3. the plain default, one ``role: content`` line per message, then ``assistant:`` for the reply::

       system: You are terse.
       user: Hi!
       assistant:

Jinja templates are rendered as ``transformers`` renders them (a sandboxed environment, ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception`` and ``tojson`` available, ``add_generation_prompt=True``, the tokenizer's
``bos_token`` / ``eos_token``), so a model's published template gives the prompt it was trained on.
"""

import json
import os
from typing import Callable, Dict, List, Optional

from megatron.core.inference.text_generation_server.errors import OpenAIError


def default_chat_prompt(messages: List[Dict[str, str]]) -> str:
    lines = [f"{message['role']}: {message['content']}" for message in messages]
    return "\n".join(lines + ["assistant:"])


def _token_text(tokenizer, name: str) -> str:
    token_id = getattr(tokenizer, name, -1)
    if token_id is None or token_id < 0:
        return ""
    try:
        return tokenizer.detokenize([token_id])
    except Exception:  # a tokenizer without text for its special ids
        return ""


def load_chat_template_file(path: str) -> str:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--chat-template {path}: no such file (give a Jinja chat template file)")
    with open(path, encoding="utf-8") as file:
        return file.read()


def build_chat_renderer(tokenizer, template_file: Optional[str] = None) -> Callable[[List[Dict[str, str]]], str]:
    """The function that turns ``[{"role", "content"}]`` into prompt text for this server (see the module doc)."""
    template = load_chat_template_file(template_file) if template_file else getattr(tokenizer, "chat_template", None)
    if not template:
        return default_chat_prompt
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        compiled = environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        where = f"--chat-template {template_file}" if template_file else "the tokenizer's chat_template"
        raise ValueError(f"{where}: not a valid Jinja template ({error})") from None
    special = {"bos_token": _token_text(tokenizer, "bos"), "eos_token": _token_text(tokenizer, "eos")}

    def render(messages: List[Dict[str, str]]) -> str:
        try:
            return compiled.render(messages=messages, add_generation_prompt=True, **special)
        except jinja2.exceptions.TemplateError as error:  # e.g. the template's raise_exception on role order
            raise OpenAIError(
                f"The chat template refused these messages: {error}", param="messages", code="invalid_value"
            ) from None

    return render

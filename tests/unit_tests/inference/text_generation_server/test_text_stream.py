"""TextStream: streamed pieces are never taken back, add up to the whole text, and stop where a stop sequence
starts; chat templates render as documented."""

import json

import pytest

from megatron.core.inference.text_generation_server.chat_template import build_chat_renderer, default_chat_prompt
from megatron.core.inference.text_generation_server.errors import OpenAIError
from megatron.core.inference.text_generation_server.text_stream import TextStream
from megatron.core.tokenizers import GPT2BPETokenizer
from megatron.training import builtin_data


@pytest.fixture(scope="module")
def tokenizer():
    return GPT2BPETokenizer(builtin_data.vocab_file(), builtin_data.merge_file())


def _pieces(tokenizer, tokens, stop=(), termination=()):
    stream = TextStream(tokenizer, stop, termination)
    pieces = [stream.add([token]) for token in tokens]
    pieces.append(stream.flush())
    return stream, pieces


def test_pieces_add_up_to_the_decoded_text(tokenizer):
    tokens = tokenizer.tokenize("To be, or not to be: that is the question.")
    stream, pieces = _pieces(tokenizer, tokens)
    assert "".join(pieces) == tokenizer.detokenize(tokens)
    assert stream.finish_reason is None


def test_stop_sequence_cuts_the_text_and_is_never_streamed(tokenizer):
    tokens = tokenizer.tokenize("To be, or not to be: that is the question.")
    stream, pieces = _pieces(tokenizer, tokens, stop=["not to"])
    assert "".join(pieces) == "To be, or "
    assert stream.finish_reason == "stop"
    # Every prefix of the stop sequence was held back, not sent and later retracted.
    assert not any("not" in piece for piece in pieces)


def test_held_back_stop_prefix_is_released_when_it_does_not_complete(tokenizer):
    tokens = tokenizer.tokenize("the quick queen")
    stream, pieces = _pieces(tokenizer, tokens, stop=["quack"])
    assert "".join(pieces) == "the quick queen"
    assert stream.finish_reason is None


def test_termination_id_ends_the_stream_without_text(tokenizer):
    tokens = tokenizer.tokenize("hello") + [tokenizer.eod] + tokenizer.tokenize(" more")
    stream, pieces = _pieces(tokenizer, tokens, termination=[tokenizer.eod])
    assert "".join(pieces) == "hello"
    assert stream.finish_reason == "stop"


def test_incomplete_utf8_is_held_until_the_character_completes(tokenizer):
    tokens = tokenizer.tokenize("naïve café ☃")
    stream = TextStream(tokenizer)
    pieces = [stream.add([token]) for token in tokens] + [stream.flush()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == "naïve café ☃"


def test_default_chat_prompt_is_role_lines_then_assistant():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}]
    assert default_chat_prompt(messages) == "system: Be terse.\nuser: Hi!\nassistant:"


def test_chat_template_file_and_tokenizer_template(tokenizer, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    render = build_chat_renderer(tokenizer, str(template))
    assert render([{"role": "user", "content": "Hi"}]) == "<user>Hi<assistant>"

    class WithTemplate:
        chat_template = "{{ bos_token }}{{ messages | tojson }}"
        bos = -1
        eos = -1

    assert build_chat_renderer(WithTemplate())([{"role": "user", "content": "x"}]) == json.dumps(
        [{"role": "user", "content": "x"}]
    )
    assert build_chat_renderer(tokenizer) is default_chat_prompt  # GPT-2's BPE files carry no template


def test_chat_template_errors(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="--chat-template .*missing.jinja: no such file"):
        build_chat_renderer(tokenizer, str(tmp_path / "missing.jinja"))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="broken.jinja: not a valid Jinja template"):
        build_chat_renderer(tokenizer, str(broken))
    strict = tmp_path / "strict.jinja"
    strict.write_text("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(OpenAIError, match="refused these messages: system first"):
        build_chat_renderer(tokenizer, str(strict))([{"role": "user", "content": "x"}])


def test_huggingface_tokenizer_reads_its_chat_template(tmp_path):
    from megatron.core.tokenizers import HuggingFaceTokenizer
    from tests.unit_tests.tokenizers.tiny_tokenizer_files import write_huggingface_dir

    directory = write_huggingface_dir(tmp_path / "hf")
    assert HuggingFaceTokenizer(directory).chat_template is None
    config_path = tmp_path / "hf" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
        {"name": "tool_use", "template": "unused"},
    ]
    config_path.write_text(json.dumps(config))
    tokenizer = HuggingFaceTokenizer(directory)
    assert build_chat_renderer(tokenizer)([{"role": "user", "content": "hey"}]) == "<s>hey"
    (tmp_path / "hf" / "chat_template.jinja").write_text("[{{ messages[0].content }}]{{ eos_token }}")
    assert build_chat_renderer(HuggingFaceTokenizer(directory))([{"role": "user", "content": "hey"}]) == "[hey]</s>"

"""Chat templates: HF-compatible rendering, built-in formats by architecture, clear errors.

The golden renderings from llama.cpp are checked in tests/model/test_tokenizer_golden.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.chat_template import ChatTemplate
from shared.errors import InvalidRequestError, TokenizerError

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi! "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"}]


@dataclass
class FakeTokenizer:
    """Just the facts ChatTemplate.for_tokenizer reads."""
    arch: str = "qwen2"
    chat_template: str | None = None
    vocab: dict = field(default_factory=lambda: {"<s>": 1, "</s>": 2, "<|im_end|>": 3})
    bos_id: int | None = 1
    eos_id: int | None = 2
    add_bos: bool = False
    add_eos: bool = False
    eot_ids: frozenset = frozenset({2, 3})

    def token_id(self, text):
        return self.vocab.get(text)

    def token_text(self, token_id):
        return {v: k for k, v in self.vocab.items()}[token_id]


def render(source: str, messages=CHAT, **kwargs) -> str:
    return ChatTemplate(source).render(messages, **kwargs)


# -- built-in formats --------------------------------------------------------------------------

def test_gemma_format_folds_system_into_first_user_turn(gemma3_gguf):
    from gateway.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(gemma3_gguf)
    template = ChatTemplate.for_tokenizer(tok)
    assert template.origin == "builtin:gemma3"
    assert template.render(CHAT) == (
        "<start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert template.render(CHAT[1:2], add_generation_prompt=False) == (
        "<start_of_turn>user\nHi!<end_of_turn>\n")
    assert template.stop_ids == {tok.eos_id, tok.token_id("<end_of_turn>")}
    assert template.stop_strings == ()
    ids = tok.encode(template.render(CHAT[1:2]))
    assert ids[:3] == [tok.bos_id, tok.token_id("<start_of_turn>"), tok.token_id("user")]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_models_without_template_get_chatml(arch):
    template = ChatTemplate.for_tokenizer(FakeTokenizer(arch=arch))
    assert template.render(CHAT[1:3]) == (
        "<|im_start|>user\n Hi! <|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert template.stop_ids == {2, 3} and template.stop_strings == ()


def test_end_of_turn_marker_missing_from_vocab_becomes_a_stop_string():
    template = ChatTemplate.for_tokenizer(FakeTokenizer(vocab={"<s>": 1, "</s>": 2}))
    assert template.stop_strings == ("<|im_end|>",)


def test_override_beats_the_file_template():
    tok = FakeTokenizer(chat_template="{{ 'from file' }}")
    assert ChatTemplate.for_tokenizer(tok).render(CHAT) == "from file"
    template = ChatTemplate.for_tokenizer(tok, override="{{ messages | length }}")
    assert (template.origin, template.render(CHAT)) == ("override", "4")


# -- what HF templates rely on -------------------------------------------------------------------

def test_trim_and_lstrip_blocks_like_transformers():
    source = ("{% for m in messages %}\n"
              "    {% if m.role == 'user' %}\n"
              "[{{ m.content }}]\n"
              "    {% endif %}\n"
              "{% endfor %}")
    assert render(source) == "[ Hi! ]\n[Bye]\n"


def test_helpers_raise_exception_strftime_tojson_loopcontrols_namespace_generation():
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
              "{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
              "{{ {'a': 'é<>'} | tojson }}|{{ [1, 2] | tojson(indent=1) }}|"
              "{% generation %}gen{% endgeneration %}|{{ strftime_now('%Y') | length }}")
    assert render(source) == '2|{"a": "é<>"}|[\n 1,\n 2\n]|gen|4'


def test_bos_and_eos_come_from_the_tokenizer_and_a_printed_bos_is_not_doubled():
    source = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    plain = ChatTemplate.for_tokenizer(FakeTokenizer(chat_template=source))
    assert plain.render(CHAT) == "<s>Be brief.</s>"
    adds = ChatTemplate.for_tokenizer(FakeTokenizer(chat_template=source, add_bos=True, add_eos=True))
    assert adds.render(CHAT) == "Be brief."


def test_content_parts_and_missing_content():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": []}]
    assert render("{% for m in messages %}<{{ m.content }}>{% endfor %}", messages) == "<ab><>"


# -- errors -----------------------------------------------------------------------------------

def test_broken_template_is_one_line_tokenizer_error():
    with pytest.raises(TokenizerError, match=r"does not parse: .*\(line 2\)") as info:
        ChatTemplate("ok\n{% for m in messages %}{{ m }")
    assert "\n" not in info.value.message


@pytest.mark.parametrize("source", [
    "{{ messages[0].content + 1 }}",              # TypeError inside the template
    "{{ ''.__class__.__mro__ }}",                 # the sandbox refuses
    "{{ undefined_function() }}",
])
def test_template_failures_while_rendering_are_tokenizer_errors(source):
    with pytest.raises(TokenizerError, match="failed to render") as info:
        render(source)
    assert "\n" not in info.value.message


def test_raise_exception_is_the_callers_fault():
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('Roles must\nalternate') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="rejected the messages: Roles must alternate"):
        render(source)


@pytest.mark.parametrize("messages", [
    "hello",
    [{"content": "no role"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
    [{"role": "user", "content": 5}],
])
def test_malformed_messages_are_invalid_requests(messages):
    with pytest.raises(InvalidRequestError):
        render("{{ messages }}", messages)


def test_templates_cannot_mutate_the_callers_messages():
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(TokenizerError):
        render("{{ messages.append(1) }}", messages)
    assert messages == [{"role": "user", "content": "x"}]


# What llama.cpp's --jinja renders for a tool round trip on Qwen2.5's template: its chat layer turns
# the call's `arguments` string into an object before rendering (the template prints it with tojson),
# and the tool's result goes inside <tool_response> in a user turn.
QWEN_ROUND_TRIP = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {}}}\n'
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temperature": 23}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n")


@pytest.mark.parametrize("model", ["qwen05_gguf", "qwen15_gguf"])
def test_qwen_tool_round_trip_renders_as_llama_cpp_does(model, request):
    """Both Qwen files: the history's call (arguments sent as a JSON string) and the tool's result.
    The 1.5B file's template shows the call format with doubled braces (`{{"name": ...}}`), which
    the model copied as text after a tool result; it is printed with single braces, as in the 0.5B's."""
    from gateway.requests import parse_chat
    from gateway.tokenizer import Tokenizer
    from gateway.tools import prompt_messages
    req = parse_chat({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 23}'}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather."}}]}, max_n=1)
    template = ChatTemplate.for_tokenizer(Tokenizer.from_gguf(request.getfixturevalue(model)))
    tools = [{**t.as_openai(), "function": {**t.as_openai()["function"], "parameters": {}}} for t in req.tools.tools]
    assert template.render(prompt_messages(req.messages, req.tools, True), tools=tools) == QWEN_ROUND_TRIP

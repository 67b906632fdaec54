"""Chat messages -> prompt text, with the model's own Jinja chat template.

Templates come from the GGUF (`tokenizer.chat_template`), from an override file, or, for a model
whose file has none, from the published turn format of its architecture. They are rendered the
way Hugging Face transformers renders them (so templates written for it work unchanged): a
sandboxed, immutable Jinja environment with trim_blocks/lstrip_blocks, loop controls, and the
`raise_exception`, `strftime_now` and `tojson` helpers.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import InvalidRequestError, TokenizerError

from gateway.tokenizer import Tokenizer

# Gemma's published turn format. Gemma has no system role: system text goes at the top of the
# next user turn, as Google's template and llama.cpp's built-in "gemma" format both do. No BOS
# here: the tokenizer adds it (add_bos_token).
GEMMA_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- set ns.system = ns.system + (message['content'] | trim) -%}
  {%- else -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\\n' -}}
    {%- if ns.system and role != 'model' -%}
      {{- ns.system + '\\n\\n' -}}
      {%- set ns.system = '' -%}
    {%- endif -%}
    {{- (message['content'] | trim) + '<end_of_turn>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

# ChatML, llama.cpp's default when a model carries no template.
CHATML_TEMPLATE = """\
{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

# general.architecture -> (built-in template, its end-of-turn marker)
_BUILTIN = {
    "gemma": (GEMMA_TEMPLATE, "<end_of_turn>"),
    "gemma2": (GEMMA_TEMPLATE, "<end_of_turn>"),
    "gemma3": (GEMMA_TEMPLATE, "<end_of_turn>"),
    "gemma3n": (GEMMA_TEMPLATE, "<end_of_turn>"),
}
_DEFAULT_BUILTIN = (CHATML_TEMPLATE, "<|im_end|>")


class ChatTemplate:
    """A compiled chat template plus what ends a turn in the text it produces."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 strip_bos: bool = False, strip_eos: bool = False,
                 stop_ids: frozenset[int] = frozenset(), stop_strings: tuple[str, ...] = (),
                 origin: str = "template"):
        self.source = source
        self.origin = origin            # "override", "gguf" or "builtin:<arch>"
        self.stop_ids = stop_ids        # generation ends at any of these ids
        self.stop_strings = stop_strings  # end-of-turn markers that are not one token in the vocab
        self._bos, self._eos = bos_token, eos_token
        self._strip_bos, self._strip_eos = strip_bos, strip_eos
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"chat template ({origin}) does not parse: {_one_line(exc.message)} "
                f"(line {exc.lineno})") from exc

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer, override: str | None = None) -> ChatTemplate:
        """The override text if given, else the GGUF's template, else the architecture's format."""
        stop_strings: tuple[str, ...] = ()
        if override is not None:
            source, origin = override, "override"
        elif tok.chat_template:
            source, origin = _repaired(tok.chat_template), "gguf"
        else:
            source, marker = _BUILTIN.get(tok.arch, _DEFAULT_BUILTIN)
            origin = f"builtin:{tok.arch or 'unknown'}"
            if tok.token_id(marker) is None:
                stop_strings = (marker,)
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        return cls(source, bos_token=bos, eos_token=eos, strip_bos=tok.add_bos,
                   strip_eos=tok.add_eos, stop_ids=tok.eot_ids, stop_strings=stop_strings,
                   origin=origin)

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
               **extra) -> str:
        """Prompt text for `messages` ({"role", "content"} mappings); `extra` goes to the template
        (e.g. tools). Encode the result with add_special=True, parse_special=True."""
        context = dict(extra, messages=_normalize(messages),
                       add_generation_prompt=add_generation_prompt,
                       bos_token=self._bos, eos_token=self._eos)
        try:
            text = self._template.render(context)
        except _TemplateRaised as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}",
                                      param="messages") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError, OverflowError) as exc:  # OverflowError: the sandbox's range limit
            raise TokenizerError(
                f"chat template ({self.origin}) failed to render: {_one_line(str(exc))}") from exc
        # Templates written for transformers often print BOS themselves; the tokenizer adds it
        # too, and two BOS tokens hurt the model (llama.cpp strips it the same way).
        if self._strip_bos and self._bos and text.startswith(self._bos):
            text = text[len(self._bos):]
        if self._strip_eos and self._eos and text.endswith(self._eos):
            text = text[:-len(self._eos)]
        return text


# Qwen2.5-Coder-1.5B-Instruct's file shows the tool-call format as `{{"name": <function-name>,
# "arguments": <args-json-object>}}` inside a string literal (the 0.5B file, like Qwen2.5's, has single
# braces). Jinja prints the braces doubled, as llama.cpp's --jinja does, and the model copies them:
# after a tool result it wrote `{{"name": "get_weather", ...}}}` as text, which no parser reads as a
# call. The example is printed with single braces, as the model's other files have it.
_DOUBLED_CALL_EXAMPLE = '{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}'


def _repaired(source: str) -> str:
    return source.replace(_DOUBLED_CALL_EXAMPLE, _DOUBLED_CALL_EXAMPLE[1:-1])


class _TemplateRaised(Exception):
    """raise_exception() called by a template: the conversation breaks the template's rules."""


class _GenerationTag(Extension):
    """transformers' {% generation %} ... {% endgeneration %} marks assistant text; render it as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise _TemplateRaised(_one_line(str(message)))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _normalize(messages: Sequence[Mapping]) -> list[dict]:
    """Plain dicts with string content: OpenAI text parts are joined, a missing content is ""."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'role'",
                                      param="messages")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
                raise InvalidRequestError(f"messages[{i}].content: only text parts are supported",
                                          param="messages")
            content = "".join(str(p.get("text", "")) for p in content)
        elif not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts",
                                      param="messages")
        out.append({**message, "content": content})
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())


def template_for(tok: Tokenizer, config) -> ChatTemplate:
    """The chat template reame.conf asks for: `[model] chat_template` file if set, else for_tokenizer."""
    from shared.errors import ConfigError
    override = None
    if config.model.chat_template:
        path = config.resolve_path(config.model.chat_template)
        try:
            override = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read chat template {path}: {exc.strerror}") from None
    return ChatTemplate.for_tokenizer(tok, override)

"""Fill-in-the-middle: the code before and after a cursor (and other files of the project) → the
prompt a code model completes the middle from.

Two ways in: `/v1/completions` with OpenAI's `suffix` (the prompt is the prefix), and llama.cpp's
`/infill` (`input_prefix`, `input_suffix`, `input_extra` = [{filename, text}], and `prompt`, text
that follows the prefix, as llama.cpp's server takes it). The prompt is built as Qwen2.5-Coder's
authors specify, with llama.cpp's names where the format leaves one open:

    <|repo_name|>myproject\\n<|file_sep|>{filename}\\n{text}...<|file_sep|>filename\\n
    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>

(the repository part only with `input_extra`, and only where the vocabulary has those tokens). The
FIM tokens come from `tokenizer.ggml.fim_*_token_id` where the GGUF has them, else from their text
in the vocabulary (llama.cpp's list). Client text (code, file names) is tokenized with every
marker token's text left as text, user-defined ones such as Qwen's `<tool_call>` too (llama.cpp's
parse_special=False still cuts those out; Tokenizer.marker_texts): code that contains
`<|fim_middle|>` cannot move the cursor, and only this builder writes markers. A model without
prefix, suffix and middle tokens (SmolLM2, Gemma 3) cannot do this: a 400 says so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.request_fields import Bounds, Field, Fields, limited, optional, read_fields, read_object, read_text
from gateway.requests import COMPLETION_LOGPROBS, SAMPLING, CompletionRequest, completion_request
from shared.errors import ContextLengthError, InvalidRequestError

# Token texts per part, as llama.cpp looks for them when the GGUF names no id.
_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "\u2581<PRE>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "\u2581<SUF>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "\u2581<MID>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<fim-sep>", "<file_sep>"),
}
REPO_NAME = "myproject"     # what llama.cpp writes after <|repo_name|>
CURRENT_FILE = "filename"   # and as the name of the file being edited
MAX_EXTRA = 64              # input_extra entries


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None     # repository name marker
    sep: int | None     # file separator
    pad: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> FimTokens | None:
        """The model's FIM tokens, or None when it has no prefix, suffix and middle tokens."""
        known = dict(getattr(tokenizer.vocab, "fim_ids", {}))
        for part, texts in _TEXTS.items():
            if part not in known:
                found = next((i for t in texts if (i := tokenizer.token_id(t)) is not None), None)
                if found is not None:
                    known[part] = found
        if not all(part in known for part in ("pre", "suf", "mid")):
            return None
        return cls(known["pre"], known["suf"], known["mid"], known.get("rep"), known.get("sep"), known.get("pad"))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end a middle besides the model's end of text (llama.cpp ends generation at these)."""
        return tuple(i for i in (self.pad, self.rep, self.sep) if i is not None)


@dataclass(frozen=True)
class Infill:
    prefix: str
    suffix: str
    extra: tuple[tuple[str, str], ...] = ()     # (filename, text) of other files


def parse_infill(body: Any, *, max_n: int) -> tuple[CompletionRequest, Infill]:
    """POST /infill: llama.cpp's fields, and every sampling field /v1/completions takes (`n_predict`
    is llama.cpp's name for max_tokens)."""
    body = read_object(body)
    values = read_fields(INFILL, body, Bounds(max_n))
    max_tokens = values["max_tokens"] if values["max_tokens"] is not None else values["n_predict"]
    logprobs = values["logprobs"]
    req = completion_request(body, values, chat=False, messages=(), prompts=("-",),  # built from the parts
                             max_tokens=max_tokens, logprobs=logprobs is not None, top_logprobs=logprobs or 0)
    fill = Infill(values["input_prefix"] + values["prompt"], values["input_suffix"], values["input_extra"])
    return req, fill


def completion_infill(body: dict, req: CompletionRequest) -> Infill | None:
    """/v1/completions with `suffix`: the one text prompt is the prefix. None without `suffix`."""
    suffix = body.get("suffix")
    if suffix is None:
        return None
    if not isinstance(suffix, str):
        raise InvalidRequestError("'suffix' must be a string", param="suffix")
    if len(req.prompts) != 1 or not isinstance(req.prompts[0], str):
        raise InvalidRequestError("'suffix' takes one text prompt (the code before the cursor)", param="suffix")
    if body.get("echo"):
        raise InvalidRequestError("'echo' cannot be combined with 'suffix'", param="echo")
    return Infill(req.prompts[0], suffix)


def fim_tokens(tokenizer: Any, param: str) -> FimTokens:
    tokens = FimTokens.of(tokenizer)
    if tokens is None:
        raise InvalidRequestError("this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                                  "<|fim_middle|> or their kin); it cannot complete between a prefix and a suffix",
                                  param=param)
    return tokens


def check_size(tokenizer: Any, infill: Infill, n_ctx: int, param: str) -> None:
    """Text that cannot fit the context whatever it tokenizes to is refused before tokenizing."""
    size = sum(len(t.encode("utf-8", errors="surrogatepass"))
               for t in (infill.prefix, infill.suffix, *(n + b for n, b in infill.extra)))
    longest = getattr(tokenizer, "max_token_bytes", 0)
    if n_ctx and longest and size > n_ctx * longest:
        raise ContextLengthError(f"This model's maximum context length is {n_ctx} tokens. The code is {size} "
                                 f"bytes, more than {n_ctx} tokens of at most {longest} bytes can hold.", param=param)


def infill_ids(tokenizer: Any, tokens: FimTokens, infill: Infill) -> list[int]:
    """The prompt's token ids (see the module's docstring), BOS before <|fim_prefix|> where the model adds one."""
    markers = _user_defined_markers(tokenizer, tokens)

    def text(value: str) -> list[int]:
        if not value:
            return []
        # parse_special=False leaves control tokens' text as text but would cut out user-defined
        # ones (Qwen's <tool_call>): those that mark structure are kept literal.
        literal = [m.span() for m in markers.finditer(value)] if markers is not None else []
        if literal:
            return tokenizer.encode(value, add_special=False, parse_special=False, literal=literal)
        return tokenizer.encode(value, add_special=False, parse_special=False)

    ids: list[int] = []
    if infill.extra:
        if tokens.rep is not None:
            ids += [tokens.rep, *text(REPO_NAME + "\n")]
        for name, body in infill.extra:
            if tokens.sep is not None:
                ids += [tokens.sep, *text(name + "\n")]
            ids += text(body)
        if tokens.sep is not None:
            ids += [tokens.sep, *text(CURRENT_FILE + "\n")]
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        ids.append(tokenizer.bos_id)    # after the other files, as llama.cpp puts it
    return ids + [tokens.pre, *text(infill.prefix), tokens.suf, *text(infill.suffix), tokens.mid]


def _user_defined_markers(tokenizer: Any, tokens: FimTokens) -> re.Pattern | None:
    """A pattern of the user-defined tokens that mark structure (this prompt's FIM tokens among
    them), the only special tokens parse_special=False still cuts out of client code."""
    if not hasattr(tokenizer, "marker_texts"):
        return None
    ids = (tokens.pre, tokens.suf, tokens.mid, tokens.rep, tokens.sep, tokens.pad)
    texts = tokenizer.marker_texts(*(tokenizer.token_text(i) for i in ids if i is not None)) - tokenizer.control_texts
    return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True)))) if texts else None


def _text(body: dict, name: str, bounds: Bounds) -> str:
    return read_text(body, name) or ""


def _extra(body: dict, name: str, bounds: Bounds) -> tuple[tuple[str, str], ...]:
    extra = body.get(name)
    if extra is None:
        return ()
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA:
        raise InvalidRequestError(f"'input_extra' must be an array of at most {MAX_EXTRA} "
                                  "{\"filename\", \"text\"} objects", param="input_extra")
    files = []
    for i, chunk in enumerate(extra):
        name = chunk.get("filename", "tmp") if isinstance(chunk, dict) else None
        text = chunk.get("text") if isinstance(chunk, dict) else None
        if not isinstance(name, str) or not isinstance(text, str):
            raise InvalidRequestError(f"'input_extra[{i}]' must be an object with string 'filename' and 'text'",
                                      param=f"input_extra[{i}]")
        files.append((name, text))
    return tuple(files)


def _string(description: str) -> Field:
    return Field(lambda name, b: optional("string", description=description), _text)


INFILL: Fields = {
    "input_prefix": _string("code before the cursor"),
    "input_suffix": _string("code after the cursor"),
    "prompt": _string("text appended to input_prefix (llama.cpp's meaning)"),
    "input_extra": Field(lambda name, b: {"type": ["array", "null"], "maxItems": MAX_EXTRA, "items": {
        "type": "object", "required": ["text"],
        "properties": {"filename": {"type": "string"}, "text": {"type": "string"}}},
        "description": "other files of the project, as repository context"}, _extra),
    "n_predict": limited("integer", None, "llama.cpp's name for max_tokens", row="max_tokens"),
    **SAMPLING,
    "logprobs": COMPLETION_LOGPROBS,
}

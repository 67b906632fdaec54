"""The vocabulary of a GGUF model: its `tokenizer.ggml.*` keys, read once, with llama.cpp's defaults,
and the bytes each token stands for. Shared: the gateway tokenizes with it, the worker builds its
grammar matcher's token table from it (shared.grammar).

Defaults and overrides follow llama.cpp's `llama_vocab::impl::load` (llama-vocab.cpp), so that a
file missing a key behaves as it does under llama.cpp.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.errors import TokenizerError

log = logging.getLogger(__name__)

SPACE_MARK = "\u2581"   # SentencePiece's visible space "▁"

# GGUF `tokenizer.ggml.token_type` values (llama.h, enum llama_token_type).
UNDEFINED, NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(7)

# Token texts llama.cpp treats as end-of-generation whatever their stored type; it also forces them
# to CONTROL, which makes them parse as special and hide in decoded text. "</s>" is left out: in
# Gemma 3 it is an HTML tag (user-defined), and llama.cpp lists it only for one OCR model.
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
})

# tokenizer.ggml.pre values whose llama.cpp pre-type turns on `add_bos` and `ignore_merges`.
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe"})


@dataclass(frozen=True, eq=False)
class Vocab:
    model: str                  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str                    # tokenizer.ggml.pre ("default" when absent, as llama.cpp does)
    tokens: list[str]           # [n_vocab] token texts; id = index
    types: list[int]            # [n_vocab] token types (constants above), END_OF_TURN_TEXTS forced to CONTROL
    scores: list[float]         # [n_vocab] SentencePiece merge priority (higher merges first); 0.0 if absent
    merges: list[str]           # BPE merges "left right", rank = index; empty for "llama"
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None          # tokenizer.ggml.eot_token_id when set
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool      # SentencePiece: prepend " " to text at the start and after a special token
    ignore_merges: bool         # BPE: a pre-token already in the vocabulary is kept whole (llama3 family)
    chat_template: str | None
    arch: str                   # general.architecture
    source: str                 # file name, for error messages
    fim_ids: dict[str, int] = field(default_factory=dict)  # tokenizer.ggml.fim_<part>_token_id present: part → id

    def __len__(self) -> int:
        return len(self.tokens)


def read_vocab(path: str | Path) -> Vocab:
    """Read the tokenizer keys of a GGUF file."""
    path = Path(path)
    name = path.name
    values = _read_fields(path)

    def scalar(key: str, default=None):
        value = values.get(key)
        if isinstance(value, _Array):
            raise TokenizerError(f"{name}: {key} is an array, not a single value")
        return default if value is None else value

    def array(key: str) -> list | None:
        value = values.get(key)
        if value is None:
            return None
        if not isinstance(value, _Array):
            raise TokenizerError(f"{name}: {key} is not an array")
        try:
            return value.to_list()
        except UnicodeDecodeError as exc:
            raise TokenizerError(f"{name}: {key} holds text that is not UTF-8") from exc

    model = scalar("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"{name} has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in ("gpt2", "llama"):
        raise TokenizerError(f"{name}: tokenizer model '{model}' is not supported (supported: gpt2, llama)")

    tokens = array("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{name} has no vocabulary (tokenizer.ggml.tokens is missing)")
    n_vocab = len(tokens)
    # llama.cpp names empty entries so that every id keeps a distinct text.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    types = array("tokenizer.ggml.token_type") or [NORMAL] * n_vocab
    scores = array("tokenizer.ggml.scores") or [0.0] * n_vocab
    if len(types) < n_vocab or len(scores) < n_vocab:
        raise TokenizerError(f"{name}: token types or scores are shorter than the vocabulary")
    types = [t if 0 <= t <= BYTE else UNDEFINED for t in types[:n_vocab]]
    for i, text in enumerate(tokens):
        if text in END_OF_TURN_TEXTS:
            types[i] = CONTROL

    pre = scalar("tokenizer.ggml.pre")
    if model == "gpt2":
        merges = array("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError(f"{name}: BPE tokenizer without tokenizer.ggml.merges")
        if pre is None:
            log.warning("%s has no tokenizer.ggml.pre; using 'default' as llama.cpp does", name)
            pre = "default"
        bos, eos, add_bos, space_prefix = 11, 11, pre in _LLAMA3_PRE, False
    else:
        merges = []
        pre = pre or "default"
        bos, eos, add_bos, space_prefix = 1, 2, True, True

    def token_id(key: str, default: int | None) -> int | None:
        value = scalar(key)
        if value is not None and 0 <= int(value) < n_vocab:
            return int(value)
        return default if default is not None and default < n_vocab else None

    bos_id = token_id("tokenizer.ggml.bos_token_id", bos)
    eos_id = token_id("tokenizer.ggml.eos_token_id", eos)
    add_bos = bool(scalar("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(scalar("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos_id is None:
        raise TokenizerError(f"{name}: add_bos_token is true but the file has no BOS token")
    if add_eos and eos_id is None:
        raise TokenizerError(f"{name}: add_eos_token is true but the file has no EOS token")

    return Vocab(
        model=model, pre=str(pre), tokens=tokens, types=types,
        scores=[float(s) for s in scores[:n_vocab]], merges=list(merges),
        bos_id=bos_id, eos_id=eos_id, eot_id=token_id("tokenizer.ggml.eot_token_id", None),
        add_bos=add_bos, add_eos=add_eos,
        add_space_prefix=bool(scalar("tokenizer.ggml.add_space_prefix", space_prefix)),
        ignore_merges=model == "gpt2" and pre in _LLAMA3_PRE,
        chat_template=scalar("tokenizer.chat_template"),
        arch=str(scalar("general.architecture", "")), source=name,
        fim_ids={part: i for part in ("pre", "suf", "mid", "pad", "rep", "sep")
                 if (i := token_id(f"tokenizer.ggml.fim_{part}_token_id", None)) is not None},
    )


def end_of_generation_ids(vocab: Vocab) -> frozenset[int]:
    """Ids that end a turn: EOS, the chat end-of-turn tokens present, and eot_token_id."""
    ids = {i for i, text in enumerate(vocab.tokens) if text in END_OF_TURN_TEXTS}
    ids.update(i for i in (vocab.eos_id, vocab.eot_id) if i is not None)
    return frozenset(ids)


def piece_table(vocab: Vocab) -> list[bytes]:
    """bytes of every token as llama.cpp's token_to_piece(special=True) renders it."""
    to_byte = {ch: b for b, ch in enumerate(_byte_alphabet())}
    pieces: list[bytes] = []
    for text, kind in zip(vocab.tokens, vocab.types):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            pieces.append(text.encode())
        elif kind == NORMAL:
            if vocab.model == "llama":
                pieces.append(text.replace(SPACE_MARK, " ").encode())
            else:
                pieces.append(bytes(to_byte[ch] for ch in text) if all(ch in to_byte for ch in text)
                              else text.encode())
        elif kind == BYTE:
            pieces.append(bytes([int(text[3:5], 16)]) if text.startswith("<0x") else text.encode())
        else:
            pieces.append(b"")      # unused / undefined tokens print nothing, as in llama.cpp
    return pieces


@functools.cache
def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte value (index = byte)."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return [alphabet[b] for b in range(256)]


class _Array:
    """A GGUF array value: a list of strings or a numpy array of numbers."""

    def __init__(self, data):
        self.data = data

    def to_list(self) -> list:
        return self.data.tolist() if isinstance(self.data, np.ndarray) else list(self.data)


def _read_fields(path: Path) -> dict[str, object]:
    """tokenizer.* and general.architecture values: scalars as Python values, arrays as _Array.

    Parsed by shared.gguf_reader: gguf.GGUFReader made a few numpy objects per array element
    (~1.5 M for Gemma's vocabulary, ~9 s); this reads the same keys in ~0.2 s.
    """
    from shared.gguf_reader import GGUFFormatError, read_header

    try:
        header = read_header(path)
    except GGUFFormatError as exc:
        # Worded like the worker's error for the same file: whichever process reads it first
        # reports it, so the message must not depend on that race.
        raise TokenizerError(f"cannot read tokenizer: {path}: not a valid GGUF file ({_one_line(exc)})") from exc
    except OSError as exc:
        raise TokenizerError(f"cannot read tokenizer from {path}: {_one_line(exc)}") from exc
    values: dict[str, object] = {}
    for key, value in header.fields.items():
        if not (key.startswith("tokenizer.") or key == "general.architecture"):
            continue
        values[key] = _Array(value) if isinstance(value, (list, np.ndarray)) else value
    return values


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__

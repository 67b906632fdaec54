"""The models one gateway serves: names and aliases → a GGUF path or a pullable name, with each
model's context size and keep-alive, from `[models] serve` and repeated `--model` flags.

`[models] serve` holds one model per line, options after the reference:

    serve =
        chat = ./models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf  aliases=assistant,coder  keep_alive=pinned
        small = smollm2-135m  context_length=2048  keep_alive=60

The first model is the default (a request without `model` goes to it). With `serve` empty the
repository holds the one model of `[model] model_path` under `[model] model_id`, as before.
Pure: no I/O; paths are resolved by the caller's function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from shared.errors import ConfigError

if TYPE_CHECKING:
    from shared.config import Config

PINNED = math.inf  # keep_alive of a model never unloaded for being idle
_OPTIONS = ("aliases", "context_length", "keep_alive")


@dataclass(frozen=True)
class ModelEntry:
    name: str  # the registry name: what /v1/models lists
    reference: str  # a GGUF path (absolute) or a pullable name (shared.model_store)
    aliases: tuple[str, ...] = ()  # other names a request's `model` may use
    context_length: int = 0  # 0 = [engine] context_length
    keep_alive: float | None = None  # seconds idle before it may be unloaded; PINNED; None = [models] keep_alive

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that selects this model: its own, its aliases, a path's file name and stem."""
        found = [self.name, *self.aliases]
        if self.reference.endswith(".gguf"):
            path = Path(self.reference)
            found += [path.name, path.stem]
        return tuple(dict.fromkeys(found))


def parse_keep_alive(raw: str, what: str) -> float:
    """'300' (seconds), '0' (unload when idle) or 'pinned' (never unloaded for idleness)."""
    text = raw.strip().lower()
    if text in ("pinned", "forever", "-1"):
        return PINNED
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or math.isinf(seconds):
        raise ConfigError(f"reame.conf: {what} = {raw!r}: expected seconds (such as 300, 0) or 'pinned'")
    return seconds


def parse_serve(text: str, resolve: Callable[[str], str]) -> tuple[ModelEntry, ...]:
    """`[models] serve`'s lines → entries. `resolve` turns a reference into what the model store
    takes (a path made absolute, a known name unchanged). Errors name the line."""
    entries: list[ModelEntry] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"[models] serve, line {number} ({line!r})"
        name, sep, rest = line.partition("=")
        name, words = name.strip(), rest.split()
        if not sep or not name or not words or any(c.isspace() for c in name):
            raise ConfigError(f"reame.conf: {where}: expected 'NAME = PATH-OR-MODEL-NAME [option=value ...]'")
        options: dict[str, str] = {}
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq or key not in _OPTIONS:
                raise ConfigError(f"reame.conf: {where}: unknown option {word!r} (known: {', '.join(_OPTIONS)})")
            options[key] = value
        try:
            context = int(options.get("context_length", "0"))
        except ValueError:
            context = -1
        if context < 0:
            raise ConfigError(f"reame.conf: {where}: context_length must be a whole number of tokens (0 = the default)")
        keep = options.get("keep_alive")
        entries.append(ModelEntry(
            name=name, reference=resolve(words[0]),
            aliases=tuple(a for a in options.get("aliases", "").split(",") if a),
            context_length=context,
            keep_alive=None if keep is None else parse_keep_alive(keep, f"{where} keep_alive")))
    return entries_checked(entries)


def entries_checked(entries: Iterable[ModelEntry]) -> tuple[ModelEntry, ...]:
    """No name or alias may select two models (a request would not know which it gets)."""
    owner: dict[str, str] = {}
    for entry in entries:
        for name in entry.names:
            if owner.get(name, entry.name) != entry.name:
                raise ConfigError(f"reame.conf: [models] the name {name!r} selects both "
                                  f"{owner[name]!r} and {entry.name!r}")
            owner[name] = entry.name
    return tuple(entries)


def entries_from_flags(references: Iterable[str]) -> tuple[ModelEntry, ...]:
    """`reame serve --model A --model B`: each under its registry name or its file's stem."""
    entries = []
    for reference in references:
        name = Path(reference).stem if reference.endswith(".gguf") else reference
        entries.append(ModelEntry(name=name, reference=reference))
    return entries_checked(entries)


class ModelRepository:
    """What a request's `model` field selects. The first entry is the default."""

    def __init__(self, entries: Iterable[ModelEntry]):
        self.entries = tuple(entries)
        if not self.entries:
            raise ConfigError("reame.conf: no model to serve ([model] model_path or [models] serve)")
        self._by_name = {name: entry for entry in self.entries for name in entry.names}

    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def lookup(self, requested: str | None) -> ModelEntry | None:
        """The entry a request names; the default when it names none; None when unknown (the
        caller answers 404 listing `served()`)."""
        if not requested:
            return self.default
        return self._by_name.get(requested)

    def served(self) -> list[str]:
        return [entry.name for entry in self.entries]


def repository_for(config: "Config", flag_models: Iterable[str] = ()) -> ModelRepository:
    """The models to serve: repeated --model flags, else `[models] serve`, else `[model]`
    model_path alone under `[model] model_id` (today's single model)."""
    flags = list(flag_models)
    if len(flags) > 1:
        return ModelRepository(entries_from_flags(flags))
    if config.models.serve.strip() and not flags:
        return ModelRepository(parse_serve(config.models.serve, _resolver(config)))
    reference = flags[0] if flags else config.model_reference()
    return ModelRepository([ModelEntry(name=config.model.model_id, reference=reference)])


def _resolver(config: "Config") -> Callable[[str], str]:
    from shared.config import is_model_name  # config imports this module: only at call time

    def resolve(value: str) -> str:
        return value if is_model_name(value) else str(config.resolve_path(value))
    return resolve


def default_keep_alive(config: "Config", entry: ModelEntry) -> float:
    return entry.keep_alive if entry.keep_alive is not None else parse_keep_alive(
        config.models.keep_alive, "[models] keep_alive")


def memory_budget(config: "Config", available: int) -> int:
    """[models] memory_budget in bytes; a share is of `available` (the RAM free at start-up)."""
    from shared.config import memory_bytes

    return memory_bytes(config.models.memory_budget, available, "[models] memory_budget")

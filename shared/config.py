"""reame.conf → frozen dataclasses, read once at start-up.

The file is INI (`[section]`, `key = value`). Every section and key must be known: a typo is
a start-up error naming the key, never a silently ignored setting. Relative paths are resolved
against the directory of the file they were read from.
"""
from __future__ import annotations

import configparser
import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from shared.errors import ConfigError
from shared.model_registry import parse_keep_alive

DEFAULT_CONFIG_NAME = "reame.conf"


@dataclass(frozen=True)
class ModelSection:
    model_path: str = "./models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"  # file path or a known name
    models_dir: str = "./models"
    model_id: str = "reame"
    chat_template: str = ""  # optional Jinja file overriding the GGUF's template


@dataclass(frozen=True)
class EngineSection:
    kernels: str = "auto"  # auto | reference
    threads: int = 0  # 0 = every CPU this process may run on
    context_length: int = 0  # 0 = the model's trained context, capped by max_context and the pool
    # 32768: Qwen2.5-Coder's and Gemma 3's trained length. It costs no memory by itself (the pool is
    # kv_cache_memory, reserved whatever the context); above it a 128k-trained model's one context
    # would want 4 GiB of float16 K/V even at 1B (Llama 3.2), and its prefill minutes on 2 cores.
    max_context: int = 32768
    prefill_chunk: int = 512
    kv_block_size: int = 16  # tokens per paged-KV block
    kv_dtype: str = "float16"  # float16 | float32 | q8_0
    k_dtype: str = ""  # K's dtype when it differs from kv_dtype ("" = kv_dtype)
    v_dtype: str = ""  # V's dtype when it differs from kv_dtype ("" = kv_dtype)
    kv_cache_memory: str = "1GiB"  # the KV block pool: bytes ("512MiB", "2GB") or a share of RAM ("10%")
    matmul_activations: str = "auto"  # auto | float32 | int8: the fast kernels' matmul inputs
    matmul_tiles: str = "auto"  # auto | off: int8 prompt chunks on AMX tiles where the CPU has them
    window_kv: str = "bounded"  # bounded | full: sliding-window layers' K/V kept to the window or not


@dataclass(frozen=True)
class SchedulerSection:
    """Continuous batching: the knobs' start values (a tuning coordinator may change them live)."""
    max_batch_size: int = 8  # sequences in one engine step
    token_budget: int = 512  # prompt-chunk + decode tokens in one engine step
    batching_window_ms: float = 2.0  # how long a lone request may wait for company
    attention_chunk: int = 512  # keys per online-softmax chunk
    # Decode-only steps after a prompt-chunk step, as a share of that step's time (0: decoders
    # only ride along in prompt-chunk steps).
    decode_share: float = 0.0


@dataclass(frozen=True)
class PrefixCacheSection:
    """Reuse of computed K/V for repeated prompt prefixes: in each worker's block pool, and in
    one LMDB store per host that every worker shares and that outlives restarts."""
    enabled: bool = True
    store_path: str = "~/.cache/reame/prefix-store"  # "" = RAM only, nothing persists
    store_budget: str = "2GiB"  # the store's payload bytes ("512MiB", "10GB")
    store_compression: str = "none"  # none | zstd (zstd saves ~7% on float16 K/V; restores 3x slower)
    store_restore: str = "auto"  # auto (the cheaper of restore and recompute, measured) | always | never
    isolation: str = "none"  # none | key | request: whose cached prefixes a request may reuse


@dataclass(frozen=True)
class LoggingSection:
    level: str = "info"
    log_prompts: bool = False


@dataclass(frozen=True)
class ServerSection:
    """What the gateway and its workers must agree on: where they meet and how liveness is judged."""
    state_dir: str = "~/.local/state/reame"  # runtime files (the default worker socket)
    endpoint: str = ""  # ZeroMQ endpoint; "" = ipc://<state_dir>/workers.ipc
    heartbeat_interval: float = 1.0  # seconds between a worker's heartbeats
    worker_timeout: float = 10.0  # a worker silent this long is dropped and its requests re-routed
    # CURVE over tcp:// (shared.zmq_keys): ZeroMQ key files from `reame keys generate`; "" = off.
    curve_gateway_key: str = ""  # the gateway's .key_secret on its host, its .key on workers' hosts
    curve_worker_key: str = ""  # this host's workers' .key_secret
    curve_authorized_keys: str = ""  # the gateway's directory of authorized workers' .key files
    insecure_tcp: bool = False  # allow a non-loopback tcp:// endpoint without CURVE


@dataclass(frozen=True)
class GatewaySection:
    host: str = "127.0.0.1"
    port: int = 8000
    allow_remote: bool = False  # a host other than loopback must be asked for explicitly
    api_key: str = ""  # "" = no authentication
    api_keys_file: str = ""  # one key per line, optionally after a name: tenants told apart ("" = none)
    max_body_bytes: int = 4 * 1024 * 1024
    read_timeout: float = 30.0  # seconds a client may take to send a request (slow-loris guard)
    write_timeout: float = 30.0  # seconds a stream may wait for its client to read before it is cancelled
    max_queue: int = 256  # requests waiting for a worker slot before 429
    queue_timeout: float = 60.0  # seconds a request waits for a worker before 503
    default_max_tokens: int = 0  # when a request gives none; 0 = the rest of the context
    max_n: int = 16
    max_jobs_per_request: int = 32  # choices one request may ask for (prompts × n)
    content_specials: str = "text"  # text | reject: special-token text inside chat messages
    allowed_hosts: str = ""  # Host names accepted besides `host` and loopback names, comma-separated
    cors_origins: str = ""  # browser origins allowed to call the API, comma-separated; "" = CORS off
    routing: str = "affinity"  # affinity (prefix, then host, then load) | least_loaded
    stored_response_hours: float = 720.0  # /v1/responses with store: kept this long (per key, in state_dir)
    stored_responses_per_key: int = 10000  # and at most this many per API key, the oldest deleted first
    stored_responses_path: str = ""  # the SQLite file of stored responses; "" = <[server] state_dir>/responses.sqlite


    @property
    def authenticated(self) -> bool:
        """Whether requests must carry an API key."""
        return bool(self.api_key or self.api_keys_file)


@dataclass(frozen=True)
class WorkerSection:
    drain_timeout: float = 120.0  # seconds SIGTERM waits for in-flight requests
    warmup: bool = True  # run one short generation before registering


@dataclass(frozen=True)
class ServeSection:
    workers: int = 0  # 0 = one per NUMA node
    restart_backoff_max: float = 30.0  # seconds; a crashed child restarts after 1, 2, 4 ... up to this


@dataclass(frozen=True)
class TuningSection:
    """What learns while serving. `adaptive = off` fixes everything at the shipped defaults:
    kernels and threads as [engine] says, the scheduler knobs as [scheduler] says, no speculation."""
    adaptive: bool = True  # the master switch (also --adaptive on|off)
    kernels: str = "adaptive"  # adaptive | fixed: kernel and thread choice measured online
    state_path: str = ""  # learned kernel tables and the strategy; "" = <[server] state_dir>/tuning
    profile_interval: float = 5.0  # seconds between a worker's profiles to the coordinator
    report_interval: float = 1800.0  # seconds between adaptive reports in the log
    kernel_explore_share: float = 0.05  # share of steps that time a candidate kernel/thread choice
    kernel_rollback: float = 0.10  # undo a switch when step time per row gets this much worse after it
    kernel_ban_seconds: float = 60.0  # how long a rolled-back choice may not be tried again
    kernel_calibration_seconds: float = 15.0  # most seconds start-up calibration may take (0: none)
    # A standalone coordinator for several gateways (`reame-coordinator` binds it, gateways connect):
    # "" = the coordinator runs inside the gateway.
    coordinator: str = ""  # ZeroMQ endpoint, e.g. tcp://10.0.0.5:5560
    curve_coordinator_key: str = ""  # the coordinator's .key_secret on its host, its .key on gateways' hosts
    curve_authorized_gateways: str = ""  # the coordinator's directory of the gateways' .key files


@dataclass(frozen=True)
class SpeculativeSection:
    """Drafting tokens seen before (in the prompt, or in an archive of earlier completions) and
    verifying several in one engine step. Greedy output is unchanged by it."""
    enabled: str = "auto"  # auto (on while [tuning] adaptive is on) | on | off
    max_draft: int = 8  # most drafted tokens verified per sequence and step
    archive_path: str = "~/.cache/reame/spec-archive"  # LMDB n-gram archive shared by a host's workers; "" = none
    archive_budget: str = "256MiB"


@dataclass(frozen=True)
class ModelsSection:
    """Several models behind one gateway (shared.model_registry): loaded on demand, unloaded when
    idle or to make room under the memory budget."""
    serve: str = ""  # one 'NAME = PATH-OR-NAME [aliases=a,b] [context_length=N] [keep_alive=S|pinned]' a line
    memory_budget: str = "60%"  # weights + KV pools of loaded models: bytes or a share of available RAM
    keep_alive: str = "300"  # seconds an idle model stays loaded; 0 = unload when idle; pinned = never
    load_timeout: float = 120.0  # seconds a request waits for its model to load, then 503 + Retry-After


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    prefix_cache: PrefixCacheSection = field(default_factory=PrefixCacheSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    server: ServerSection = field(default_factory=ServerSection)
    gateway: GatewaySection = field(default_factory=GatewaySection)
    worker: WorkerSection = field(default_factory=WorkerSection)
    serve: ServeSection = field(default_factory=ServeSection)
    tuning: TuningSection = field(default_factory=TuningSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    models: ModelsSection = field(default_factory=ModelsSection)
    source: str = ""  # the file this was read from ("" = built-in defaults)

    def resolve_path(self, value: str) -> Path:
        """A path from the config, relative to the config file's directory."""
        path = Path(os.path.expanduser(value))
        if path.is_absolute():
            return path
        base = Path(self.source).parent if self.source else Path.cwd()
        return (base / path).resolve()

    def model_reference(self) -> str:
        """model_path as the model store takes it: a known name unchanged, a path made absolute."""
        value = self.model.model_path
        if is_model_name(value):
            return value
        return str(self.resolve_path(value))

    @property
    def tuning_path(self) -> Path:
        """Where this deployment keeps what it learned: [tuning] state_path, else <[server] state_dir>/tuning.
        Never a directory of the user's shared by unrelated servers (one server's frozen placement,
        learned under a passing CPU hog, was once resumed by every server of that user)."""
        if self.tuning.state_path:
            return self.resolve_path(self.tuning.state_path)
        return self.resolve_path(self.server.state_dir) / "tuning"

    @property
    def kernel_tuning(self) -> bool:
        """Whether kernels and threads are chosen by measurement while serving."""
        return self.tuning.adaptive and self.tuning.kernels == "adaptive"

    @property
    def speculation(self) -> bool:
        """Whether workers draft tokens. `--adaptive off` turns it off whatever [speculative] says."""
        return self.tuning.adaptive and self.speculative.enabled != "off"

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint the gateway binds and workers connect to."""
        if self.server.endpoint:
            return self.server.endpoint
        return f"ipc://{self.resolve_path(self.server.state_dir) / 'workers.ipc'}"


_CHOICES = {
    ("engine", "kernels"): {"auto", "reference"},
    ("engine", "kv_dtype"): {"float32", "float16", "q8_0"},
    ("engine", "k_dtype"): {"", "float32", "float16", "q8_0"},
    ("engine", "v_dtype"): {"", "float32", "float16", "q8_0"},
    ("engine", "matmul_activations"): {"auto", "float32", "int8"},
    ("engine", "matmul_tiles"): {"auto", "off"},
    ("engine", "window_kv"): {"bounded", "full"},
    ("gateway", "content_specials"): {"text", "reject"},
    ("gateway", "routing"): {"affinity", "least_loaded"},
    ("logging", "level"): {"debug", "info", "warning", "error"},
    ("prefix_cache", "store_compression"): {"zstd", "none"},
    ("prefix_cache", "store_restore"): {"auto", "always", "never"},
    ("speculative", "enabled"): {"auto", "on", "off"},
    ("tuning", "kernels"): {"adaptive", "fixed"},
}


def _convert(section: str, key: str, raw: str, kind: Any) -> Any:
    raw = raw.strip()
    try:
        if kind is bool:
            lowered = raw.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
    except ValueError:
        raise ConfigError(f"reame.conf: [{section}] {key} = {raw!r} is not a valid {kind.__name__}") from None
    if (section, key) == ("engine", "kv_cache_memory"):
        memory_bytes(raw, 1, f"[{section}] {key}")  # syntax only; the share is resolved at start-up
    if (section, key) in (("prefix_cache", "store_budget"), ("speculative", "archive_budget")):
        if raw.endswith("%"):
            raise ConfigError(f"reame.conf: [{section}] {key} = {raw!r}: give a size such as 2GiB (a disk "
                              f"budget is not a share of RAM)")
        memory_bytes(raw, 1, f"[{section}] {key}")
    if (section, key) == ("models", "memory_budget"):
        memory_bytes(raw, 1, f"[{section}] {key}")
    if (section, key) == ("models", "keep_alive"):
        parse_keep_alive(raw, f"[{section}] {key}")
    choices = _CHOICES.get((section, key))
    if choices and raw not in choices:
        raise ConfigError(f"reame.conf: [{section}] {key} = {raw!r}; expected one of {sorted(choices)}")
    return raw


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def memory_bytes(value: str, total: int, what: str = "[engine] kv_cache_memory") -> int:
    """'512MiB', '2GB', '1073741824' or '10%' (of total) → bytes; ConfigError names the setting."""
    text = value.strip().lower().replace(" ", "")
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 < share <= 100:
                raise ValueError(text)
            return int(total * share / 100)
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = float(digits), text[len(digits):]
        if unit not in _UNITS or number <= 0:
            raise ValueError(text)
        return int(number * _UNITS[unit])
    except ValueError:
        raise ConfigError(f"reame.conf: {what} = {value!r}: expected a size such as 512MiB, 2GB or a "
                          f"share of RAM such as 10%") from None


def _section_types() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config) if f.name != "source"}


def parse_config(text: str, source: str = "") -> Config:
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=None)
    parser.optionxform = str  # keys are case-sensitive, like the dataclass fields
    try:
        parser.read_string(text, source=source or "<reame.conf>")
    except configparser.Error as exc:
        raise ConfigError(f"reame.conf: cannot parse {source or 'config'}: {exc}") from None
    sections = _section_types()
    values: dict[str, Any] = {}
    for name in parser.sections():
        if name not in sections:
            raise ConfigError(f"reame.conf: unknown section [{name}] (known: {', '.join(sections)})")
        cls = sections[name]
        hints = get_type_hints(cls)
        kwargs = {}
        for key, raw in parser.items(name):
            if key not in hints:
                raise ConfigError(f"reame.conf: unknown key '{key}' in [{name}]")
            kwargs[key] = _convert(name, key, raw, hints[key])
        values[name] = cls(**kwargs)
    return Config(**values, source=source)


# How this process's last load_config found its file: shared.logs.setup_logging, which every
# process calls right after loading its config, logs it (a ./reame.conf in the working directory
# was read silently).
loaded_from = ""


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read reame.conf: the given path, else $REAME_CONFIG, else ./reame.conf, else defaults."""
    global loaded_from
    explicit = path is not None or "REAME_CONFIG" in os.environ
    candidate = Path(path if path is not None else os.environ.get("REAME_CONFIG", DEFAULT_CONFIG_NAME))
    if not candidate.exists():
        if explicit:
            raise ConfigError(f"config file not found: {candidate}")
        loaded_from = f"config: no {DEFAULT_CONFIG_NAME} in the working directory {Path.cwd()}: built-in defaults"
        return Config()
    how = ("named by --config" if path is not None else "named by $REAME_CONFIG" if explicit
           else f"found in the working directory {Path.cwd()}")
    loaded_from = f"config: {candidate.resolve()} ({how})"
    try:
        text = candidate.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {candidate}: {exc.strerror}") from None
    return parse_config(text, str(candidate.resolve()))


def is_loopback(host: str) -> bool:
    """An address only this machine can reach (a name is resolved as the OS would when binding)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_model_name(value: str) -> bool:
    """A bare name (`smollm2-135m`) rather than a file path."""
    return not (os.sep in value or "/" in value or value.startswith("~") or value.endswith(".gguf"))


def model_flag(value: str | None) -> str | None:
    """A --model flag: a path is taken relative to the current directory, not the config file's."""
    if value is None or is_model_name(value):
        return value
    return str(Path(os.path.expanduser(value)).resolve())


def add_adaptive_flag(parser) -> None:
    """`--adaptive on|off`, the same on reame serve, reame-gateway and reame-worker."""
    parser.add_argument("--adaptive", choices=("on", "off"),
                        help="learn while serving (kernels, scheduler knobs, speculation) or keep "
                             "reame.conf's values fixed ([tuning] adaptive)")


def adaptive_flag(value: str | None) -> bool | None:
    """--adaptive's value as [tuning] adaptive (None: the flag was not given)."""
    return None if value is None else value == "on"


def override(config: Config, section: str, **changes: Any) -> Config:
    """A copy of `config` with some keys of one section replaced (command-line flags)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        return config
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **changes)})

"""Everything the handlers share: config, tokenizer, chat template, worker pool, metrics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from gateway.choice import Decoder
from gateway.coordinator.remote import RemoteTuning
from gateway.coordinator.service import TuningService
from gateway.metrics import Metrics
from gateway.prompts import EncodeProcesses, PromptEncoder
from gateway.structured import GrammarCache
from gateway.workers import WorkerPool
from shared.config import Config
from shared.zmq_keys import server_keys


@dataclass
class GatewayState:
    config: Config
    tokenizer: Any  # gateway.tokenizer.Tokenizer, or a test double with the same methods
    template: Any  # gateway.chat_template.ChatTemplate: render(), stop_strings
    decoder: Callable[[], Decoder]  # a fresh incremental decoder per choice
    pool: WorkerPool
    metrics: Metrics
    model_id: str
    model_aliases: frozenset[str]  # names a request's `model` may use
    stop_token_ids: tuple[int, ...]  # end-of-generation tokens the engine stops on
    hidden_ids: frozenset[int]  # tokens never shown as text (the same set)
    chat_stops: tuple[str, ...]  # end-of-turn markers the template writes as text, not as one token
    created: int
    prompts: PromptEncoder  # messages and prompts → token ids, off the event loop
    tuning: TuningService | RemoteTuning  # the tuning coordinator (here or standalone): profiles in, strategies out
    grammars: GrammarCache = field(default_factory=GrammarCache)  # response_format / grammar → llguidance


STATE = web.AppKey("state", GatewayState)


def build_state(config: Config, tokenizer: Any, template: Any, decoder: Callable[[], Decoder],
                model_path: Path, encode_processes: EncodeProcesses | None = None) -> GatewayState:
    """`encode_processes`: where long prompts are tokenized; without them (test doubles) all are
    tokenized on the gateway's threads. Whoever passes them closes them with `state.prompts.close()`."""
    metrics = Metrics()
    pool = WorkerPool(config.endpoint, metrics, heartbeat_interval=config.server.heartbeat_interval,
                      worker_timeout=config.server.worker_timeout, max_queue=config.gateway.max_queue,
                      queue_timeout=config.gateway.queue_timeout, curve=server_keys(config),
                      routing=config.gateway.routing,
                      # A worker of another model would turn these token ids into other text.
                      model_arch=getattr(tokenizer, "arch", None), vocab_size=tokenizer.vocab_size)
    end_ids = set(tokenizer.eot_ids)
    if tokenizer.eos_id is not None:
        end_ids.add(tokenizer.eos_id)
    model_id = config.model.model_id
    return GatewayState(
        config=config, tokenizer=tokenizer, template=template, decoder=decoder, pool=pool, metrics=metrics,
        model_id=model_id, model_aliases=frozenset({model_id, model_path.name, model_path.stem}),
        stop_token_ids=tuple(sorted(end_ids)), hidden_ids=frozenset(end_ids),
        chat_stops=tuple(getattr(template, "stop_strings", ())), created=int(time.time()),
        prompts=PromptEncoder(tokenizer, template, config.gateway.content_specials, encode_processes),
        tuning=tuning_service(config, pool))


def tuning_service(config: Config, pool: WorkerPool) -> TuningService | RemoteTuning:
    """The coordinator in this process, or the link to a standalone one ([tuning] coordinator).
    With adaptivity off there is nothing to coordinate: the in-process service only reports."""
    if config.tuning.coordinator and config.tuning.adaptive:
        return RemoteTuning(config, pool)
    return TuningService(config, pool)


def load_state(config: Config, model_path: Path) -> GatewayState:
    """The real thing: tokenizer and chat template read from the model's GGUF."""
    from gateway.chat_template import template_for
    from gateway.tokenizer import Tokenizer
    from gateway.tokenizer.stream import StreamDecoder

    tokenizer = Tokenizer.from_gguf(model_path)
    template = template_for(tokenizer, config)
    return build_state(config, tokenizer, template, lambda: StreamDecoder(tokenizer), model_path,
                       EncodeProcesses(model_path, config))

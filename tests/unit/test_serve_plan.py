"""`reame serve`'s pure parts: how workers are laid over NUMA nodes, and restart back-off."""
from __future__ import annotations

import argparse

import pytest

from reame.commands.serve import configure, plan_workers
from reame.supervisor import STABLE_S, next_backoff
from shared.errors import ConfigError


def test_one_worker_per_node_by_default():
    assert plan_workers(0, {0: [0, 1], 1: [2, 3]}) == [(0, None), (1, None)]


def test_memory_only_nodes_get_no_worker():
    assert plan_workers(0, {0: [0, 1], 1: []}) == [(0, None)]


def test_more_workers_than_nodes_split_the_cpus():
    assert plan_workers(2, {0: [0, 1]}) == [(0, [0]), (0, [1])]
    assert plan_workers(3, {0: [0, 1, 2, 3], 1: [4, 5]}) == [(0, [0, 1]), (0, [2, 3]), (1, None)]


def test_more_workers_than_cpus_is_an_error():
    with pytest.raises(ConfigError, match="more workers"):
        plan_workers(3, {0: [0, 1]})


def test_backoff_doubles_to_the_cap_and_resets_after_a_long_run():
    delays, d = [], 0.0
    for _ in range(7):
        d = next_backoff(d, ran_for=1.0, maximum=30.0)
        delays.append(d)
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert next_backoff(30.0, ran_for=STABLE_S, maximum=30.0) == 1


def test_flags_override_the_config(tmp_path):
    conf = tmp_path / "reame.conf"
    conf.write_text("[gateway]\nport = 9000\n[serve]\nworkers = 3\n")
    args = argparse.Namespace(config=str(conf), model="m.gguf", host=None, port=9100, workers=None,
                              api_key="k", state_dir="rel", adaptive="off")
    config = configure(args)
    assert (config.gateway.port, config.serve.workers, config.gateway.api_key) == (9100, 3, "k")
    assert config.model.model_path.endswith("/m.gguf") and config.server.state_dir.startswith("/")
    assert not config.tuning.adaptive and not config.speculation


def test_adaptive_flag_reaches_every_process(tmp_path):
    """--adaptive on|off on reame serve, reame-gateway and reame-worker sets [tuning] adaptive;
    reame serve hands its value to its children."""
    from gateway.main import build_parser as gateway_parser, configure as configure_gateway
    from reame.commands.serve import build_children
    from worker.main import build_parser as worker_parser, configure as configure_worker

    conf = tmp_path / "reame.conf"
    conf.write_text("[tuning]\nadaptive = true\n")
    assert not configure_gateway(gateway_parser().parse_args(["--config", str(conf), "--adaptive", "off"])).tuning.adaptive
    assert not configure_worker(worker_parser().parse_args(["--config", str(conf), "--adaptive", "off"])).tuning.adaptive
    assert configure_worker(worker_parser().parse_args(["--config", str(conf)])).tuning.adaptive
    args = argparse.Namespace(config=str(conf), model="m.gguf", host=None, port=None, workers=1,
                              api_key=None, state_dir=None, adaptive="off")
    gateway, workers = build_children(configure(args), tmp_path / "m.gguf")
    for child in [gateway, *workers]:
        assert child.argv[child.argv.index("--adaptive") + 1] == "off"



def test_a_worker_takes_its_store_path_from_the_command_line(tmp_path):
    """systemd's unit points the store at StateDirectory= (~ is hidden from it by ProtectHome)."""
    from worker.main import build_parser, configure as configure_worker

    conf = tmp_path / "reame.conf"
    conf.write_text("[prefix_cache]\nstore_path = ~/store\n")
    args = build_parser().parse_args(["--config", str(conf), "--store-path", "/var/lib/reame/prefix-store"])
    assert configure_worker(args).prefix_cache.store_path == "/var/lib/reame/prefix-store"
    args = build_parser().parse_args(["--config", str(conf)])
    assert configure_worker(args).prefix_cache.store_path == "~/store"

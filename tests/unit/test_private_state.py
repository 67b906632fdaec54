"""State directories and key files left open to other users by an older version or a loose umask
are made private at start-up, with a log line; another user's are refused (issue 41.7)."""
from __future__ import annotations

import logging
import os
import stat

import pytest

from gateway.auth import load_tenants
from gateway.coordinator.store import StrategyStore
from shared.config import parse_config
from shared.errors import ConfigError
from shared.private_state import make_private
from worker.engine.tuning.kernel_table_store import KernelTableStore

log = logging.getLogger("reame.test")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def loose_state(directory):
    """A state directory as umask 002 (or an older version) left it."""
    directory.mkdir()
    directory.chmod(0o775)
    (directory / "strategy.json").write_text('{"version": 1}')
    (directory / "strategy.json").chmod(0o666)
    return directory


def test_a_loose_directory_and_its_files_are_made_owner_only_with_a_log_line(tmp_path, caplog):
    state = loose_state(tmp_path / "tuning")
    with caplog.at_level(logging.WARNING, "reame.test"):
        make_private(state, "[tuning] state_path", log)
    assert mode(state) == 0o700 and mode(state / "strategy.json") == 0o600
    assert f"[tuning] state_path: {state} was open to other users (mode 775" in caplog.text
    assert f"{state / 'strategy.json'} was open to other users (mode 666" in caplog.text
    caplog.clear()
    make_private(state, "[tuning] state_path", log)
    assert caplog.text == ""  # once fixed, nothing more to say


def test_a_new_directory_is_owner_only_under_a_loose_umask(tmp_path):
    old = os.umask(0o002)
    try:
        make_private(tmp_path / "new" / "tuning", "[tuning] state_path", log)
    finally:
        os.umask(old)
    assert mode(tmp_path / "new" / "tuning") == 0o700


def test_the_coordinators_strategy_and_the_kernel_tables_are_made_private_when_loaded(tmp_path):
    state = loose_state(tmp_path / "tuning")
    assert StrategyStore(state).load() == {"version": 1}
    assert mode(state) == 0o700 and mode(state / "strategy.json") == 0o600
    StrategyStore(state).save({"version": 2})
    assert mode(state / "strategy.json") == 0o600

    tables = loose_state(tmp_path / "tables")
    store = KernelTableStore(tables, {"model": "m"})
    assert store.load() is None
    assert mode(tables) == 0o700 and mode(tables / "strategy.json") == 0o600
    old = os.umask(0o002)
    try:
        store.save({"0": ["int8", 2]})
    finally:
        os.umask(old)
    assert mode(store.path) == 0o600 and store.load() == {"0": ["int8", 2]}


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file owned by another user needs root")
def test_another_users_state_is_refused(tmp_path):
    state = loose_state(tmp_path / "tuning")
    os.chown(state / "strategy.json", 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        StrategyStore(state).load()
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        KernelTableStore(state, {}).load()


def keys_file(tmp_path, mode: int):
    path = tmp_path / "api-keys"
    path.write_text("alice sk-alice-0123456789\n")
    path.chmod(mode)
    return parse_config(f"[gateway]\napi_keys_file = {path}\n"), path


def test_an_api_keys_file_others_can_read_is_made_private_at_start_up(tmp_path, caplog):
    config, path = keys_file(tmp_path, 0o664)
    with caplog.at_level(logging.WARNING, "reame.gateway"):
        assert [t.name for _, t in load_tenants(config)] == ["alice"]
    assert mode(path) == 0o640  # the group may still read it (a service user's group), nobody else
    assert f"[gateway] api_keys_file: {path} was open to other users (mode 664" in caplog.text
    config, path = keys_file(tmp_path, 0o640)
    caplog.clear()
    load_tenants(config)
    assert mode(path) == 0o640 and caplog.text == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file owned by another user needs root")
def test_an_api_keys_file_of_another_user_is_refused(tmp_path):
    config, path = keys_file(tmp_path, 0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        load_tenants(config)


def test_a_curve_secret_key_others_can_read_is_made_private_when_loaded(tmp_path, caplog):
    from shared.zmq_keys import generate, load_key

    public, secret = generate(tmp_path, "gateway")
    secret.chmod(0o644)  # as an older version, or a copy under umask 022, left it
    with caplog.at_level(logging.WARNING, "reame.curve"):
        load_key(secret, need_secret=True, what="[server] curve_gateway_key")
    assert mode(secret) == 0o640
    assert f"[server] curve_gateway_key: {secret} was open to other users (mode 644" in caplog.text
    public.chmod(0o644)
    load_key(public, need_secret=False, what="[server] curve_gateway_key")
    assert mode(public) == 0o644  # a public key is meant to be read


def test_the_speculation_archive_left_open_is_made_private(tmp_path, caplog):
    from worker.speculative.archive_store import ArchiveStore

    where = tmp_path / "spec-archive"
    where.mkdir()
    where.chmod(0o755)  # it holds completions: anyone could read them
    with caplog.at_level(logging.WARNING, "reame.spec"):
        ArchiveStore(where, model=b"m" * 8, order=4, budget_bytes=1 << 20).close()
    assert mode(where) == 0o700
    assert f"n-gram archive at {where}: {where} was open to other users (mode 755" in caplog.text

"""What a caller of /admin/* learns when the remote coordinator fails (issue 41.7): a refusal's
message, but of a bug only that it failed; the detail goes to the gateway's log."""
from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.coordinator.remote import RemoteTuning
from gateway.coordinator.server import CoordinatorServer
from gateway.errors import ServiceUnavailableError
from shared.config import parse_config
from shared.errors import ConfigError
from shared.protocol import AdminCall, AdminReply

SECRET = "KeyError: '/var/lib/reame/tenant-7/strategy.json' holds {'api_key': 'sk-123'}"


class Pool:
    on_profile = on_register = None


def answered(reply: dict):
    """RemoteTuning.call against a coordinator that answers every call with `reply`."""
    tuning = RemoteTuning(parse_config("[tuning]\ncoordinator = ipc:///nonexistent/coordinator.ipc\n"), Pool())
    tuning.last_heard = tuning.clock()

    def send(message) -> bool:
        if isinstance(message, AdminCall):
            asyncio.get_running_loop().call_soon(tuning._calls[message.call_id].set_result,
                                                 AdminReply(message.call_id, **reply))
        return True
    tuning._send = send
    return asyncio.run(tuning.call("import", {"slots": {}}))


def test_a_coordinator_bug_reaches_the_caller_as_a_generic_503_and_the_log_in_full(caplog):
    with caplog.at_level(logging.WARNING, "reame.coordinator"), pytest.raises(ServiceUnavailableError) as caught:
        answered({"error": "KeyError", "message": SECRET})
    assert caught.value.status == 503
    assert "sk-123" not in caught.value.message and "/var/lib" not in caught.value.message
    assert "failed to answer 'import'" in caught.value.message
    assert SECRET in caplog.text


def test_a_refusal_keeps_its_message():
    with pytest.raises(ConfigError, match="unknown slot 'x'"):
        answered({"error": "ConfigError", "message": "unknown slot 'x'"})
    assert answered({"body": '{"ok": true}'}) == {"ok": True}


def test_the_coordinator_answers_a_bug_with_a_stable_message_and_logs_the_exception(tmp_path, caplog):
    """Before, reame-coordinator sent str(exc) to the gateway in its AdminReply."""
    config = parse_config(f"[tuning]\ncoordinator = ipc://{tmp_path}/coordinator.ipc\n"
                          f"state_path = {tmp_path / 'tuning'}\n")
    server = CoordinatorServer(config)

    async def failing(action, argument):
        raise KeyError(SECRET)
    server.tuning.call = failing
    with caplog.at_level(logging.ERROR, "reame"):
        reply = asyncio.run(server._reply(AdminCall("7", "import", '{"slots": {}}')))
    assert reply.error == "InternalError" and not reply.body
    assert reply.message == "the coordinator failed to answer 'import' (call 7); its log has the detail"
    assert "sk-123" in caplog.text and "import (call 7) failed" in caplog.text

"""One log format for every Reame process: time, process role, level, message — to stderr.

Messages may carry text a client chose (a request id, a URL path). Control characters in them
are escaped, so that no client can start a forged log line or send terminal escapes to whoever
reads the log; tracebacks, which Reame itself writes, keep their line breaks.
"""
from __future__ import annotations

import copy
import logging
import re
import sys

from shared import config

# Libraries whose debug output is about their own internals: at `level = debug` numba alone logs
# megabytes of compiler IR per kernel and compiles several times slower (seen: a cold worker start
# past three minutes). Reame's debug level is for Reame's messages.
_QUIET_LIBRARIES = ("numba", "llvmlite", "asyncio", "filelock", "urllib3")

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_control(text: str) -> str:
    """`text` with every control character written as a Python escape (`\\n`, `\\x1b`)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class SafeFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record = copy.copy(record)  # other handlers may still want the original
        record.message = escape_control(record.message)
        return super().formatMessage(record)


def setup_logging(level: str, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter(f"%(asctime)s {role} %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(logging.INFO, root.level))
    if config.loaded_from:  # which file this process's settings came from, at its start-up
        logging.getLogger("reame").info("%s", config.loaded_from)

"""shared.logs: Reame's debug level does not turn on the libraries' internals."""
from __future__ import annotations

import logging

from shared.logs import setup_logging


def test_debug_level_keeps_numba_compiler_logs_off():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("debug", "test")
        assert logging.getLogger("reame.worker").isEnabledFor(logging.DEBUG)
        assert not logging.getLogger("numba.core.ssa").isEnabledFor(logging.DEBUG)
        assert logging.getLogger("numba").isEnabledFor(logging.WARNING)
        setup_logging("error", "test")
        assert not logging.getLogger("numba").isEnabledFor(logging.WARNING)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("numba").setLevel(logging.NOTSET)

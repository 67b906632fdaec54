"""Children that leave when the process that started them dies, however it dies.

A SIGKILLed or OOM-killed `reame serve` (or model front) runs no cleanup: without this its
gateway and workers lived on, holding their memory and ports. Linux's prctl(PR_SET_PDEATHSIG)
has the kernel send the child SIGTERM when its parent goes: SIGTERM, not SIGKILL, so a worker
drains and saves its tuning state as on any stop.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def exit_with_parent() -> Callable[[], None] | None:
    """A subprocess preexec_fn that has the child sent SIGTERM when this process dies; None where
    the platform has no PR_SET_PDEATHSIG (children outlive a killed parent there).

    The signal follows the thread that forked: start children from a thread that lives as long as
    the process (the main one, or the event loop's). The libc function is looked up here, in the
    parent: the child only calls it between fork and exec. A child whose parent died between the
    fork and the prctl exits at once, since nothing would signal it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec

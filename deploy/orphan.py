"""A local cluster's members never outlive the process that started them.

``splitserve up`` (and the tests' clusters, deploy/launcher.py) start each member in a
session of its own, so that a terminal's Ctrl-C reaches the launcher alone and the
launcher stops the members in order. The price: a launcher killed outright (SIGKILL, an
out-of-memory kill, a test runner's timeout) left every member running, serving and
heartbeating with nobody to stop it. Two guards close that:

    member          guard
    router, nodes   ``watch_launcher()``: the launcher's pid is in $SPLITSERVE_LAUNCHER_PID;
                    once the member's parent is another process (the launcher died and the
                    member was re-parented), it SIGTERMs itself and drains as on any stop
    redis-server    ``die_with_launcher`` as its ``preexec_fn``: the kernel SIGTERMs it when
                    the launcher thread that started it exits (PR_SET_PDEATHSIG; the
                    launcher keeps that thread until Redis is stopped)

Must not decide when a member stops otherwise (the launcher and the supervisor do).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "SPLITSERVE_LAUNCHER_PID"
POLL_S = 1.0  # how soon a member notices its launcher is gone
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launcher_env() -> dict[str, str]:
    """What a member's environment carries for ``watch_launcher``: this process's pid."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def watch_launcher() -> bool:
    """In a member: stop (SIGTERM to itself) once its launcher is gone. True when a watch
    started ($SPLITSERVE_LAUNCHER_PID set and the launcher still the parent)."""
    raw = os.environ.get(LAUNCHER_PID_ENV)
    if not raw:
        return False
    try:
        launcher = int(raw)
    except ValueError:
        log.warning("$%s is not a pid (%r): not watching the launcher", LAUNCHER_PID_ENV, raw)
        return False
    if os.getppid() != launcher:
        # Started by another process (a worker rank's launch, a user's shell that kept the
        # variable): its own parent is not the launcher, so the variable is not for it.
        return False
    threading.Thread(target=_watch, args=(launcher,), name="launcher-watch", daemon=True).start()
    return True


def _watch(launcher: int) -> None:
    stop = threading.Event()
    while not stop.wait(POLL_S):
        if os.getppid() != launcher:
            log.warning("the launcher (pid %d) is gone: stopping", launcher)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def die_with_launcher() -> None:
    """A ``preexec_fn``: the child gets SIGTERM when the thread that started it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

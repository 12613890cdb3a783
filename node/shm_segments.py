"""Names of the /dev/shm KV segments of node processes, and the removal of those
whose owner died.

A decode node on the shm transport keeps its KV pool in ``/dev/shm/<name>`` with
``name = splitserve-kv-<owner pid>-<8 hex>``. It removes its own on exit (SIGTERM
included: node/runtime.py); a process killed with SIGKILL cannot, so every node
removes the segments of owners that no longer run when it starts.

Must not remove a segment whose owner is alive (another node on this host), or any
file not named like ours.
"""

from __future__ import annotations

import os
import re
import uuid

SHM_DIR = "/dev/shm"
PREFIX = "splitserve-kv-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]{{8}}$")


def segment_name(pid: int) -> str:
    """A fresh segment name owned by ``pid``."""
    return f"{PREFIX}{pid}-{uuid.uuid4().hex[:8]}"


def owner_pid(name: str) -> int | None:
    """The pid in a segment name; None when the name is not one of ours."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def list_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Our segment names present now."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if owner_pid(n) is not None)
    except FileNotFoundError:
        return []


def remove_dead_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments whose owner process is gone; returns their names."""
    removed = []
    for name in list_segments(shm_dir):
        pid = owner_pid(name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:  # another starting node removed it first
                pass
    return removed

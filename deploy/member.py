"""One member process of a local cluster (deploy/launcher.py): its ``Popen``, the address
of its READY line, and its last lines of output, echoed with its name unless
$SPLITSERVE_QUIET=1. Must not start, stop or judge it (the launcher, the supervisor and
deploy/readiness.py do).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field


@dataclass(slots=True)
class Proc:
    name: str
    popen: subprocess.Popen[str]  # stdout piped as text (Cluster._spawn)
    ready: threading.Event = field(default_factory=threading.Event)
    addr: str = ""
    log: list[str] = field(default_factory=list)  # the last lines it printed
    args: list[str] = field(default_factory=list)  # splitserve.cli arguments, to start it again
    role: str = ""  # prefill | decode | colocated | router | fleet (its --cpus key)

    def pump(self) -> None:
        """Read the child's output: catch its READY line, echo the rest with its name."""
        assert self.popen.stdout is not None, "started with stdout=PIPE"
        for line in self.popen.stdout:
            line = line.rstrip()
            self.log = (self.log + [line])[-50:]
            if line.startswith("READY ") and not self.ready.is_set():
                self.addr = line.split()[1]
                self.ready.set()
            elif os.environ.get("SPLITSERVE_QUIET") != "1":
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

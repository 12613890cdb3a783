"""The supervisor of ``splitserve up``: restarts a member of the local cluster that
died, with exponential backoff, and never stops the others for it.

Owns the restart policy and its counters, and the launcher's status endpoint::

    GET http://127.0.0.1:<status port>/status   JSON: every member: alive, restarts, last exit code
    GET http://127.0.0.1:<status port>/metrics  splitserve_launcher_restarts_total{member}

A dead node's node registry record is deleted at once (routers forget it within one
discovery poll instead of one record TTL); the restarted node registers under the
same node id with a new epoch, so prefix-index entries of the old one are never read.

Must not start processes itself (``Cluster.respawn`` does) or stop the cluster: only
the launcher's Ctrl-C / SIGTERM does that.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
HEALTHY_AFTER_S = 30.0  # a member that ran this long restarts with the shortest backoff again


@dataclass(slots=True)
class MemberState:
    """Supervision state of one member (a node, the router or Redis)."""
    name: str
    restarts: int = 0
    failures_in_row: int = 0  # deaths without HEALTHY_AFTER_S of uptime in between
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # when a dead member is started again
    last_exit: int | None = None

    def backoff_s(self) -> float:
        return min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** max(0, self.failures_in_row - 1))


class Supervisor:
    """``poll()`` (from the launcher's main loop) notices deaths and restarts members
    when their backoff passed. ``alive(name) -> exit code or None``, ``respawn(name)``
    starts the member again, ``on_death(name)`` cleans up after it (node registry record)."""

    def __init__(self, names: Callable[[], list[str]], exit_code: Callable[[str], int | None],
                 respawn: Callable[[str], None], on_death: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self._names = names
        self._exit_code = exit_code
        self._respawn = respawn
        self._on_death = on_death
        self._clock = clock
        self.members: dict[str, MemberState] = {}  # name -> state
        self._lock = threading.Lock()  # the status server reads members from its thread
        self._server: ThreadingHTTPServer | None = None

    def poll(self) -> None:
        now = self._clock()
        for name in self._names():
            m = self.members.get(name)
            if m is None:
                m = self.members[name] = MemberState(name, started_at=now)
            if m.restart_at is None:
                code = self._exit_code(name)
                if code is None:
                    continue
                with self._lock:
                    m.last_exit = code
                    m.failures_in_row = 1 if now - m.started_at >= HEALTHY_AFTER_S else m.failures_in_row + 1
                    m.restart_at = now + m.backoff_s()
                print(f"[splitserve] {name} exited with {code}; restarting in {m.backoff_s():.1f}s "
                      f"(restart #{m.restarts + 1})", file=sys.stderr, flush=True)
                try:
                    self._on_death(name)
                except Exception as e:  # cleanup is best effort; the restart matters
                    print(f"[splitserve] cleanup after {name} failed: {e!r}", file=sys.stderr, flush=True)
            elif now >= m.restart_at:
                try:
                    self._respawn(name)
                except Exception as e:
                    print(f"[splitserve] restarting {name} failed: {e!r}", file=sys.stderr, flush=True)
                    with self._lock:
                        m.failures_in_row += 1
                        m.restart_at = now + m.backoff_s()
                    continue
                with self._lock:
                    m.restarts += 1
                    m.restart_at = None
                    m.started_at = now

    def status(self) -> dict:
        with self._lock:
            return {"members": [{"name": m.name, "alive": m.restart_at is None, "restarts": m.restarts,
                                 "last_exit": m.last_exit} for m in self.members.values()],
                    "restarts_total": sum(m.restarts for m in self.members.values())}

    def metrics_text(self) -> str:
        lines = ["# HELP splitserve_launcher_restarts_total members restarted by `splitserve up`",
                 "# TYPE splitserve_launcher_restarts_total counter"]
        for m in self.status()["members"]:
            lines.append(f'splitserve_launcher_restarts_total{{member="{m["name"]}"}} {m["restarts"]}')
        return "\n".join(lines) + "\n"

    # ---- status endpoint ---------------------------------------------------------------------
    def serve_status(self, port: int = 0) -> int:
        """Serve /status and /metrics on 127.0.0.1:``port`` (0: a free one) in a thread; the port."""
        sup = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path == "/status":
                    body, ctype = json.dumps(sup.status()).encode(), "application/json"
                elif self.path == "/metrics":
                    body, ctype = sup.metrics_text().encode(), "text/plain; version=0.0.4"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self._server.serve_forever, name="launcher-status", daemon=True).start()
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

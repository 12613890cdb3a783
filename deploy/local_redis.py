"""The redis-servers a local cluster starts (``splitserve up``, the tests' clusters), and
how: each on 127.0.0.1 and a free port (or a given one: starting it again on the same
port is a Redis restart), no persistence, its config (the password included) on its
stdin, never on its command line, and an environment without any splitserve secret
(deploy/member_secrets.py). ``up``'s own run in a session of their own, so a terminal's
Ctrl-C reaches ``up`` alone, which stops them last, after every node deregistered.

``up`` starts two, with different duties and so different eviction policies:

    instance    holds                                   when full (maxmemory)
    main        node registry, prefix index, the        noeviction: writes fail and say so; a
                routers' shared recent work             node registry record or index entry is never
                                                        dropped behind its owner's back
    responses   stored /v1/responses                    volatile-lru: only entries with a TTL (the
                (router --responses-redis-url)          responses) are evicted, never the store's
                                                        accounting (no TTL), which then over-counts
                                                        an evicted entry until its expiry, never
                                                        under-counts; the router's own budget
                                                        (--responses-max-bytes, RESPONSES_SHARE of
                                                        maxmemory) refuses first, so eviction is
                                                        the backstop

Must not know what the members store in them.
"""

from __future__ import annotations

import socket
import subprocess
import time
from typing import NamedTuple

from .member_secrets import scrubbed_env
from .orphan import die_with_launcher
from .ports import free_port

START_TIMEOUT_S = 10.0
RESPONSES_SHARE = 0.75  # the responses store's budget: this share of its Redis's maxmemory


class RedisPolicy(NamedTuple):
    """A redis-server's memory bound and what it does once there."""
    maxmemory_bytes: int | None  # None: unbounded
    eviction: str  # its maxmemory-policy


MAIN_EVICTION = "noeviction"
RESPONSES_EVICTION = "volatile-lru"


def start_redis(port: int | None = None, password: str | None = None, policy: RedisPolicy | None = None,
                own_session: bool = False) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on ``port`` (None: a free loopback port), requiring
    ``password`` when given, bounded by ``policy`` when given; with ``own_session`` in a
    session of its own (signals to the caller's process group miss it). (process, url
    with the password)."""
    port = port or free_port()
    proc = subprocess.Popen(["redis-server", "-", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=scrubbed_env(), start_new_session=own_session,
                            preexec_fn=die_with_launcher)  # never outlives its starter (deploy/orphan.py)
    assert proc.stdin is not None, "started with stdin=PIPE"
    with proc.stdin:  # `redis-server -` reads config lines from stdin until it closes
        proc.stdin.write(_config(password, policy).encode())
    hello = (f"AUTH {password}\r\n" if password else "").encode() + b"PING\r\n"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(hello)
                time.sleep(0.02)
                if b"+PONG" in s.recv(64):
                    user = f":{password}@" if password else ""
                    return proc, f"redis://{user}127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start (is it installed? deploy/setup.sh installs it)")


def _config(password: str | None, policy: RedisPolicy | None) -> str:
    lines = []
    if password:
        quoted = password.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'requirepass "{quoted}"')
    if policy is not None:
        if policy.maxmemory_bytes is not None:
            lines.append(f"maxmemory {policy.maxmemory_bytes}")
        lines.append(f"maxmemory-policy {policy.eviction}")
    return "".join(line + "\n" for line in lines)


def responses_budget(maxmemory_bytes: int) -> int:
    """The router's --responses-max-bytes for a responses Redis of ``maxmemory_bytes``."""
    return int(maxmemory_bytes * RESPONSES_SHARE)

"""A userspace ``tc netem`` for kernels without sch_netem: a point-to-point link made
of two TUN devices, one moved into each namespace, and a thread in this process that
carries every packet from one to the other after a delay (with jitter, so packets
may reorder as under netem) or drops it.

    ns a: dev a_dev --(fd)--> Shaper thread: hold delay +- jitter, drop loss --(fd)--> dev b_dev :ns b
    (and back)

Owns the two TUN file descriptors (closing them removes both devices) and the
thread. Must not configure addresses or routes (netns_lab.Lab does).
"""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import select
import struct
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    """A new TUN device ``name`` (raw IP packets, no header) owned by the returned fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Shaper:
    """Carries packets between two TUN fds; ``set(delay_s, jitter_s, loss)`` at any time."""

    def __init__(self, fd_a: int, fd_b: int, seed: int = 0):
        self.fds = (fd_a, fd_b)
        self.delay_s, self.jitter_s, self.loss = 0.0, 0.0, 0.0
        self.carried = self.dropped = 0
        self._rng = random.Random(seed)
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="netns-shaper", daemon=True)
        self._thread.start()

    def set(self, delay_s: float = 0.0, jitter_s: float = 0.0, loss: float = 0.0) -> None:
        self.delay_s, self.jitter_s, self.loss = delay_s, jitter_s, loss

    def _run(self) -> None:
        queue: list[tuple[float, int, int, bytes]] = []  # (due, seq, out fd, packet): a heap
        seq = 0
        while not self._stop:
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, out, pkt = heapq.heappop(queue)
                try:
                    os.write(out, pkt)
                    self.carried += 1
                except OSError:  # the device is down or gone: the packet is lost
                    self.dropped += 1
            timeout = max(0.0, queue[0][0] - now) if queue else None
            ready, _, _ = select.select([*self.fds, self._wake_r], [], [], timeout)
            for fd in ready:
                if fd == self._wake_r:
                    continue
                out = self.fds[1] if fd == self.fds[0] else self.fds[0]
                while True:
                    try:
                        pkt = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    if self.loss and self._rng.random() < self.loss:
                        self.dropped += 1
                        continue
                    hold = self.delay_s + (self._rng.gauss(0.0, self.jitter_s) if self.jitter_s else 0.0)
                    seq += 1
                    heapq.heappush(queue, (time.monotonic() + max(0.0, hold), seq, out, pkt))

    def close(self) -> None:
        """Stop the thread and close both fds (the devices disappear). Idempotent."""
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        for fd in (*self.fds, self._wake_r, self._wake_w):
            os.close(fd)

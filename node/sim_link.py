"""SimLink: the KV network of a simulated prefill node, as the deployment it stands for
would carry its transfers (``SimConfig.kv_network_bytes_per_s``, from the profile's
``kv_network``: e.g. one 400 Gb/s RDMA NIC per GPU).

A simulated node's KV cache holds tiny stand-in blocks, and the real transport moves
them; what that costs this machine (Python per block, a loopback socket) is not what
moving the modelled model's blocks costs the deployment. So a prefill node books each
batch of blocks on its link when it is packed (a step's completed blocks when the step
ends; a cached prefix when its blocks are in place, before the first forward), and holds the
request's answer (``PrefillResult``, which the decode node waits for before it admits
the request) until the last of them would have arrived::

    book(n blocks) at t:   start = max(t, link free)          (behind this node's earlier batches)
                           link free = start + n x block bytes / rate / speedup
                           due = link free + latency / speedup
    arrive(due):           the real move done (every frame acknowledged): sleep until due

So a transfer overlaps the later chunks' computation as the real sender's does, the
blocks the decode node already holds are never booked (they are never sent), and a
request's wait is (blocks the decode node lacks x the modelled block's bytes) / the
node's link rate + latency, plus the queue behind this node's other transfers. Only the
sender's link is modelled: a decode node's own link is not a queue here (at the rates of
the stated networks, a decode node receiving from 4 prefill nodes is far from full).

A real move that outlasts its modelled time is counted (``late``, ``late_s``: wall
seconds beyond ``due``): this machine could not move the stand-ins at the speed-up's
pace, and a run must say so instead of reporting its TTFT (``/debug/state``:
``sim_link``).

Must not: touch blocks or the transport (the node's sender moves them), or price
anything but the network (the engine's step time is engine/sim_runner.py's).
"""

from __future__ import annotations

import asyncio
import time

from ..common.config import SimConfig


class SimLink:
    def __init__(self, sim: SimConfig, block_size: int):
        assert sim.kv_network_bytes_per_s > 0, "SimLink needs a modelled network"
        self.block_s = sim.transfer_seconds(1, block_size) / sim.speedup  # wall seconds per block
        self.latency_s = sim.kv_network_latency_s / sim.speedup
        self._free_at = 0.0  # monotonic: when the last booked block has left
        self.transfers = 0  # answers held (one per request)
        self.blocks = 0  # blocks booked
        self.late = 0  # transfers whose real move ended after their modelled arrival
        self.late_s = 0.0  # wall seconds the real moves ran beyond the modelled ones, summed
        self.max_late_s = 0.0

    def book(self, blocks: int) -> float:
        """Put ``blocks`` on the link now (they were just packed); when the last of them
        arrives (monotonic wall time)."""
        start = max(time.monotonic(), self._free_at)
        self._free_at = start + blocks * self.block_s
        self.blocks += blocks
        return self._free_at + self.latency_s

    async def arrive(self, due: float) -> None:
        """Once the real move is done: until ``due``, the modelled arrival of the request's
        last block; a real move that took longer is counted."""
        self.transfers += 1
        left = due - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)
            return
        self.late += 1
        self.late_s += -left
        self.max_late_s = max(self.max_late_s, -left)

    def state(self) -> dict:
        """What ``/debug/state`` shows (``sim_link``); seconds are wall seconds."""
        return {"transfers": self.transfers, "blocks": self.blocks, "late": self.late,
                "late_s": round(self.late_s, 4), "max_late_s": round(self.max_late_s, 4),
                "block_s": self.block_s, "latency_s": self.latency_s}

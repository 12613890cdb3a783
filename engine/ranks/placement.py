"""Where one rank of a node runs: its device, its share of the host's cores, its torch threads.

Owns the per-rank defaults every rank applies alike as it starts (rank 0 in bringup.py, a
worker in worker.py), so ranks that share a host never fight over cores. Must not: start
processes or join a group (launch.py, worker.py, engine/parallel/group.py).
"""

from __future__ import annotations

import os

import torch


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device when a node runs on ``device``: the CPU for every rank,
    ``cuda:(k + rank)`` for ``cuda:k`` (``cuda`` means ``cuda:0``). A node that places
    its ranks otherwise passes each rank its device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def rank_cpus(rank: int, size: int, device: torch.device) -> set[int] | None:
    """The cores rank ``rank`` runs on when CPU ranks share this host: its even share of the
    cores this process may use (rank 0 the first). None: not a CPU rank of several, or fewer
    cores than ranks (nothing to pin)."""
    cpus = sorted(os.sched_getaffinity(0))
    if device.type != "cpu" or size < 2 or len(cpus) < size:
        return None
    per = len(cpus) // size
    return set(cpus[rank * per:(rank + 1) * per])


def pin_process(cpus: set[int]) -> set[int]:
    """Run every thread of this process (and those it starts later) on ``cpus``; returns the
    cores it could use before. Ranks that wait on each other in every layer must not be
    pulled onto one core by the scheduler (a woken task goes to its waker's core): measured
    here, unpinned ranks took turns on one core and each all-reduce cost ~2 ms instead of
    ~0.3 ms (benchmarks/engine/bench_tp.py)."""
    before = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass
    return before


def rank_threads(num_threads: int | None, size: int, device: torch.device) -> int | None:
    """Torch threads for one rank: ``num_threads`` when given; on the CPU with several
    ranks, this process's cores split evenly (ranks on one host must not fight over
    cores); else None (torch's default)."""
    if num_threads:
        return num_threads
    if size > 1 and device.type == "cpu":
        return max(1, len(os.sched_getaffinity(0)) // size)
    return None

"""The tensor-parallel group of one node's ranks: who this rank is (``rank``, ``size``,
``device``) and the collectives the sharded model runs, every one bounded by a timeout.

Owns ``TPGroup`` (all_reduce, all_gather, broadcast, min_int), ``DataParallel`` (a
data-parallel node's ranks over such a group: its step clock, the ledger of a forward's
collectives), ``init_tp_group`` (a
``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` on CUDA, built with their
constructors over a ``TCPStore`` rendezvous, never ``init_process_group``: a node's
KV transports make groups of their own, kvtransfer/backends/pair_group.py) and the per-rank
defaults (``rank_device``, ``rank_threads``). Must not: know the model, the step
channel (parallel/step_channel.py) or how ranks are started (parallel/launch.py).

A TP=1 engine holds ``TPGroup.single(device)``: every collective returns its input
untouched, and the model checks ``size > 1`` once when it is built, so TP=1 runs the
exact pre-TP code (not even an identity call per layer).

Failure is bounded (ARCHITECTURE.md: a rank's death is the node's death)::

    a peer dies (kill -9)      gloo: its sockets close, the op in flight fails at once
    a peer hangs (SIGSTOP)     gloo: the op fails after ``timeout_s`` (checked: tests/test_tp_engine.py)
    either, on NCCL            the watchdog tears the rank down after ``timeout_s``
                               (TORCH_NCCL_ASYNC_ERROR_HANDLING=3; not tested here: no GPU)

and surfaces as ``CollectiveError`` (a ``TPFailure``, as is the step channel's
``StepChannelClosed``), which the engine lets through: the node exits and its supervisor
restarts it whole.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # every collective of a step: far above any step's skew between ranks
INIT_TIMEOUT_S = 600.0  # rendezvous, and the first collective after loading (ranks load at their own pace)


class TPFailure(RuntimeError):
    """A rank of the node is gone or stuck: the node cannot go on, its supervisor restarts
    it whole (the engine thread treats it as fatal, not as one step's error)."""


class CollectiveError(TPFailure):
    """A collective of the TP group failed: a rank died (its connections closed) or did not
    arrive within the timeout."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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


class TPGroup:
    """One rank's view of its node's TP group. Collectives act in place where they can and
    raise ``CollectiveError`` on failure; ``timeout_s`` bounds each (an op may pass its own).
    ``expert_parallel``: the node's MoE layers split their experts over these ranks (each
    rank holds E / size whole experts) instead of cutting every expert's columns; attention
    and dense layers are tensor-parallel either way (models/moe.py). ``data_parallel``: this
    rank is a data-parallel rank (TP 1) whose MoE layers it shares with its peers
    (parallel/data_parallel.py), or None."""

    __slots__ = ("rank", "size", "device", "timeout_s", "expert_parallel", "data_parallel", "_pg", "_timeout",
                 "_host_waits")

    def __init__(self, rank: int, size: int, device: torch.device, pg: Any = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False,
                 data_parallel: DataParallel | None = None):
        assert 0 <= rank < size and (pg is not None or size == 1), (rank, size)
        self.rank, self.size, self.device = rank, size, device
        self.expert_parallel = expert_parallel
        self.data_parallel = data_parallel
        self.timeout_s = timeout_s
        self._pg = pg  # ProcessGroupGloo | ProcessGroupNCCL | None (size 1)
        self._timeout = timedelta(seconds=timeout_s)
        # gloo runs an op on the host: wait for it, bounded. NCCL's wait() only orders the
        # current stream after the op (what async scheduling and CUDA graph capture need);
        # a wait with a timeout would block the host until the op completes. Its timeout is
        # the op's option, enforced by the NCCL watchdog.
        self._host_waits = backend_for(device) == "gloo"

    @classmethod
    def single(cls, device: torch.device | str, expert_parallel: bool = False,
               data_parallel: DataParallel | None = None) -> TPGroup:
        """The group of a TP=1 engine: every collective is the identity (expert parallelism
        over one rank is the plain MoE layer; the flag is kept for the model's checks)."""
        return cls(0, 1, torch.device(device), expert_parallel=expert_parallel, data_parallel=data_parallel)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _wait(self, op: str, submit: Callable[[], Any], timeout_s: float | None) -> None:
        """Issue the op (``submit``) and wait for it; a peer's death may fail either."""
        timeout = self._timeout if timeout_s is None else timedelta(seconds=timeout_s)
        try:
            work = submit()
            if self._host_waits:
                work.wait(timeout)
            else:
                work.wait()
        except RuntimeError as e:  # gloo: connection closed or timed out; NCCL: aborted communicator
            raise CollectiveError(
                f"tensor-parallel {op} failed on rank {self.rank} of {self.size} (timeout "
                f"{timeout.total_seconds():g} s): {e}. A rank died or hangs; the node must restart") from e

    def _opts(self, cls_name: str, timeout_s: float | None) -> Any:
        from torch._C import _distributed_c10d as c10d  # the options classes (dist re-exports only some)

        opts = getattr(c10d, cls_name)()
        opts.timeout = self._timeout if timeout_s is None else timedelta(seconds=timeout_s)
        return opts

    def all_reduce(self, t: torch.Tensor, op: str = "sum", timeout_s: float | None = None) -> torch.Tensor:
        """``t`` summed (or min/max) over the ranks, in place; returns ``t``."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        opts = self._opts("AllreduceOptions", timeout_s)
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        self._wait("all_reduce", lambda: self._pg.allreduce([t], opts), timeout_s)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1, timeout_s: float | None = None) -> torch.Tensor:
        """Every rank's ``t`` (equal shapes) concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        opts = self._opts("AllgatherOptions", timeout_s)
        self._wait("all_gather", lambda: self._pg._allgather_base(out, t, opts), timeout_s)
        return torch.cat(out.view(self.size, *t.shape).unbind(0), dim=dim)  # ranks' slices, side by side

    def broadcast(self, t: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> torch.Tensor:
        """``t`` of rank ``src`` on every rank, in place; returns ``t``."""
        if self.size == 1:
            return t
        opts = self._opts("BroadcastOptions", timeout_s)
        opts.rootRank, opts.rootTensor = src, 0
        self._wait("broadcast", lambda: self._pg.broadcast([t], opts), timeout_s)
        return t

    def min_int(self, value: int, timeout_s: float | None = None) -> int:
        """The smallest ``value`` over the ranks (a host int; e.g. the KV blocks all ranks hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, "min", timeout_s).item())

    def close(self) -> None:
        """Drop the process group (idempotent). NCCL's is aborted, which also fails an op in flight."""
        pg, self._pg = self._pg, None
        if pg is not None and backend_for(self.device) == "nccl":
            pg.abort()


class Turn(NamedTuple):
    """What the ranks agreed at the start of one engine-thread turn (the same on every rank)."""
    step: bool  # every rank runs one forward (some rank has work, no step failed, not leaving)
    failed: bool  # some rank's last step raised: every rank fails the requests it holds, none steps
    leave: bool  # every rank is stopping: none calls a collective again


class DataParallel:
    """Rank ``group.rank`` of ``group.size`` data-parallel ranks of one MoE node (parallel/data_parallel.py:
    the lockstep these calls keep, and how a failed step's forward is completed)."""

    def __init__(self, group: TPGroup, store=None):
        self.group = group
        self._store = store  # rank 0's: the rendezvous server lives as long as the rank
        self.counts: tuple[int, ...] = ()  # each rank's tokens in the current forward (begin_forward)
        self._began = False  # this turn's forward began (begin_forward since the last agree)
        self._open = False  # ... and has not ended (end_forward)
        self._issued = 0  # collectives the current forward issued so far, begin_forward's the first
        self._skip = 0  # completing a failed forward: its first _skip collectives were issued already

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def agree(self, busy: bool, failed: bool = False, leaving: bool = False) -> Turn:
        """This turn, for every rank: whether any rank is ``busy``, whether any rank's last step
        ``failed``, and whether every rank is ``leaving`` (every rank calls it every turn)."""
        flags = torch.tensor([int(busy), int(failed), int(not leaving)], dtype=torch.int64, device=self.group.device)
        anyone_busy, anyone_failed, anyone_stays = (bool(f) for f in self.group.all_reduce(flags, "max").tolist())
        self._began = self._open = False
        return Turn(anyone_busy and not anyone_failed and anyone_stays, anyone_failed, not anyone_stays)

    def begin_forward(self, num_tokens: int) -> None:
        """Learn every rank's token count of this forward (each rank calls it once per forward)."""
        self._began = self._open = True
        self._issued = 1
        if self._skip:  # completing a failed forward: issued before it failed, the counts are known
            return
        t = torch.tensor([num_tokens], dtype=torch.int64, device=self.group.device)
        self.counts = tuple(int(c) for c in self.group.all_gather(t, dim=0).tolist())

    def end_forward(self) -> None:
        self._open = False
        self._skip = 0

    @property
    def padded(self) -> int:
        """Rows per rank in the MoE layers' gathered batch: the most tokens any rank has (>= 1)."""
        return max(1, *self.counts)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """A MoE layer's dispatch: every rank's ``t`` [P, H], [N * P, H] in rank order."""
        self._issued += 1
        if self._issued <= self._skip:
            return t.new_zeros((self.size * t.shape[0], *t.shape[1:]))
        return self.group.all_gather(t, dim=0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """A MoE layer's combine: ``t`` [N * P, H] summed over the ranks, in place."""
        self._issued += 1
        if self._issued <= self._skip:
            return t
        return self.group.all_reduce(t)

    def complete_forward(self, idle_forward: Callable[[], None]) -> None:
        """This rank's step raised: issue what is left of this turn's forward with ``idle_forward``
        (a forward of no tokens), so the peers' forward completes. Nothing when the forward had
        ended before the error; the whole idle forward when it had not begun."""
        if self._began and not self._open:
            return
        self._skip = self._issued if self._began else 0
        _log.warning("data-parallel rank %d: completing the failed step's forward (%d of its collectives issued)",
                     self.rank, self._skip)
        try:
            idle_forward()
        finally:
            self._skip = 0

    def close(self) -> None:
        self.group.close()


def init_tp_group(rank: int, size: int, device: torch.device, store: Any, *, host: str = "127.0.0.1",
                  timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False) -> TPGroup:
    """Join the TP group as ``rank`` through ``store`` (a torch ``TCPStore``: rank 0's master
    or a client of it). Blocks until every rank joined (bounded by the store's timeout).
    ``host``: the address this rank's gloo listens on (ranks of a node share a host);
    ``expert_parallel``: as ``TPGroup``'s, the same on every rank."""
    if size == 1:
        return TPGroup.single(device, expert_parallel)
    import torch.distributed as dist

    options: Any  # gloo's _Options or NCCL's Options; torch's stubs name neither's fields
    prefixed = dist.PrefixStore("tp", store)
    if backend_for(device) == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)]
        options._threads = 1  # the caller waits on every op: one thread runs it
        options._timeout = timedelta(seconds=timeout_s)
        pg: Any = dist.ProcessGroupGloo(prefixed, rank, size, options)
    else:
        # TORCH_NCCL_ASYNC_ERROR_HANDLING is read here: torch's default (3) tears the rank down
        # when an op fails or times out. Built before any KV pair group, which sets 2 for its own.
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        options.group_name = "tp"
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    group = TPGroup(rank, size, device, pg, timeout_s, expert_parallel)
    # gloo connects in its constructor; NCCL builds its communicator in the first collective
    group.all_reduce(torch.zeros(1, device=device), timeout_s=INIT_TIMEOUT_S)
    return group

"""One rank of a data-parallel MoE node (``data_parallel_size`` N > 1): its own engine,
scheduler and KV pool, its own requests (a node of the pool, placed by the router like any
other), and the MoE layers shared with its N - 1 peers, each rank holding E / N experts
(models/moe.py's data-parallel path). Owns joining the ranks' group (``join_data_parallel``)
and the idle ranks' poll; ``DataParallel`` (engine/parallel/group.py) is the group of the N ranks, the clock that
keeps their forwards in lockstep (``agree``), the token counts of the current forward, and the
ledger of the forward's collectives that lets a rank whose step raised complete its forward
(``complete_forward``). Must not: know the model or schedule (engine_core.py and
engine_thread.py call it).

Lockstep. The MoE layers run collectives over the N ranks, so every rank must run a forward
whenever any rank does, with no tokens if it has nothing to do::

    every engine-thread turn, each rank:  agree(busy, failed, leaving)  all_reduce max [3]  (the clock)
      nobody busy -> no forward; idle ranks poll every IDLE_POLL_S
      anyone busy -> one forward each: its scheduled tokens, or none (an idle forward)
      a rank's last step failed -> no forward; every rank fails the requests it holds
      every rank leaving (stopping) -> each engine thread ends: no collective follows
    each forward:                         begin_forward(T)    all_gather [N]       (each rank's T)
    each MoE layer:                       all_gather [N * P, H], all_reduce [N * P, H]  (P = max T)
                                          end_forward()

A step that raises on one rank (a bug, not a rank's death) must not leave its peers waiting in
a collective it skipped. The ledger counts the collectives the forward issued (begin_forward
the first); ``complete_forward`` then runs an idle forward that skips that many, so the rank
issues exactly the rest, shapes included (P and the counts are the real forward's), and every
rank meets again at the next ``agree``, which carries the failure to all of them::

    rank 0:  agree | begin | L1 gather, reduce | L2 gather, reduce | end | agree(failed: 1)
    rank 1:  agree | begin | L1 gather, reduce | raise -> idle forward skipping 3:
                                               | L2 gather, reduce | end | agree(failed: 1)

A rank that dies or stops answering fails its peers' next collective (``CollectiveError``,
bounded by the group's timeout): every rank of the node exits and its supervisor restarts it;
the ranks meet again at rank 0's rendezvous. So does a rank whose forward cannot be completed.
A rank that stops on purpose (SIGTERM: its node drains) keeps turning, joining its peers'
forwards with no tokens, until every rank is leaving: the node's ranks drain and stop together.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

from ..parallel.group import DEFAULT_TIMEOUT_S, INIT_TIMEOUT_S, DataParallel, init_tp_group

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.003  # an idle rank's turn: the latency a request arriving at an idle node may wait


def join_data_parallel(rank: int, size: int, device: torch.device, address: str,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> DataParallel:
    """Join the data-parallel group of ``size`` ranks as ``rank``: rank 0 hosts the rendezvous
    (a torch ``TCPStore``) at ``address`` (host:port), the others connect to it; blocks until
    every rank joined (bounded by INIT_TIMEOUT_S). The ranks share a host (gloo listens there)."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, rank == 0, timedelta(seconds=INIT_TIMEOUT_S),
                          wait_for_workers=False)
    log.info("data-parallel rank %d of %d: joining at %s", rank, size, address)
    return DataParallel(init_tp_group(rank, size, device, dist.PrefixStore("dp", store), host=host,
                                      timeout_s=timeout_s), store)

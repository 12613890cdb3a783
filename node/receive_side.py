"""A node's receiving side of the KV transport, the same for every role: a decode node receives
its transfers and its pulls through it, a prefill node its pulls.

Owns, for one node (rank 0 of its ranks)::

    ReceiveSide
      table     TransferTable (kvtransfer/state.py), given by the role (a decode node's counts its
                ranks): every transfer or pull into this node's blocks, each with a lease
      store     KVBlockStore over the node's KV cache (/dev/shm when the node put it there)
      receiver  one KVReceiver on it (``backend``), reporting each landed block to the table
                (counted in ``blocks``, when given), taking frames only of live transfers
      lease     a task failing every LEASE_CHECK_S the transfers whose lease ran out
      session   the one pooled HTTP session to peers (peer_connector, the cluster token):
                the puller's, and whatever else the role asks its peers
      puller    node/kv_pull.py ``Puller``: pulls land through this receiver into this table

``start_receiver`` is how every receiver starts, a worker rank's too (decode_node/ranks.py).
Must not know which role it serves or decide a transfer's outcome (its owner does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from prometheus_client import Counter

from ..common.auth import auth_headers
from ..common.config import NodeConfig
from ..common.http import peer_connector
from ..common.model_metrics import BoundLabels
from ..kvtransfer import KVBlockStore, KVLayout, KVReceiver, KVShard, OnBlock, TransferTable, make_receiver
from .kv_pull import Puller
from .runtime import NodeRuntime

LEASE_CHECK_S = 0.5  # how often the transfers (and pulls) whose lease ran out are failed
PEER_CONNECT_S = 5.0  # a peer that does not accept a connection by then is down


async def start_receiver(config: NodeConfig, backend: str, layout: KVLayout, store: KVBlockStore,
                         on_block: OnBlock, accepts: Callable[[str], bool], device: str,
                         shard: KVShard | None = None) -> KVReceiver:
    """A receiver of ``backend`` over ``store``, started: it takes only the frames of transfers
    ``accepts`` names and only from senders presenting the cluster token."""
    receiver = make_receiver(backend, layout, store, config.host, on_block, device=device, shard=shard)
    receiver.accepts = accepts
    receiver.cluster_token = config.cluster_token
    await receiver.start()
    return receiver


class ReceiveSide:
    """See the module. ``kv_addrs``: every rank's receiver address, in rank order, for the
    puller (default: this one); ``settle``: the puller's (node/kv_pull.py)."""

    def __init__(self, config: NodeConfig, rt: NodeRuntime, backend: str, table: TransferTable,
                 blocks: BoundLabels[Counter] | None = None, kv_addrs: Callable[[], list[str]] | None = None,
                 settle: Callable[[str], Awaitable[None]] | None = None):
        self.config = config
        self.rt = rt
        self.backend = backend
        self.table = table
        self._blocks = blocks  # blocks landed, by "true" / "false" (checksum and layout ok)
        self.receiver: KVReceiver | None = None  # from start(receive=True) on
        self.session: aiohttp.ClientSession | None = None  # from start() on
        self._lease_task: asyncio.Task[None] | None = None
        self.puller = Puller(config, rt, table, kv_addrs or (lambda: [self.address]), backend, settle=settle)

    @property
    def address(self) -> str:
        """The receiver's address ("" before it starts, or without one)."""
        return self.receiver.address if self.receiver is not None else ""

    async def start(self, receive: bool = True) -> None:
        """Once the engine is built: the session, the lease task and, with ``receive``, the
        receiver (a node that receives nothing still asks its peers and may own transfers)."""
        # peer_connector: a request written into a partition fails in seconds, not after a lease
        self.session = aiohttp.ClientSession(connector=peer_connector(),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=PEER_CONNECT_S),
                                             headers=auth_headers(self.config.cluster_token))
        self.puller.session = self.session
        if receive:
            store = KVBlockStore(self.rt.kv_caches, self.rt.layout, self.rt.shm_name)
            self.receiver = await start_receiver(self.config, self.backend, self.rt.layout, store, self._on_block,
                                                 self.table.is_live, self.config.engine.device, self.rt.shard)
        self._lease_task = asyncio.create_task(self._expire_leases())

    def _on_block(self, transfer_id: str, dest_block_id: int, ok: bool, reason: str | None) -> None:
        if self._blocks is not None:
            self._blocks.labels(str(ok).lower()).inc()
        self.table.on_block(transfer_id, dest_block_id, ok, reason)  # renews the lease

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(LEASE_CHECK_S)
            self.table.expire_leases()

    async def stop(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
        if self.receiver is not None:
            await self.receiver.stop()
        if self.session is not None:
            await self.session.close()

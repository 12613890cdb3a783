"""Static-shape decode: persistent input buffers, batch-size buckets, and (on CUDA)
one captured CUDA graph per bucket.

A decode-only step of D requests runs as the smallest bucket B >= D. Rows D..B-1 are
padding that never touches a request's KV:

    row          input id  position  slot                 block table      seq_len
    0 .. D-1     token     pos       table[pos//bs]*bs+.. request's blocks  pos + 1
    D .. B-1     0         0         scratch_block * bs   scratch_block...   1

The scratch block is one extra block at the end of the cache tensor that the block
pool never hands out, so padding rows write and read only there.

    host (pinned on CUDA)              device (persistent, what the graph reads)
    ids/positions/slots/seq_lens [N] --copy, non_blocking--> same [N]
    block_tables [N, W]              --copy, non_blocking--> same [N, W]
    from_last [N]                    --copy, non_blocking--> where >= 0, ids take the previous
                                                             step's sampled id at that row
                                                             (async scheduling), on the device

N = the largest bucket, W = blocks of the longest allowed sequence. On CUDA every
bucket is captured once at start-up (warm-up on a side stream, all graphs in one
memory pool, largest first) and replayed; its logits live in a static output tensor.
A step writes only the table columns up to its widest row; a graph reads all W
columns, but its kernels read only the first ceil(seq_len / bs) of each row, and stale
columns hold valid block ids anyway. On CPU nothing is captured: the same padded
buffers feed an eager forward with the tables cut to the step's widest row (the torch
reference gathers every column it is given).

Must not: schedule, sample, or run steps that contain a prefill chunk (the caller runs
those eagerly at their exact shape).
"""

import logging

import torch

from .attention.base import AttentionBackend, AttentionMetadata
from .attention.torch_backend import build_decode_mask

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)  # then multiples of BUCKET_STEP, as vLLM
BUCKET_STEP = 8
WARMUP_RUNS = 2  # eager runs before a capture: kernel autotuning and lazy init happen outside the graph


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, ... up to ``max_num_seqs``, which is always a bucket."""
    sizes = {s for s in SMALL_BUCKETS if s <= max_num_seqs}
    sizes.update(range(BUCKET_STEP, max_num_seqs + 1, BUCKET_STEP))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


class StaticDecode:
    """Runs decode-only steps through fixed-shape forwards, one shape per bucket."""

    def __init__(self, model: torch.nn.Module, kv_caches: torch.Tensor, backend: AttentionBackend,
                 sizes: tuple[int, ...], max_blocks_per_seq: int, scratch_block: int, use_graphs: bool):
        """``kv_caches``: [layers, 2, num_blocks + 1, block_size, kv_heads, hd], the last
        block being ``scratch_block``. ``use_graphs`` needs a CUDA device and a backend that
        reads seq_lens (no decode mask)."""
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = tuple(sorted(sizes))
        self.device = kv_caches.device
        self.block_size = kv_caches.shape[3]
        self.scratch_block = scratch_block
        self.use_graphs = use_graphs
        self.full_width = use_graphs  # forwards read all W table columns (what a graph captures)
        assert not use_graphs or (self.device.type == "cuda" and not backend.needs_decode_mask)
        n, w = self.sizes[-1], max_blocks_per_seq
        pin = self.device.type == "cuda"

        def host(*shape):
            return torch.zeros(shape, dtype=torch.long, pin_memory=pin)

        # host staging; on CPU also what the forward reads
        self.h_ids, self.h_pos, self.h_slots, self.h_lens = host(n), host(n), host(n), host(n)  # [N] each
        self.h_tables = host(n, w)  # [N, W]
        self.h_from_last = host(n)  # [N]: row of the previous step's tokens, or -1
        if pin:
            def dev(t):
                return torch.zeros(t.shape, dtype=t.dtype, device=self.device)

            self.ids, self.pos, self.slots, self.lens = (dev(self.h_ids), dev(self.h_pos), dev(self.h_slots),
                                                         dev(self.h_lens))
            self.tables = dev(self.h_tables)
            self.from_last = dev(self.h_from_last)
            # recorded after the copies: the host waits on it before reusing the staging buffers
            # (a step that samples nothing never synchronizes otherwise)
            self.copied = torch.cuda.Event()
        else:
            self.ids, self.pos, self.slots, self.lens, self.tables, self.from_last = (
                self.h_ids, self.h_pos, self.h_slots, self.h_lens, self.h_tables, self.h_from_last)
        self.logits_rows = torch.arange(n, device=self.device)  # [N]: every row's logits
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, logits [B, V])
        if use_graphs:
            self._capture()

    def bucket(self, num_rows: int) -> int | None:
        """The smallest bucket holding ``num_rows``, or None (the caller runs eagerly)."""
        for size in self.sizes:
            if size >= num_rows:
                return size
        return None

    def run(self, ids: list[int], positions: list[int], tables: list[list[int]],
            from_last: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """One decode token per row: ``ids``, ``positions`` [D], ``tables`` (each row's
        block ids). ``from_last`` = (rows [D], tokens [S] on the device): row i's id is
        ``tokens[rows[i]]`` where ``rows[i] >= 0`` (its ``ids`` entry is then ignored).
        Returns logits [D, vocab] float32 (a view of a static buffer on CUDA: read it
        before the next call)."""
        d = len(ids)
        b = self.bucket(d)
        assert b is not None, f"{d} decode rows exceed the largest bucket {self.sizes[-1]}"
        bs, scratch = self.block_size, self.scratch_block
        width = max(len(t) for t in tables)  # columns written this step
        pad = b - d
        if self.h_ids is not self.ids:
            self.copied.synchronize()  # the previous step's copies have left the staging buffers
        rows = [t + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width] * pad
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        self.h_ids[:b] = torch.tensor(ids + [0] * pad)
        self.h_pos[:b] = torch.tensor(positions + [0] * pad)
        self.h_slots[:b] = torch.tensor(slots + [scratch * bs] * pad)
        self.h_lens[:b] = torch.tensor([p + 1 for p in positions] + [1] * pad)
        self.h_tables[:b, :width] = torch.tensor(rows)
        if from_last is not None:
            self.h_from_last[:b] = torch.tensor(from_last[0] + [-1] * pad)
        if self.h_ids is not self.ids:  # async: the graph waits on the stream, not the host
            staged = [(self.h_ids, self.ids), (self.h_pos, self.pos), (self.h_slots, self.slots),
                      (self.h_lens, self.lens)] + ([(self.h_from_last, self.from_last)] if from_last else [])
            for src, dst in staged:
                dst[:b].copy_(src[:b], non_blocking=True)
            self.tables[:b, :width].copy_(self.h_tables[:b, :width], non_blocking=True)
            self.copied.record()
        if from_last is not None:  # the previous step's tokens, without a trip through the host
            rows_from = self.from_last[:b]
            self.ids[:b] = torch.where(rows_from >= 0, from_last[1][rows_from.clamp(min=0)], self.ids[:b])
        if b in self.graphs:
            graph, logits = self.graphs[b]
            graph.replay()
            return logits[:d]
        return self._forward(b, self.h_tables.shape[1] if self.full_width else width)[:d]

    def _forward(self, b: int, width: int) -> torch.Tensor:
        """The fixed-shape forward of bucket ``b``: what a graph captures. Returns [b, vocab]."""
        mask = None
        if self.backend.needs_decode_mask:  # built on the host from the staged seq_lens
            mask = build_decode_mask(self.h_lens[:b], width * self.block_size, self.kv_caches.dtype, self.device)
        meta = AttentionMetadata(slot_mapping=self.slots[:b], num_decodes=b,
                                 decode_block_tables=self.tables[:b, :width], decode_seq_lens=self.lens[:b],
                                 decode_mask=mask, prefills=[])
        return self.model(self.ids[:b], self.pos[:b], self.kv_caches, meta, self.backend, self.logits_rows[:b])

    def _capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its pool memory.
        The buffers hold padding rows while capturing, so warm-up writes only the scratch block."""
        n, w = self.h_tables.shape
        for t, v in ((self.ids, 0), (self.pos, 0), (self.slots, self.scratch_block * self.block_size),
                     (self.lens, 1), (self.tables, self.scratch_block)):
            t.fill_(v)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._forward(b, w)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b, w)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", list(self.sizes))

"""ForwardInputs: one step's forward pass as plain host values, the message rank 0 sends
every worker rank of a tensor-parallel node (parallel/step_channel.py) and what every rank's
``ModelRunner.execute`` turns into device tensors and attention metadata.

Owns the message and the index arithmetic every rank derives from it (so it is not
sent): cache slots from block tables, each chunk's key slots, decode sequence lengths.
Must not: schedule, sample, or know which rank it runs on.

A step's rows, decodes first (attention/base.py)::

    rows   [ d0 .. d(D-1) | chunk 0: q_len rows | chunk 1 ... ]
    slot of row at position p of a request with blocks `table`:  table[p // bs] * bs + p % bs
    decode row i:  positions[i], decode_tables[i]; its id is input_ids[i], or with async
                   scheduling, where from_last[i] >= 0, row from_last[i] of the previous
                   launch's sampled ids (on the device: rank 0's own, broadcast to the workers)
    chunk c:       rows [q_start, q_start + q_len), positions [ctx_len, ctx_len + q_len),
                   keys: its ctx_len cached tokens then its new ones (block_table covers them)

``static``: a decode-only step through StaticDecode (decode_graphs.py; the same bucket on
every rank); its logits are every row's. Otherwise the forward runs eagerly and computes
the logits of ``logits_rows``.
"""

from __future__ import annotations

import msgspec
import torch


class PrefillChunk(msgspec.Struct, array_like=True):
    q_start: int  # first row in the flat batch
    q_len: int  # new tokens
    ctx_len: int  # tokens already in the cache before them
    block_table: list[int]  # the request's blocks covering its first ctx_len + q_len tokens

    def key_slots(self, block_size: int) -> torch.Tensor:
        """[ctx_len + q_len] long: the cache slot of each of its tokens (context, then new)."""
        table = torch.tensor(self.block_table, dtype=torch.long)
        pos = torch.arange(self.ctx_len + self.q_len)
        return table[pos // block_size] * block_size + pos % block_size


class ForwardInputs(msgspec.Struct, tag="step", array_like=True):
    static: bool  # decode-only through StaticDecode (logits of every row), else eager
    input_ids: list[int]  # [T]; 0 where the id is the previous launch's (from_last)
    positions: list[int]  # [T]
    decode_tables: list[list[int]]  # [D] block ids of each decode row's request (rows [0, D))
    chunks: list[PrefillChunk]  # eager only, in row order after the decode rows
    logits_rows: list[int]  # eager only: rows whose logits are computed, in this order
    from_last: list[int]  # [D] or []: row of the previous launch's sampled ids, or -1
    num_sampled: int  # ids rank 0 samples from this step (what a worker receives under async TP)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_tables)

    def decode_slots(self, block_size: int) -> list[int]:
        """[D] the cache slot each decode row writes."""
        return [t[p // block_size] * block_size + p % block_size
                for t, p in zip(self.decode_tables, self.positions)]

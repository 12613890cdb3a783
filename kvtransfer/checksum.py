"""Block checksums: xxh3_64 over host bytes, and wsum32_v1 computed on the pool's device.

Owns: both algorithms (their names live in ``wire.py``, since a Hello names one) and
``packed_sums``, which computes either over a batch of packed blocks. Must not: know
about transfers, sockets or the model.

wsum32_v1, for a packed block (``layout.py`` draws it) of ``2 * num_layers`` runs::

    run r, viewed as W signed words w_0 .. w_(W-1)   (int32; int16 or uint8 when a run's
                                                      byte count is not a multiple of 4 or 2)
    s_r  = sum_i  w_i * (1 + i mod 1021)                exact int64, on the device
    checksum = xxh3_64(s_0 .. s_(2L-1) as little-endian int64)      on the host

Integer sums are exact and order-independent, so a CUDA reduction and a CPU one agree
bit for bit. No int64 overflow: |w| < 2^31, weight <= 1021 < 2^10 and W < 2^22 (a run
under 16 MiB, asserted), so every partial sum stays under 2^63. Any change of one word
changes its run's sum; the host hash then mixes the run sums. Only the run sums leave
the device: one copy of ``n * 2L`` int64 per batch. On a CPU xxh3 is ~30x faster, so
host senders keep it; both ends of a connection use the one algorithm its Hello names.
"""

from __future__ import annotations

import torch
import xxhash

from .layout import KVLayout
from .wire import CHECKSUM_WSUM, CHECKSUM_XXH3

WEIGHT_PERIOD = 1021  # a prime: word i is weighted 1 + i mod 1021
MAX_RUN_WORDS = 1 << 22  # keeps every run sum exact in int64 (see the docstring)
CHUNK_BYTES = 64 << 20  # blocks are summed this many bytes at a time (bounds the int64 temporaries)


def checksum(data) -> int:
    """xxh3_64 of a bytes-like object (any C-contiguous buffer), as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(data)


def word_dtype(layout: KVLayout) -> torch.dtype:
    """The word wsum32_v1 reads a run as: the widest of int32, int16, uint8 that divides it."""
    run = layout.run_nbytes
    return torch.int32 if run % 4 == 0 else torch.int16 if run % 2 == 0 else torch.uint8


def _weights(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=device) % WEIGHT_PERIOD + 1  # [n]


def run_sums(blocks: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """wsum32_v1 run sums of packed blocks ``[n, *layout.block_shape]`` (any device) ->
    ``[n, 2 * num_layers]`` int64 on that device."""
    n = blocks.shape[0]
    assert blocks.is_contiguous() and blocks.shape[1:] == layout.block_shape, \
        f"expected contiguous [n, {layout.block_shape}], got {tuple(blocks.shape)}"
    # flat first: a row's last dimension alone may not be a whole number of words
    return _byte_run_sums(blocks.view(n, -1).view(torch.uint8), layout)


def _byte_run_sums(data: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``run_sums`` of packed blocks given as bytes ``[n, block_nbytes]`` uint8."""
    n = data.shape[0]
    words = data.view(word_dtype(layout)).view(n, 2 * layout.num_layers, -1)
    assert words.shape[2] < MAX_RUN_WORDS, f"a run of {layout.run_nbytes} bytes is too large for wsum32_v1"
    w = _weights(words.shape[2], data.device)
    per = max(1, CHUNK_BYTES // (8 * w.numel() * 2 * layout.num_layers))  # blocks per chunk
    out = [(words[i:i + per].to(torch.int64) * w).sum(-1) for i in range(0, n, per)]
    return torch.cat(out) if len(out) > 1 else out[0]


def finish(sums: torch.Tensor) -> list[int]:
    """Host side of wsum32_v1: one device-to-host copy, one xxh3 per block."""
    host = sums.to("cpu", torch.int64).contiguous().numpy()  # [n, 2L]
    return [xxhash.xxh3_64_intdigest(row.tobytes()) for row in host]


def wsum(blocks: torch.Tensor, layout: KVLayout) -> list[int]:
    """wsum32_v1 of each packed block in ``[n, *layout.block_shape]``."""
    return finish(run_sums(blocks, layout)) if blocks.shape[0] else []


def packed_sums(blocks: torch.Tensor, layout: KVLayout, algo: str,
                host: memoryview | None = None) -> list[int]:
    """``algo`` of each packed block of ``blocks`` ``[n, *block_shape]``. xxh3_64 reads the
    host bytes: ``host`` (the same blocks, back to back) or ``blocks`` itself on the CPU."""
    if algo == CHECKSUM_WSUM:
        return wsum(blocks, layout)
    assert algo == CHECKSUM_XXH3, f"unknown checksum algorithm {algo!r}"
    if host is None:
        assert blocks.device.type == "cpu", "xxh3_64 of device blocks needs their host bytes"
        host = blocks.reshape(-1).view(torch.uint8).numpy().data
    size = layout.block_nbytes
    return [checksum(host[i * size:(i + 1) * size]) for i in range(len(host) // size)]


def bytes_sum(data, layout: KVLayout, algo: str) -> int:
    """``algo`` of one packed block given as host bytes (any buffer of ``block_nbytes``)."""
    if algo == CHECKSUM_XXH3:
        return checksum(data)
    view = memoryview(data).cast("B")
    block = torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)
    assert block.numel() == layout.block_nbytes, f"expected {layout.block_nbytes} bytes, got {block.numel()}"
    return finish(_byte_run_sums(block.view(1, -1), layout))[0]

"""Host values to a device tensor without making the host wait for the device.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, and
PyTorch synchronizes the stream after such a copy: the host would wait for every
kernel queued before it, which undoes async scheduling and the queued forward. On
CUDA the values go through pinned memory with a non-blocking copy instead (the
caching host allocator keeps that staging memory alive until the copy is done); on
the CPU this is ``torch.tensor``.
"""

import torch


def upload(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values``: a (nested) list of numbers, or a CPU tensor."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device, dtype) if dtype is not None else host.to(device)
    if dtype is not None:
        host = host.to(dtype)
    return host.pin_memory().to(device, non_blocking=True)

"""Where ``splitserve up`` puts each node: its torch device, its share of a GPU's memory,
and the KV backend that follows from the placement.

Owns: ``DevicePlan`` and ``plan_devices``. Must not: start processes (``launcher.py``
does) or import torch (the launcher runs without a GPU stack).

::

    --device cuda                     prefill-0, decode-0 on cuda:0, each --gpu-memory-utilization F/2
    --prefill-devices cuda:0 cuda:1   prefill-i on the i-th device of its list (cycling)
    --decode-devices cuda:2           decode-j likewise; F is split among the nodes of each GPU
    KV backend (unless given)         ipc when every node runs on CUDA (one host), tcp when some
                                      do, the config's (shm) when none do: CPU `up` is unchanged
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

ROLES = ("prefill", "decode")  # a colocated node takes the decode devices


class DevicePlan(NamedTuple):
    devices: dict[str, tuple[str, ...]]  # role -> devices its nodes cycle through; {} on CPU
    kv_backend: str
    dtype: str | None  # None: the nodes' default (auto)
    gpu_memory_utilization: float | None  # per GPU, split among the nodes placed on it

    def node_args(self, role: str, index: int, counts: dict[str, int]) -> list[str]:
        """The device flags of node ``index`` of ``role``; ``counts``: nodes per role.
        Empty on a CPU-only plan (the nodes' own defaults)."""
        devs = self.devices.get("decode" if role == "colocated" else role)
        args = ["--dtype", self.dtype] if self.dtype else []
        if not devs:
            return args
        device = devs[index % len(devs)]
        args += ["--device", device]
        if self.gpu_memory_utilization is not None and is_cuda(device):
            sharing = self.placement(counts)[canonical(device)]
            args += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization / sharing:.4f}"]
        return args

    def placement(self, counts: dict[str, int]) -> Counter[str]:
        """canonical device -> how many nodes run on it."""
        on: Counter[str] = Counter()
        for role, n in counts.items():
            devs = self.devices.get("decode" if role == "colocated" else role)
            if not devs:
                continue
            for i in range(n):
                on[canonical(devs[i % len(devs)])] += 1
        return on


def is_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def canonical(device: str) -> str:
    """'cuda' and 'cuda:0' name one GPU."""
    return "cuda:0" if device == "cuda" else device


def _check(device: str, flag: str) -> None:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ValueError(f"{flag}: {device!r} is not a device; use cpu, cuda or cuda:N")


def plan_devices(device: str | None, prefill_devices: list[str] | None, decode_devices: list[str] | None,
                 kv_backend: str | None, config_backend: str, dtype: str | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_given: bool = False,
                 default_utilization: float = 0.9) -> DevicePlan:
    """Resolve ``up``'s device flags. ``kv_backend`` and ``gpu_memory_utilization``: the flags
    (None: not given); ``config_backend`` and ``default_utilization``: the TOML defaults. On CUDA
    each GPU's utilization is split among its nodes, unless ``--kv-cache-memory`` was given."""
    base = device or "cpu"
    dtype = None if dtype == "auto" else dtype  # the nodes' own default
    _check(base, "--device")
    per_role = {"prefill": prefill_devices, "decode": decode_devices}
    devices: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        listed = per_role[role] or [base]
        for d in listed:
            _check(d, f"--{role}-devices")
        devices[role] = tuple(listed)
    used = [d for devs in devices.values() for d in devs]
    if kv_backend == "ipc" and not all(is_cuda(d) for d in devices["decode"]):
        raise ValueError("--kv-backend: ipc needs every decode node on CUDA (--decode-devices cuda:N)")
    if not any(is_cuda(d) for d in used):
        if gpu_memory_utilization is not None:
            raise ValueError("--gpu-memory-utilization: sizes GPU KV pools; the nodes run on the CPU "
                             "(give --device cuda, or --kv-cache-memory)")
        return DevicePlan({}, kv_backend or config_backend, dtype, None)
    backend = kv_backend or ("ipc" if all(is_cuda(d) for d in used) else "tcp")
    if backend == "shm":
        raise ValueError("--kv-backend: shm keeps KV pools in host memory; with CUDA nodes use ipc or tcp")
    if kv_cache_memory_given and gpu_memory_utilization is not None:
        raise ValueError("give one of --kv-cache-memory and --gpu-memory-utilization")
    util = None if kv_cache_memory_given else gpu_memory_utilization or default_utilization
    if util is not None and not 0 < util <= 1:
        raise ValueError(f"--gpu-memory-utilization: must be in (0, 1], got {util}")
    return DevicePlan(devices, backend, dtype, util)

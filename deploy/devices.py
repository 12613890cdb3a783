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
                                      (common/kv_backends.py: the defaults, and what each needs)

Tensor-parallel nodes (``--prefill-tp`` / ``--decode-tp`` N): an entry of a device list is
one node's devices, one per rank, rank 0's first (``cuda:0,cuda:1,cuda:2,cuda:3``); a
single device ``cuda:k`` there means ``cuda:k .. cuda:k+N-1`` (the node's own rule). A GPU
counts every rank placed on it when F is split, and a node gets the smallest share among
its GPUs (each rank sizes its own KV cache from it; all hold the same block count). On the
CPU the ranks of a node share its cores (the engine pins each rank to its share)::

    --decode-tp 8 --decode-devices cuda:0,cuda:1,cuda:2,cuda:3,cuda:4,cuda:5,cuda:6,cuda:7
    --prefill-tp 4 --prefill-devices cuda:0 cuda:4      two prefill nodes: cuda:0-3, cuda:4-7
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from ..common.kv_backends import CUDA_HOST_BACKEND, DEFAULT_BACKEND, alternatives, backend_spec

ROLES = ("prefill", "decode")  # a colocated node takes the decode devices


class DevicePlan(NamedTuple):
    devices: dict[str, tuple[str, ...]]  # role -> what its nodes cycle through (one node's: "cuda:0,cuda:1"); {} on CPU
    kv_backend: str
    dtype: str | None  # None: the nodes' default (auto)
    gpu_memory_utilization: float | None  # per GPU, split among the ranks placed on it
    tp: dict[str, int] = {}  # role -> ranks per node (absent: 1)

    def node_args(self, role: str, index: int, counts: dict[str, int]) -> list[str]:
        """The device flags of node ``index`` of ``role``; ``counts``: nodes per role.
        Empty on a CPU-only plan (the nodes' own defaults)."""
        devs = self.devices.get(_devices_role(role))
        args = ["--dtype", self.dtype] if self.dtype else []
        if not devs:
            return args
        device = devs[index % len(devs)]
        args += ["--device", device]
        ranks = rank_devices(device, self.tp.get(_devices_role(role), 1))
        if self.gpu_memory_utilization is not None and all(is_cuda(d) for d in ranks):
            on = self.placement(counts)
            sharing = max(on[canonical(d)] for d in ranks)
            args += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization / sharing:.4f}"]
        return args

    def placement(self, counts: dict[str, int]) -> Counter[str]:
        """canonical device -> how many ranks (of all nodes) run on it."""
        on: Counter[str] = Counter()
        for role, n in counts.items():
            devs = self.devices.get(_devices_role(role))
            if not devs:
                continue
            for i in range(n):
                for d in rank_devices(devs[i % len(devs)], self.tp.get(_devices_role(role), 1)):
                    on[canonical(d)] += 1
        return on


def _devices_role(role: str) -> str:
    return "decode" if role == "colocated" else role  # a colocated node takes the decode devices and TP


def is_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def canonical(device: str) -> str:
    """'cuda' and 'cuda:0' name one GPU."""
    return "cuda:0" if device == "cuda" else device


def rank_devices(entry: str, tp: int) -> tuple[str, ...]:
    """The device of each rank of a node given ``entry`` (a device list entry): its
    comma-separated devices, or for one ``cuda:k`` and ``tp`` > 1, cuda:k .. cuda:k+tp-1
    (every rank of a CPU node on the CPU)."""
    devices = tuple(entry.split(","))
    if len(devices) > 1 or tp == 1:
        return devices
    if not is_cuda(devices[0]):
        return devices * tp
    first = int(canonical(devices[0]).partition(":")[2])
    return tuple(f"cuda:{first + r}" for r in range(tp))


def _check(device: str, flag: str) -> None:
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise ValueError(f"{flag}: {device!r} is not a device; use cpu, cuda or cuda:N")


def _check_entry(entry: str, tp: int, flag: str) -> None:
    """One node's devices: each a device, one per rank (or one to start from)."""
    parts = entry.split(",")
    for d in parts:
        _check(d, flag)
    if len(parts) not in (1, tp):
        raise ValueError(f"{flag}: {entry!r} names {len(parts)} devices for a node of {tp} ranks; "
                         f"give one per rank, comma-separated, or the first one alone")
    ranks = rank_devices(entry, tp)
    if any(is_cuda(d) for d in ranks) and not all(is_cuda(d) for d in ranks):
        raise ValueError(f"{flag}: {entry!r} mixes the CPU and GPUs in one node")
    if all(is_cuda(d) for d in ranks) and len({canonical(d) for d in ranks}) < len(ranks):
        raise ValueError(f"{flag}: {entry!r} puts two ranks of one node on one GPU")


def plan_devices(device: str | None, prefill_devices: list[str] | None, decode_devices: list[str] | None,
                 kv_backend: str | None, config_backend: str, dtype: str | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_given: bool = False,
                 default_utilization: float = 0.9, tp: dict[str, int] | None = None) -> DevicePlan:
    """Resolve ``up``'s device flags. ``kv_backend`` and ``gpu_memory_utilization``: the flags
    (None: not given); ``config_backend`` and ``default_utilization``: the TOML defaults; ``tp``:
    role -> ranks per node (``--prefill-tp``, ``--decode-tp``). On CUDA each GPU's utilization
    is split among the ranks on it, unless ``--kv-cache-memory`` was given."""
    base = device or "cpu"
    dtype = None if dtype == "auto" else dtype  # the nodes' own default
    tp = {role: n for role, n in (tp or {}).items() if n != 1}
    for role, n in tp.items():
        if n < 1:
            raise ValueError(f"--{role}-tp: must be >= 1, got {n}")
    _check(base, "--device")
    per_role = {"prefill": prefill_devices, "decode": decode_devices}
    devices: dict[str, tuple[str, ...]] = {}
    for role in ROLES:
        listed = per_role[role] or [base]
        for d in listed:
            _check_entry(d, tp.get(role, 1), f"--{role}-devices" if per_role[role] else "--device")
        devices[role] = tuple(listed)
    used = [d for role, devs in devices.items() for entry in devs for d in rank_devices(entry, tp.get(role, 1))]
    spec = backend_spec(kv_backend, "--kv-backend") if kv_backend else None
    if spec and spec.needs_cuda and not all(is_cuda(d) for entry in devices["decode"] for d in entry.split(",")):
        raise ValueError(f"--kv-backend: {spec.name} needs every decode node on CUDA (--decode-devices cuda:N)")
    if not any(is_cuda(d) for d in used):
        if gpu_memory_utilization is not None:
            raise ValueError("--gpu-memory-utilization: sizes GPU KV pools; the nodes run on the CPU "
                             "(give --device cuda, or --kv-cache-memory)")
        return DevicePlan({}, kv_backend or config_backend, dtype, None, tp)
    backend = kv_backend or (CUDA_HOST_BACKEND if all(is_cuda(d) for d in used) else DEFAULT_BACKEND)
    if backend_spec(backend, "--kv-backend").shm_cache:
        raise ValueError(f"--kv-backend: {backend} keeps KV pools in host memory; with CUDA nodes use "
                         f"{alternatives(cuda=True)}")
    if kv_cache_memory_given and gpu_memory_utilization is not None:
        raise ValueError("give one of --kv-cache-memory and --gpu-memory-utilization")
    util = None if kv_cache_memory_given else gpu_memory_utilization or default_utilization
    if util is not None and not 0 < util <= 1:
        raise ValueError(f"--gpu-memory-utilization: must be in (0, 1], got {util}")
    return DevicePlan(devices, backend, dtype, util, tp)

"""The backend registry: the KV backends by name (``--kv-backend``), the one place that
says which backends exist, where each one's sender and receiver classes live and what
each needs.

A backend is one ``KVBackendSpec``; the built-in ones are ``BUILTIN`` (kvtransfer/backends/).
A backend from outside the package is a module named in the environment variable
``SPLITSERVE_KV_BACKENDS`` (comma-separated module names or ``.py`` paths, as
``$SPLITSERVE_MODEL_FAMILIES``) that defines ``BACKEND``, a ``KVBackendSpec``. A process
loads them on its first lookup; processes inherit the variable, so setting it where
``splitserve up`` starts covers the cluster. Routers never look a backend up.

Who reads which ability::

    needs_cuda       NodeConfig (refuses a decode node on the CPU), deploy/devices.py,
                     kvtransfer/factory.py (the sender gets a CUDA device)
    shm_cache        NodeConfig (refuses a decode node on a GPU), deploy/devices.py, the
                     decode node and its ranks (their KV cache allocated in /dev/shm)
    release_grace_s  the decode node and node/kv_pull.py: a failed transfer's blocks wait
    serves_pulls     the prefill node: its pull receiver speaks this backend, or DEFAULT_BACKEND
    same_host        the hints of those errors (the backends check the host themselves)

Owns the specs and their lookup. Must not import kvtransfer or torch (configs, the
launcher and the CLI read it): a spec names its classes ``"module:Class"``, and
kvtransfer/factory.py imports them when it builds one (ucxx is heavy and optional).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache

from .plugins import load_specs, merge

BACKENDS_ENV = "SPLITSERVE_KV_BACKENDS"
DEFAULT_BACKEND = "tcp"  # --kv-backend's default: any two hosts, any devices
CUDA_HOST_BACKEND = "ipc"  # `splitserve up`'s default when every node runs on CUDA (one host)
RELEASE_GRACE_S = 0.5  # shm, ipc: a sender still mid-frame stops before the blocks are reused
_NAME = re.compile(r"^[a-z][a-z0-9-]*$")  # a URL scheme: receivers' addresses are <name>://host:port


@dataclass(frozen=True, slots=True)
class KVBackendSpec:
    """One KV backend. Its classes, ``"module:Class"`` (imported when first built) or the
    class itself, are called as::

        sender(layout, options, shard=shard, device=device)                   -> a KVSender
        receiver(layout, store, on_block, host=host, port=port,
                 advertise_host=advertise_host, shard=shard, device=device)   -> a KVReceiver

    ``device``: the node's compute device (a backend moving host bytes ignores it)."""

    name: str  # the --kv-backend value; by convention its receivers' address scheme
    sender: str | type
    receiver: str | type
    same_host: bool = False  # sender and receiver must share a host
    needs_cuda: bool = False  # moves blocks between CUDA KV caches: the decode node runs on CUDA
    shm_cache: bool = False  # the decode node's KV cache lives in /dev/shm (host memory) for senders to map
    # The sender writes into the receiver's cache before the receiver acknowledges: a failed or
    # aborted transfer's blocks wait this long before they are reused (0: the receiver writes them).
    release_grace_s: float = 0.0
    # A prefill node receives pulled prefixes over it (False: its receiver needs a cache mapped
    # for its senders, which a prefill node's is not: it pulls over DEFAULT_BACKEND).
    serves_pulls: bool = True

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"KVBackendSpec: name {self.name!r} must be lowercase letters, digits and '-' "
                             "(it is the receivers' address scheme)")
        if self.release_grace_s < 0 or (self.needs_cuda and self.shm_cache):
            raise ValueError(f"KVBackendSpec {self.name}: release_grace_s must be >= 0 and a backend cannot "
                             "need both CUDA and a host-memory cache")


_BACKENDS = "splitserve.kvtransfer.backends"
BUILTIN = (
    KVBackendSpec("tcp", f"{_BACKENDS}.tcp:TcpSender", f"{_BACKENDS}.tcp:TcpReceiver"),
    KVBackendSpec("shm", f"{_BACKENDS}.shm:ShmSender", f"{_BACKENDS}.shm:ShmReceiver", same_host=True,
                  shm_cache=True, release_grace_s=RELEASE_GRACE_S, serves_pulls=False),
    KVBackendSpec("ucx", f"{_BACKENDS}.ucx:UcxSender", f"{_BACKENDS}.ucx:UcxReceiver"),
    # NCCL between CUDA devices, gloo on the CPU
    KVBackendSpec("nccl", f"{_BACKENDS}.nccl:NcclSender", f"{_BACKENDS}.nccl:NcclReceiver"),
    KVBackendSpec("ipc", f"{_BACKENDS}.ipc:IpcSender", f"{_BACKENDS}.ipc:IpcReceiver", same_host=True,
                  needs_cuda=True, release_grace_s=RELEASE_GRACE_S, serves_pulls=False),
)


def backend_spec(name: str, setting: str = "kv_backend") -> KVBackendSpec:
    """The backend called ``name``; raises ValueError naming ``setting`` and the choices."""
    specs = _specs(os.environ.get(BACKENDS_ENV, ""))
    if name not in specs:
        raise ValueError(f"{setting}: must be one of {', '.join(specs)}, got {name!r} (a backend of your "
                         f"own: ${BACKENDS_ENV}, see README.md)")
    return specs[name]


def backend_names() -> tuple[str, ...]:
    """Every backend's name, the built-ins first."""
    return tuple(_specs(os.environ.get(BACKENDS_ENV, "")))


def alternatives(cuda: bool) -> str:
    """The backends a node on CUDA (``cuda``) or on the CPU can use, for an error's hint:
    the same-host ones, then the default."""
    same = [f"{s.name} (same host)" for s in _specs(os.environ.get(BACKENDS_ENV, "")).values()
            if s.same_host and (cuda or not s.needs_cuda) and not (cuda and s.shm_cache)]
    return " or ".join([*same, DEFAULT_BACKEND])


@cache
def _specs(value: str) -> dict[str, KVBackendSpec]:
    """name -> spec: the built-ins, then each module of ``value`` ($SPLITSERVE_KV_BACKENDS)."""
    loaded = load_specs(BACKENDS_ENV, value, "BACKEND", KVBackendSpec, "splitserve_kv_backend")
    return merge(BACKENDS_ENV, BUILTIN, loaded, lambda s: s.name)

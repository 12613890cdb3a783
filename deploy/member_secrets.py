"""What each member of a local cluster (``splitserve up``, the tests' clusters) is given of
the cluster's secrets, and nothing more. Every member starts from the caller's
environment with each splitserve secret removed (``SECRET_ENVS``: the caller's own
$SPLITSERVE_API_KEY or Redis URLs never leak into a member), then gets its own:

    member                 environment                                        file
    redis-server           none (its password comes on its stdin)
    node, sim-nodes fleet  $SPLITSERVE_REDIS_URL, $SPLITSERVE_CLUSTER_TOKEN
    router                 the same, and $SPLITSERVE_RESPONSES_REDIS_URL      --api-key-file

The router's API keys travel in a file, one key spec per line, mode 0600 inside a
0700 folder of ``up``'s own (``tempfile.mkdtemp``), removed when the cluster stops: a
file keeps every key whole, whatever characters it holds (a variable's separator could
split one key into two). Only ``up`` being killed with SIGKILL leaves the folder behind,
readable by its owner only.

Must not start or stop processes (deploy/launcher.py does) or log a secret.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ..common.auth import CLUSTER_TOKEN_ENV, REDIS_URL_ENV, RESPONSES_REDIS_URL_ENV
from ..router.api_keys import API_KEY_ENV, ApiKey
from .orphan import launcher_env

SECRET_ENVS = (API_KEY_ENV, CLUSTER_TOKEN_ENV, REDIS_URL_ENV, RESPONSES_REDIS_URL_ENV)
KEY_FILE_NAME = "api-keys"


def scrubbed_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any splitserve secret, plus ``extra``."""
    env = {name: value for name, value in os.environ.items() if name not in SECRET_ENVS}
    env.update(extra)
    return env


def member_env(role: str, redis_url: str | None, cluster_token: str | None,
               responses_redis_url: str | None) -> dict[str, str]:
    """The environment of a splitserve member of ``role`` (router, prefill, decode,
    colocated, fleet): the table above."""
    env = scrubbed_env(PYTHONUNBUFFERED="1", **launcher_env())  # launcher_env: deploy/orphan.py
    if redis_url is not None:
        env[REDIS_URL_ENV] = redis_url
    if cluster_token:
        env[CLUSTER_TOKEN_ENV] = cluster_token
    if role == "router" and responses_redis_url is not None:
        env[RESPONSES_REDIS_URL_ENV] = responses_redis_url
    return env


class KeyFile:
    """The router's API keys as an owner-only file, written on the first ``path()`` call
    and removed by ``close()`` (idempotent)."""

    def __init__(self, keys: tuple[ApiKey, ...]):
        assert keys, "KeyFile: no keys (a router without keys takes none)"
        self.keys = keys
        self._dir: str | None = None

    def path(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="splitserve-up-")  # mode 0700
            fd = os.open(os.path.join(self._dir, KEY_FILE_NAME), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(k.spec() + "\n" for k in self.keys))
        return os.path.join(self._dir, KEY_FILE_NAME)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

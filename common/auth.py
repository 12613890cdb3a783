"""The cluster token: the shared secret every internal request carries.

Owns where the token comes from (``--cluster-token``, else ``--cluster-token-file``,
else the ``SPLITSERVE_CLUSTER_TOKEN`` environment variable; None: no token, every
internal endpoint open, as in tests that start one node by hand), the header it
travels in, and the constant-time comparison. Nodes check it on every internal
endpoint (node/runtime.py), the router and decode nodes send it on their internal
requests, and the KV handshake carries it (kvtransfer/wire.py ``Hello.token``).

Must not: log or print a token, or import anything beyond the standard library.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

HEADER = "X-Splitserve-Cluster-Token"
ENV = "SPLITSERVE_CLUSTER_TOKEN"
MIN_LEN = 16  # shorter tokens are guessable; `splitserve up` generates 43 characters


def load_cluster_token(flag: str | None = None, file: str | None = None,
                       env: Mapping[str, str] = os.environ) -> str | None:
    """The token from the flag, the file (first line, stripped) or ``env``; None when
    none is set. Raises ValueError naming the source when the token is unusable."""
    if flag:
        token, source = flag, "--cluster-token"
    elif file:
        try:
            token, source = Path(file).read_text().strip(), f"--cluster-token-file {file}"
        except OSError as e:
            raise ValueError(f"--cluster-token-file: cannot read {file}: {e.strerror}") from None
    else:
        token, source = env.get(ENV, ""), ENV
        if not token:
            return None
    if len(token) < MIN_LEN or any(c.isspace() for c in token):
        raise ValueError(f"{source}: the cluster token must be at least {MIN_LEN} characters without "
                         "whitespace; generate one with `python -c 'import secrets; print(secrets.token_urlsafe())'`")
    return token


def new_cluster_token() -> str:
    """A fresh random token (what `splitserve up` hands to its components)."""
    return secrets.token_urlsafe(32)


def token_ok(expected: str | None, presented: str | None) -> bool:
    """Whether ``presented`` matches (constant time). No token configured: always True."""
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers an internal request carries ({} without a token)."""
    return {} if token is None else {HEADER: token}


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs: Redis URLs carry one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))

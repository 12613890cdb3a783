"""Shared secrets: the cluster token every internal request carries, how a process
reads it (and the router its API keys) from a flag, a file or the environment, the
constant-time comparison, and credentials kept out of logs.

    add_cluster_token_args(group)      --cluster-token, --cluster-token-file
    cluster_token_from_args(args)      -> str | None (flag, else file, else $SPLITSERVE_CLUSTER_TOKEN)
    CLUSTER_TOKEN_HEADER               the header an internal request carries the token in
    token_matches(presented, expected) constant-time; False for a missing token
    auth_headers(token)                the headers an internal request carries ({} without a token)
    new_cluster_token()                a fresh random token (what `splitserve up` hands its members)
    bearer_token(authorization)        "Bearer <key>" -> "<key>" (None otherwise)
    redact_url(url)                    "redis://user:pw@host/0" -> "redis://user:***@host/0"

Nodes require the token on every internal endpoint (node/app.py) and in the KV
handshake (kvtransfer/wire.py ``Hello.token``); the router and decode nodes send it.
Must not decide which endpoint needs which secret (the servers do), log a secret, or
import anything beyond the standard library.
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

CLUSTER_TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"
CLUSTER_TOKEN_HEADER = "X-Splitserve-Cluster-Token"
MIN_SECRET_LEN = 8  # a shorter token or key is a typo or a placeholder, not a secret


def add_cluster_token_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    group.add_argument("--cluster-token", default=None,
                       help=f"shared secret of the cluster's internal requests (default: "
                            f"--cluster-token-file, else ${CLUSTER_TOKEN_ENV}, else none); "
                            "prefer the file or the environment: flags show in `ps`")
    group.add_argument("--cluster-token-file", default=None,
                       help="file holding the cluster token (surrounding whitespace ignored)")


def cluster_token_from_args(args: argparse.Namespace) -> str | None:
    """The cluster token from --cluster-token, else --cluster-token-file, else the
    environment; None when none is set. Raises ValueError naming the option when the
    file is unreadable or the token is too short."""
    return read_secret("cluster token", args.cluster_token, args.cluster_token_file,
                       CLUSTER_TOKEN_ENV)


def read_secret(what: str, value: str | None, file: str | None, env: str) -> str | None:
    """One secret: ``value`` if given, else the content of ``file``, else ``$env``."""
    if value is None and file is not None:
        try:
            value = Path(file).read_text().strip()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {file}: {e.strerror}") from None
        if not value:
            raise ValueError(f"{what}: {file} is empty")
    if value is None:
        value = os.environ.get(env) or None
    if value is not None:
        check_secret(what, value)
    return value


def check_secret(what: str, value: str) -> None:
    if len(value) < MIN_SECRET_LEN or any(c.isspace() for c in value):
        raise ValueError(f"{what}: must be at least {MIN_SECRET_LEN} characters without "
                         "whitespace; generate one with "
                         "`python -c 'import secrets; print(secrets.token_urlsafe())'`")


def token_matches(presented: str | None, expected: str) -> bool:
    """Whether ``presented`` equals ``expected``, in time independent of where they differ."""
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def auth_headers(token: str | None) -> dict[str, str]:
    """The headers an internal request carries ({} without a token)."""
    return {} if token is None else {CLUSTER_TOKEN_HEADER: token}


def new_cluster_token() -> str:
    """A fresh random token (`splitserve up` generates one for its members)."""
    return secrets.token_urlsafe(32)


def bearer_token(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header."""
    if not authorization:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return None
    return credential.strip()


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, for logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))

"""Shared secrets: the cluster token every internal request carries, how a process
reads it (and the router its API keys, every process its Redis URL) from a flag, a file
or the environment, the constant-time comparison, and credentials kept out of logs.

    add_cluster_token_args(group)      --cluster-token, --cluster-token-file
    cluster_token_from_args(args)      -> str | None (flag, else file, else $SPLITSERVE_CLUSTER_TOKEN)
    redis_url_from(flag, default)      --redis-url, else $SPLITSERVE_REDIS_URL, else ``default``
                                       (env=RESPONSES_REDIS_URL_ENV: the responses' own Redis)
    read_secret_file(what, path)       a secret file's text (warns when others may read it)
    warn_secret_flag(flag, instead)    the warning for a secret given on the command line
    CLUSTER_TOKEN_HEADER               the header an internal request carries the token in
    token_matches(presented, expected) constant-time; False for a missing token
    auth_headers(token)                the headers an internal request carries ({} without a token)
    new_cluster_token()                a fresh random token (what `splitserve up` hands its members)
    keyed_digest(token, label, key)    32 hex digits of an HMAC of an API key under a secret derived
                                       from the cluster token and ``label`` (owner ids, derived salts)
    bearer_token(authorization)        "Bearer <key>" -> "<key>" (None otherwise)
    redact_url(url)                    "redis://user:pw@host/0" -> "redis://user:***@host/0"

Nodes require the token on every internal endpoint (node/app.py) and in the KV
handshake (kvtransfer/wire.py ``Hello.token``); the router and decode nodes send it.

Secrets belong in the environment or in a file only its owner can read: any local user
sees every process's command line (``ps``, /proc/<pid>/cmdline), so a secret given as a
flag (--cluster-token, --api-key, a --redis-url with a password) still works but logs a
warning, and ``splitserve up`` hands its members every secret in their environment.
Must not decide which endpoint needs which secret (the servers do), log a secret, or
import anything beyond the standard library.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

CLUSTER_TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"
REDIS_URL_ENV = "SPLITSERVE_REDIS_URL"  # the Redis URL, password included, for every process
# The routers' own Redis for stored /v1/responses (router/responses/store.py), apart from the
# node registry's; unset: the responses live in $SPLITSERVE_REDIS_URL's Redis.
RESPONSES_REDIS_URL_ENV = "SPLITSERVE_RESPONSES_REDIS_URL"
CLUSTER_TOKEN_HEADER = "X-Splitserve-Cluster-Token"
MIN_SECRET_LEN = 8  # a shorter token or key is a typo or a placeholder, not a secret


def add_cluster_token_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    group.add_argument("--cluster-token", default=None,
                       help=f"shared secret of the cluster's internal requests (default: "
                            f"--cluster-token-file, else ${CLUSTER_TOKEN_ENV}, else none); "
                            "prefer the file or the environment: flags show in `ps`")
    group.add_argument("--cluster-token-file", default=None,
                       help="file holding the cluster token (surrounding whitespace ignored; "
                            "readable by its owner only)")


def cluster_token_from_args(args: argparse.Namespace) -> str | None:
    """The cluster token from --cluster-token, else --cluster-token-file, else the
    environment; None when none is set. Raises ValueError naming the option when the
    file is unreadable or the token is too short."""
    if args.cluster_token is not None:
        warn_secret_flag("--cluster-token", f"--cluster-token-file or ${CLUSTER_TOKEN_ENV}")
    return read_secret("cluster token", args.cluster_token, args.cluster_token_file,
                       CLUSTER_TOKEN_ENV)


def read_secret(what: str, value: str | None, file: str | None, env: str) -> str | None:
    """One secret: ``value`` if given, else the content of ``file``, else ``$env``."""
    if value is None and file is not None:
        value = read_secret_file(what, file).strip()
        if not value:
            raise ValueError(f"{what}: {file} is empty")
    if value is None:
        value = os.environ.get(env) or None
    if value is not None:
        check_secret(what, value)
    return value


def read_secret_file(what: str, file: str) -> str:
    """The text of the secret file ``file``; ValueError naming ``what`` when it is
    unreadable. Warns when its group or other users may read it (chmod 600 it)."""
    try:
        text = Path(file).read_text()
        mode = os.stat(file).st_mode
    except OSError as e:
        raise ValueError(f"{what}: cannot read {file}: {e.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: %s may be read by other users (mode %o); `chmod 600 %s`", what, file,
                    stat.S_IMODE(mode), file)
    return text


def warn_secret_flag(flag: str, instead: str) -> None:
    """Log that the secret given as ``flag`` shows in every local user's `ps`."""
    log.warning("%s on the command line is visible to every local user (ps, /proc/<pid>/cmdline); "
                "use %s instead", flag, instead)


def redis_url_from(flag: str | None, default: str | None = None, env: str = REDIS_URL_ENV,
                   flag_name: str = "--redis-url") -> str | None:
    """The Redis URL: ``flag`` (``flag_name``; warned about when it carries a password),
    else ``$env`` ($SPLITSERVE_REDIS_URL), else ``default``."""
    if flag is not None:
        if _has_password(flag):
            warn_secret_flag(f"a {flag_name} with a password", f"${env}")
        return flag
    return os.environ.get(env) or default


def _has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


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


def keyed_digest(cluster_token: str | None, label: bytes, key: str) -> str:
    """32 hex digits of HMAC-SHA256(HMAC-SHA256(cluster token, ``label``), ``key``): what
    stands for an API key wherever it must not appear (stored-response owners, derived cache
    salts). Replicas sharing the token agree; another label gives unrelated digests. Without
    a token the secret is ``label`` itself: no better than a plain hash, and documented so."""
    secret = label if cluster_token is None else hmac.new(cluster_token.encode(), label, hashlib.sha256).digest()
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:32]


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

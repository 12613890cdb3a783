"""Client authentication on the router: the API-key middleware and who may see
other clients' request ids.

    every path but /health, /ping,        needs "Authorization: Bearer <API key>"
      /metrics and /debug/decisions       when the router has API keys
    /health and /ping, /metrics           open unless --protect-health / --protect-metrics;
                                          protected /metrics also takes the cluster token
                                          (the planner's credential)
    /debug/decisions                      every client's traffic: only the cluster token
                                          (``require_cluster_token``: 403), never an API
                                          key; open only on a router with neither
    no API key configured                 everything else open (the bind warning in app.py)

A missing or wrong key gets a 401 with an OpenAI-style body (code ``invalid_api_key``)
and ``WWW-Authenticate: Bearer``, before the body is read. Keys are compared in
constant time, every configured key each time. The matched key's cache salt, when it
has one, is left on the request (``KEY_SALT``) for the generating endpoints, which
combine it with the request's own (router/api_keys.py); so is the key's owner id
(``KEY_OWNER``), which owns the responses stored for it (router/responses/store.py).

The owner id is an HMAC of the key, never a plain hash (Redis would then hold values
that confirm a guessed key offline). Its secret is derived from the cluster token, the
one secret every router replica of a cluster already shares, so replicas agree on
owners without another secret to distribute; rotating the token (or upgrading from the
plain hashes before) leaves the stored responses unreadable until they expire (an hour).
A router without a cluster token uses a fixed, public secret: no better than a hash.

Must not read request bodies or log a presented credential.
"""

from __future__ import annotations

from aiohttp import web

from ...common.auth import CLUSTER_TOKEN_HEADER, bearer_token, keyed_digest, token_matches
from ..api_keys import matched_key
from ..config import RouterConfig
from ..errors import ApiError
from .state import CONFIG

KEY_SALT = web.RequestKey("key_cache_salt", str)  # the matched API key's cache salt, when it has one
KEY_OWNER = web.RequestKey("key_owner", str)  # who presented the request: its API key's owner id
OWNER_LABEL = b"splitserve response owner v1"  # the owner secret's derivation label (a new version: new owners)


def needs_api_key(config: RouterConfig, path: str) -> bool:
    if not config.api_keys:
        return False
    if path in ("/health", "/ping"):  # /ping: vLLM's name for the same probe
        return config.protect_health
    if path == "/metrics":
        return config.protect_metrics
    if path == "/debug/decisions" and config.cluster_token is not None:
        return False  # the cluster token's alone (require_cluster_token)
    return True


def key_matches(config: RouterConfig, presented: str | None) -> bool:
    return matched_key(config.api_keys, presented) is not None


@web.middleware
async def api_key_middleware(request: web.Request, handler) -> web.StreamResponse:
    config = request.app[CONFIG]
    if needs_api_key(config, request.path) and not (request.path == "/metrics" and has_cluster_token(request)):
        presented = bearer_token(request.headers.get("Authorization"))
        if presented is None:
            raise _unauthorized("missing API key: send the header 'Authorization: Bearer "
                                "<key>' (the router was started with --api-key)")
        key = matched_key(config.api_keys, presented)
        if key is None:
            raise _unauthorized("invalid API key")
        if key.cache_salt is not None:
            request[KEY_SALT] = key.cache_salt
        request[KEY_OWNER] = owner_id(config.cluster_token, key.key)
    return await handler(request)


def owner_id(cluster_token: str | None, key: str) -> str:
    """``key``'s owner id: HMAC-SHA256 under a secret derived from ``cluster_token``
    (the label alone without one), 32 hex digits."""
    return keyed_digest(cluster_token, OWNER_LABEL, key)


def key_salt(request: web.Request) -> str | None:
    """The cache salt of the API key the request came with (None: no key, or no salt)."""
    return request.get(KEY_SALT)


def key_owner(request: web.Request) -> str | None:
    """Whose request this is: the owner id of the API key it came with (never the key
    itself), None when the router takes no key. Stored responses belong to it."""
    return request.get(KEY_OWNER)


def has_cluster_token(request: web.Request) -> bool:
    """Whether the caller presented this router's cluster token (never, when it has none)."""
    token = request.app[CONFIG].cluster_token
    return token is not None and token_matches(request.headers.get(CLUSTER_TOKEN_HEADER), token)


def require_cluster_token(request: web.Request) -> None:
    """For what shows every client's traffic: 403 unless the caller presents the cluster
    token. A router with neither API keys nor a cluster token is open to all anyway."""
    config = request.app[CONFIG]
    if has_cluster_token(request) or (not config.api_keys and config.cluster_token is None):
        return
    if config.cluster_token is None:
        raise ApiError(403, f"{request.path} needs the cluster token, and this router has none: start "
                       "it with --cluster-token-file or $SPLITSERVE_CLUSTER_TOKEN", code="permission_denied")
    raise ApiError(403, f"{request.path} shows every client's requests: present the cluster token in "
                   f"the {CLUSTER_TOKEN_HEADER} header (an API key does not open it)", code="permission_denied")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

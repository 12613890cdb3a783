"""Client API keys, the cache salt each may carry, and the rule that makes a request's
effective cache salt (tenant isolation of the prefix caches).

    a key spec              KEY                    a client key
                            KEY cache_salt=SALT    a key whose requests are hashed under SALT
    --api-key SPEC          repeatable; shows in `ps`: prefer the file or the environment
    --api-key-file FILE     one spec per line; blank lines and lines starting with # skipped
    $SPLITSERVE_API_KEY     one spec per line (read when neither of the above is given); a
                            comma is refused: keys are not comma-separated

A key's salt (``resolve_salts``, when the router's config is resolved):

    the key spec            --shared-prefix-cache   the key's salt
    KEY cache_salt=SALT     either                  SALT: keys naming one salt share one cache
    KEY                     off (the default)       "key <HMAC of KEY>": a cache of its own
    KEY                     on                      none: the one unsalted cache of every such key

A derived salt is an HMAC-SHA256 of the key under a secret derived from the cluster token
(``derived_salt``; a public label without one), never the key nor a plain hash of it:
salts travel to the nodes and may be logged, and a plain hash would confirm a guessed key
offline. Every router replica of a cluster shares the token, so they derive the same
salts; a new token gives each key a new, empty cache. An explicit SALT has no whitespace,
so it never equals a derived one. Without API keys nothing is salted (one client).

A request's effective salt (what its block hashes are made with, common/hashing.py
``hash_keys``), as JSON text of [key salt, request salt]::

    key's salt   request's cache_salt   effective
    none         none                   none: the shared, unsalted cache
    K            none                   ["K", null]
    none         R                      [null, "R"]
    K            R                      ["K", "R"]

A request's own ``cache_salt`` narrows its key's namespace and never replaces it: the
key's salt always sits in the first place, which no request can write, so whatever a
client sends it cannot name another tenant's blocks. With keys, only
--shared-prefix-cache leaves a key's salt empty: then its requests share the unsalted
cache (a request's ``cached_tokens`` tells what the other keys' prompts began with)
unless they bring their own ``cache_salt``.

Must not log a key, or compare keys in time that depends on where they differ.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import NamedTuple

from ..common.auth import check_secret, keyed_digest, read_secret_file, token_matches, warn_secret_flag

API_KEY_ENV = "SPLITSERVE_API_KEY"  # key specs, one per line
SALT_OPTION = "cache_salt"
MAX_KEY_SALT_CHARS = 256
SALT_LABEL = b"splitserve key cache salt v1"  # the derived salts' secret label (a new version: new salts)


class ApiKey(NamedTuple):
    key: str
    cache_salt: str | None = None  # every request made with this key is hashed under it

    def spec(self) -> str:
        """The key spec this key is read back from (``parse_key_spec``)."""
        return self.key if self.cache_salt is None else f"{self.key} {SALT_OPTION}={self.cache_salt}"


def parse_key_spec(spec: str, where: str) -> ApiKey:
    """``KEY`` or ``KEY cache_salt=SALT`` -> ApiKey; ValueError naming ``where`` (the flag,
    file line or variable it came from) otherwise, never quoting the spec: any part of it
    may be key material (a key with a space in it reads as a key and an option). SALT: no
    whitespace or comma."""
    key, *options = spec.split()
    salt = None
    for option in options:
        name, sep, value = option.partition("=")
        if name != SALT_OPTION or not sep or not value or salt is not None:
            raise ValueError(f"{where}: expected 'KEY' or 'KEY {SALT_OPTION}=SALT' (a key has no "
                             f"whitespace; the one option is {SALT_OPTION}=, given once)")
        if "," in value or len(value) > MAX_KEY_SALT_CHARS:
            raise ValueError(f"{where}: {SALT_OPTION} must be at most {MAX_KEY_SALT_CHARS} characters "
                             "without whitespace or commas")
        salt = value
    if key.startswith("#"):  # a key file would read it as a comment, and lose the key
        raise ValueError(f"{where}: an api key must not start with '#'")
    check_secret(f"{where}: api key", key)
    return ApiKey(key, salt)


def api_keys_from_args(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    """--api-key specs plus the lines of --api-key-file; neither: $SPLITSERVE_API_KEY
    (one spec per line). Raises ValueError naming the option or line at fault."""
    keys: list[ApiKey] = []
    for spec in args.api_key or []:
        if spec.strip():
            keys.append(parse_key_spec(spec, "--api-key"))
    if args.api_key:
        warn_secret_flag("--api-key", f"--api-key-file or ${API_KEY_ENV}")
    if getattr(args, "api_key_file", None) is not None:
        text = read_secret_file("api key file", args.api_key_file)
        before = len(keys)
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                keys.append(parse_key_spec(line, f"{args.api_key_file}:{n}"))
        if len(keys) == before:  # taken as "no keys", the router would be open to anyone
            raise ValueError(f"api key file: {args.api_key_file} holds no key (only comments or blank lines)")
    if not keys:
        keys = env_api_keys(os.environ.get(API_KEY_ENV, ""))
    return unique_keys(keys)


def env_api_keys(value: str) -> list[ApiKey]:
    """The key specs of $SPLITSERVE_API_KEY, one per line. A comma is refused: specs were
    once comma-separated, and a key containing one would split into two keys, each half
    authenticating alone."""
    if "," in value:
        raise ValueError(f"${API_KEY_ENV}: holds a comma; give one key spec per line (keys are not "
                         "comma-separated, and a key cannot contain a comma here), or use --api-key-file")
    return [parse_key_spec(line, f"${API_KEY_ENV}") for line in value.splitlines() if line.strip()]


def unique_keys(keys: list[ApiKey] | tuple[ApiKey, ...]) -> tuple[ApiKey, ...]:
    """``keys`` without repeats, in order; ValueError for one key given two salts."""
    salts: dict[str, str | None] = {}
    for k in keys:
        if salts.setdefault(k.key, k.cache_salt) != k.cache_salt:
            raise ValueError("api keys: one key is listed twice with different cache salts")
    return tuple(ApiKey(key, salt) for key, salt in salts.items())


def resolve_salts(keys: tuple[ApiKey, ...], cluster_token: str | None,
                  shared_prefix_cache: bool) -> tuple[ApiKey, ...]:
    """``keys`` with each key without a salt given its derived one (the first table),
    unless ``shared_prefix_cache``. Resolving resolved keys changes nothing."""
    if shared_prefix_cache:
        return keys
    return tuple(k if k.cache_salt is not None else ApiKey(k.key, derived_salt(cluster_token, k.key))
                 for k in keys)


def derived_salt(cluster_token: str | None, key: str) -> str:
    """The cache salt of ``key`` when it has none of its own: "key " and 32 hex digits of
    HMAC-SHA256(HMAC-SHA256(cluster token, SALT_LABEL), key) (SALT_LABEL alone as the
    secret without a token)."""
    return "key " + keyed_digest(cluster_token, SALT_LABEL, key)


def matched_key(keys: tuple[ApiKey, ...], presented: str | None) -> ApiKey | None:
    """The configured key ``presented`` is, or None; every key is compared, in constant time."""
    found = None
    for k in keys:  # no early exit: the time does not tell which key matched
        if token_matches(presented, k.key):
            found = k
    return found


def effective_cache_salt(key_salt: str | None, request_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed under (the table above); None: unsalted."""
    if key_salt is None and request_salt is None:
        return None
    return json.dumps([key_salt, request_salt], ensure_ascii=False, separators=(",", ":"))

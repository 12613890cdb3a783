"""The plugin registries: those a user extends from outside the package: the family
registry (engine/models/families.py, ``$SPLITSERVE_MODEL_FAMILIES``), the backend
registry (common/kv_backends.py, ``$SPLITSERVE_KV_BACKENDS``) and the policy registry
(router/routing/policy_registry.py, ``$SPLITSERVE_ROUTING_POLICIES``).

Owns what they share: reading an environment variable's comma-separated entries (an
importable module name, ``my_pkg.my_backend``, or a ``.py`` file's path), each module
defining one spec under a known name; merging them after the built-ins, refusing a name
taken twice; resolving a ``"module:attr"`` reference on demand; and ``Names``, a plugin
registry's names read only when first asked (argparse's ``choices``). Must not know
any registry's spec type.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def load_specs(env: str, value: str, attr: str, kind: type[T], prefix: str) -> list[tuple[str, T]]:
    """(entry, spec) for each entry of ``value`` (``$env``): the module's ``attr``, a ``kind``.
    A file is loaded as module ``<prefix>_<stem>``. Raises ValueError naming ``env``."""
    return [(e.strip(), _load(env, e.strip(), attr, kind, prefix)) for e in value.split(",") if e.strip()]


def merge(env: str, builtin: Sequence[T], loaded: list[tuple[str, T]], name: Callable[[T], str]) -> dict[str, T]:
    """name -> spec: the built-ins, then the loaded ones; a name taken twice raises naming its source."""
    out: dict[str, T] = {}
    for spec, source in [(s, "built in") for s in builtin] + [(s, e) for e, s in loaded]:
        if name(spec) in out:
            raise ValueError(f"{env}: {source} registers {name(spec)!r}, which another module registers "
                             "already; give it a name of its own")
        out[name(spec)] = spec
    return out


def resolve(ref: str | Any) -> Any:
    """``ref`` itself, or for a ``"module:attr"`` string that attribute, imported now."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


class Names(Collection[str]):
    """A plugin registry's names, read from ``read`` each time they are asked for: argparse's
    ``choices`` of a flag (give it a ``metavar``, or building the parser reads them), so a
    process that never parses the flag never loads the modules of ``$env``."""

    def __init__(self, read: Callable[[], Sequence[str]]):
        self._read = read

    def __contains__(self, name: object) -> bool:
        return name in self._read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def _load(env: str, entry: str, attr: str, kind: type[T], prefix: str) -> T:
    if entry.endswith(".py"):
        path = Path(entry).expanduser()
        if not path.is_file():
            raise ValueError(f"{env}: {entry} is no file; name a .py file or an importable module")
        name = f"{prefix}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: dataclasses and "module:attr" look it up
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(entry)
    found = getattr(module, attr, None)
    if not isinstance(found, kind):
        raise ValueError(f"{env}: {entry} defines no {attr} (a {kind.__module__}.{kind.__qualname__})")
    return found

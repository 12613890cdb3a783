"""router/'s modules import one another without a cycle: read from the source (every
import counts, a lazy one inside a function too, so none can dodge a cycle), and
imported each before any other router module (in a fresh interpreter, router/'s
modules forgotten between two)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import splitserve.router

ROUTER = Path(splitserve.router.__file__).parent
PACKAGE = "splitserve.router"


def router_modules() -> list[str]:
    return sorted(p.stem for p in ROUTER.glob("*.py") if p.stem != "__init__")


def imported_router_modules(name: str) -> set[str]:
    """The router modules that router/<name>.py imports, anywhere in the file."""
    modules = set(router_modules())
    out: set[str] = set()
    for n in ast.walk(ast.parse((ROUTER / f"{name}.py").read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level == 1:  # from .x import y / from . import x
                target = n.module.split(".")[0] if n.module else None
                out |= {target} if target else {a.name for a in n.names}
            elif n.level == 2 and n.module and n.module.startswith("router."):
                out.add(n.module.split(".")[1])
            elif n.level == 0 and n.module and n.module.startswith(PACKAGE + "."):
                out.add(n.module.split(".")[2])
        elif isinstance(n, ast.Import):
            out |= {a.name.split(".")[2] for a in n.names if a.name.startswith(PACKAGE + ".")}
    return (out & modules) - {name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)) is not None:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_router_imports_have_no_cycle():
    graph = {m: imported_router_modules(m) for m in router_modules()}
    assert graph["policy_registry"] >= {"cache_aware", "load_policies", "policy"}  # the reader works
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_policies_do_not_import_the_registry():
    for m in ("policy", "cache_aware", "load_policies", "node_terms", "recent_work"):
        assert "policy_registry" not in imported_router_modules(m), m


_IMPORT_EACH_FIRST = """
import importlib, json, sys, traceback
failed = {}
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "splitserve.router" or m.startswith("splitserve.router.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module("splitserve.router." + name)
    except Exception:
        failed[name] = traceback.format_exc(limit=3)
print(json.dumps(failed))
"""


def test_each_router_module_imports_first_on_its_own():
    """Every module imported before any other router module (the others' modules
    forgotten in between: an import cycle shows as a partly initialized module)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST, *router_modules()],
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}

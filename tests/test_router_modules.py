"""router/'s modules: the routing policies never import the policy registry (it imports
them), and each module imports before any other router module (in a fresh
interpreter, router/'s modules forgotten between two). Cycles anywhere in the product:
test_import_layers.py."""

import json
import subprocess
import sys
from pathlib import Path

import splitserve.router
from splitserve.tests.import_graph import graph

ROUTER = Path(splitserve.router.__file__).parent


def router_modules() -> list[str]:
    """Every module under router/, dotted below it (``routing.prefix_mirror``); packages too."""
    return sorted(".".join(p.relative_to(ROUTER).with_suffix("").parts).removesuffix(".__init__")
                  for p in ROUTER.rglob("*.py") if p != ROUTER / "__init__.py")


def test_the_policies_do_not_import_the_policy_registry():
    g = graph()
    routing = "router.routing"
    assert {f"{routing}.cache_aware", f"{routing}.load_policies", f"{routing}.policy"} <= g[f"{routing}.policy_registry"]
    for m in ("policy", "cache_aware", "load_policies", "node_terms", "recent_work"):
        assert f"{routing}.policy_registry" not in g[f"{routing}.{m}"], m


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

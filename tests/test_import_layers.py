"""The product's import arrows run one way, read from the source (every import counts, a
lazy one inside a function too, so none can dodge the rule):

    cli, splitserve/__init__                                      7
    benchmarks (experiments; loadgen is the CLI's load tools)     6
    deploy (the launcher and supervisor start processes)          5
    prefill_node, decode_node (the roles)                         4
    node (what both roles share), router                          3
    engine, kvtransfer                                            2
    csrc                                                          1
    common                                                        0

A module imports only its own package or a package of a lower layer; there is no import
cycle among product modules; a benchmark imports no other subject's benchmark (only the
shared harness and the load tools); nothing in the product imports tests/."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "splitserve"
LAYER = {"common": 0, "csrc": 1, "engine": 2, "kvtransfer": 2, "node": 3, "router": 3, "prefill_node": 4,
         "decode_node": 4, "deploy": 5, "benchmarks": 6, "cli": 7, "": 7}  # "": the package's own __init__
BENCHMARKS_SHARED = ("benchmarks.harness", "benchmarks.loadgen")  # what every benchmark may import


def module_name(path: Path) -> str:
    """``engine.model`` for engine/model.py, ``router`` for router/__init__.py, ``""`` for the root."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    files = {"cli": ROOT / "cli.py", "": ROOT / "__init__.py"}
    for package in LAYER:
        if package and package != "cli":
            files.update((module_name(p), p) for p in (ROOT / package).rglob("*.py"))
    return files


def imports(path: Path) -> set[str]:
    """Every splitserve module name ``path`` imports (without the ``splitserve.`` prefix),
    and for ``from x import y`` also ``x.y`` (y may be a module)."""
    here = module_name(path).split(".") if module_name(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                target = node.module.removeprefix(PACKAGE).removeprefix(".")
            else:
                continue
            found.add(target)
            found.update(f"{target}.{a.name}".lstrip(".") for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix(PACKAGE + ".") for a in node.names if a.name.startswith(PACKAGE + "."))
    return found


def graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (resolved to the longest known name)."""
    modules = product_modules()
    out = {}
    for name, path in modules.items():
        deps = set()
        for target in imports(path):
            parts = target.split(".")
            known = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules),
                         None)
            if known is not None and known != name and not name.startswith(known + ".") and known != "":
                deps.add(known)  # a package's __init__ re-exporting its modules, or a module its package: no arrow
        out[name] = deps
    return out


def top(name: str) -> str:
    return name.split(".")[0]


def test_arrows_run_down_the_layers():
    upward = sorted((a, b) for a, deps in graph().items() for b in deps
                    if top(a) != top(b) and LAYER[top(b)] >= LAYER[top(a)])
    assert upward == [], "imports that do not go down a layer: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []  # state: 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(g[name]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(g):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_benchmarks_import_no_other_subject_and_nothing_imports_tests():
    bad = []
    for name, deps in graph().items():
        bad += [(name, d) for d in deps if top(d) == "tests"]
        if top(name) == "benchmarks" and len(name.split(".")) > 2:
            subject = ".".join(name.split(".")[:2])
            bad += [(name, d) for d in deps if top(d) == "benchmarks" and not d.startswith(subject + ".")
                    and not d.startswith(BENCHMARKS_SHARED) and d != "benchmarks"]
    for name, path in product_modules().items():
        bad += [(name, t) for t in imports(path) if top(t) == "tests"]
    assert bad == [], bad


@pytest.mark.parametrize("module, imported", [
    ("decode_node.server", "node.app"),  # a plain relative import
    ("cli", "decode_node.server"),  # a lazy import inside a function
    ("node.runtime", "engine.engine_thread"),
])
def test_the_check_sees_the_arrows(module, imported):
    """The parser finds the arrows it polices (a check that could not fail is none)."""
    assert imported in graph()[module]

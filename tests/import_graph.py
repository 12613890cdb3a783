"""The product's import graph read from the source: every import counts, a lazy one inside
a function too. Shared by the tests that police the arrows (test_import_layers.py,
test_router_modules.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "splitserve"
# top-level package -> its layer: a module imports only its own package or a lower layer
LAYER = {"common": 0, "csrc": 1, "engine": 2, "kvtransfer": 2, "node": 3, "router": 3, "prefill_node": 4,
         "decode_node": 4, "deploy": 5, "benchmarks": 6, "cli": 7, "": 7}  # "": the package's own __init__


def module_name(path: Path) -> str:
    """``engine.models.llama`` for engine/models/llama.py, ``router`` for router/__init__.py, ``""`` for the root."""
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


# Inside a top-level package, its parts in the same one-way order. A part is a subfolder, a module
# named here (of the package, or of a subfolder: "parallel.worker"), or "": every other module
# directly in the package. The package's __init__ sits above them all. A module imports only its
# own part or a lower one.
SUBLAYER = {
    "router": {"": 0, "routing": 1, "streams": 2, "openai": 3, "responses": 4, "http": 5, "app": 6},
    "kvtransfer": {"": 0, "backends": 1, "factory": 2},
    # engine: what a step is made of, then the runners and scheduler (""), then what drives them
    "engine": {"upload": 0, "step_inputs": 0, "limits": 0, "parallel": 1, "attention": 2, "models": 3, "kv": 4,
               "sampling": 5, "": 6, "parallel.worker": 7, "parallel.launch": 8, "engine_core": 9,
               "engine_thread": 10, "step_fault": 10, "llm": 11},
}


def part(name: str) -> str:
    """``routing`` for router.routing.prefix_mirror, ``app`` for router.app, ``""`` for router.errors,
    ``__init__`` for router itself."""
    parts = name.split(".")
    if len(parts) == 1:
        return "__init__"
    order = SUBLAYER.get(parts[0], {})
    return next((p for p in (".".join(parts[1:3]), parts[1]) if p in order), "")


def sublayer(name: str) -> int:
    order = SUBLAYER[top(name)]
    return max(order.values()) + 1 if part(name) == "__init__" else order[part(name)]

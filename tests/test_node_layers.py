"""The node side's import arrows run one way: cli -> role (prefill_node, decode_node)
-> node -> engine / kvtransfer -> common. Read from the source (every import, a
function's lazy ones included), so an upward import or a cycle fails here before it
confuses a reader."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "splitserve"
TOP = ("cli", "router", "deploy", "benchmarks", "tests")  # above every node-side package
# package -> the top-level packages it must not import
FORBIDDEN = {
    "node": ("prefill_node", "decode_node", *TOP),
    "prefill_node": ("decode_node", *TOP),
    "decode_node": ("prefill_node", *TOP),
    "engine": ("node", "prefill_node", "decode_node", "kvtransfer", *TOP),
    "kvtransfer": ("node", "prefill_node", "decode_node", "engine", *TOP),
    "common": ("node", "prefill_node", "decode_node", "engine", "kvtransfer", *TOP),
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every product module ``path`` imports (absolute, without the package prefix)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif (node.module or "").startswith(PACKAGE + "."):
                target = node.module.removeprefix(PACKAGE + ".")
            else:
                continue
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)  # `from .x import module`
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix(PACKAGE + ".") for a in node.names if a.name.startswith(PACKAGE + "."))
    return found


def product_files(packages) -> dict[str, pathlib.Path]:
    files = {}
    for package in packages:
        if package == "cli":
            files["cli"] = ROOT / "cli.py"
            continue
        for path in (ROOT / package).rglob("*.py"):
            files[module_name(path)] = path
    return files


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_import(package):
    bad = sorted((name, target) for name, path in product_files([package]).items() for target in imports(path)
                 if target.split(".")[0] in FORBIDDEN[package])
    assert bad == [], f"{package}/ imports upward: {bad}"


def test_no_import_cycle_on_the_node_side():
    files = product_files(["cli", *FORBIDDEN])
    graph = {name: {t for t in imports(path) if t in files and t != name} for name, path in files.items()}
    # a package's __init__ re-exporting its own modules is structure, not an arrow between modules
    graph = {name: {t for t in deps if t.rsplit(".", 1)[0] != name} for name, deps in graph.items()}
    cycles, state = [], {}  # module -> 1 visiting, 2 done

    def visit(name, stack):
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_imports():
    """The parser finds the arrows it is meant to police (a test that could not fail is none)."""
    assert "node.app" in imports(ROOT / "decode_node" / "server.py")
    assert "decode_node.server" in imports(ROOT / "cli.py")  # a lazy import inside a function
    assert "engine.engine_thread" in imports(ROOT / "node" / "runtime.py")

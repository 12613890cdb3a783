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

A module imports only its own package or a package of a lower layer, and never a package
``APART`` keeps it from (the router nothing of the engine); there is no import cycle among
product modules; a benchmark imports no other subject's benchmark (only the
shared harness and the load tools); nothing in the product imports tests/."""

import pytest

from splitserve.tests.import_graph import LAYER, SUBLAYER, graph, imports, part, product_modules, sublayer, top

BENCHMARKS_SHARED = ("benchmarks.harness", "benchmarks.loadgen")  # what every benchmark may import
# package -> lower packages it must not import all the same: the router reads config.json itself
# (common/hf_config.py), so a model family only the nodes know never stops it from starting
APART = {"router": ("engine",)}


def test_arrows_run_down_the_layers():
    upward = sorted((a, b) for a, deps in graph().items() for b in deps
                    if top(a) != top(b) and LAYER[top(b)] >= LAYER[top(a)])
    assert upward == [], "imports that do not go down a layer: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_arrows_run_down_the_parts_inside_a_package():
    """router: routing < streams < openai < responses < http < app, its base modules below all;
    kvtransfer: its base < backends < factory; engine: parallel < attention < models < kv <
    sampling < the runners < the worker and rank 0's launch < the core < its thread (SUBLAYER)."""
    upward = sorted((a, b) for a, deps in graph().items() for b in deps
                    if top(a) == top(b) in SUBLAYER and part(a) != part(b) and sublayer(b) >= sublayer(a))
    assert upward == [], "imports that do not go down a part: " + ", ".join(f"{a} -> {b}" for a, b in upward)


def test_packages_kept_apart_import_nothing_of_each_other():
    bad = sorted((a, b) for a, deps in graph().items() for b in deps if top(b) in APART.get(top(a), ()))
    assert bad == [], "imports across a wall: " + ", ".join(f"{a} -> {b}" for a, b in bad)


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


@pytest.mark.parametrize("low, high", [
    ("router.errors", "router.routing.prefix_mirror"),  # the base below every part
    ("router.streams.dispatch", "router.openai.bodies"),
    ("router.http.state", "router.app"),
    ("router.app", "router"),  # the package's __init__ above all
    ("kvtransfer.backends.tcp", "kvtransfer.factory"),
    ("engine.parallel.group", "engine.models.llama"),
    ("engine.model_runner", "engine.parallel.worker"),
    ("engine.parallel.launch", "engine.engine_core"),
])
def test_the_parts_are_ordered(low, high):
    assert sublayer(low) < sublayer(high)

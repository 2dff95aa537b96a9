"""The shape of the package: data flows down one way.

The library (``models``, ``heads``, ``tasks``, ``interventions``, ``scoring``, ``stats``,
``render`` and the small modules they share) never imports an application (the scan, the CLI,
the findings run, the hybrid experiment, the lm-eval table, the zoo, the test helpers); no two
packages import each other, directly or around a circle. Imports inside functions count: a lazy
import that climbs back up is still a circle a reader has to follow.
"""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "gna_lens"

#: Bottom to top; a package may import only packages listed before it (and itself).
LIBRARY = (
    "errors", "runtime", "device", "stats", "table", "render", "models", "heads", "tasks",
    "interventions", "sweep_policy", "distributed", "plots", "scoring",
)  # fmt: skip
APPLICATIONS = ("zoo", "testing", "scan", "hybrid", "lm_eval", "findings", "cli")

#: The one circle allowed, and why: the model family registry. ``models.families`` registers
#: one module per Hugging Face family; each family module subclasses the generic blocks and
#: mixers and builds configs, while the generic code (``SSMConfig.from_hf``, ``SSMBlock``,
#: ``HookedSSM``) looks families up by name through the registry at run time (lazy imports,
#: each commented where it is). Breaking it would mean a registration step every family must
#: remember to call; the circle stays inside ``gna_lens.models``.
REGISTRY = ("gna_lens.models.block", "gna_lens.models.config", "gna_lens.models.families",
            "gna_lens.models.hooked_ssm", "gna_lens.models.mixers")  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _targets(module: str, path: Path, node: ast.AST, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
    # "from pkg import submodule" needs the submodule; any other name needs pkg itself
    return subs + ([target] if len(subs) < len(node.names) else [])


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of gna_lens it imports}``, lazy imports included."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for t in _targets(name, path, node, modules):
                    if t in modules and t != name:
                        graph[name].add(t)
    return graph


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "gna_lens"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    nodes = set(graph) | {b for bs in graph.values() for b in bs}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_package_is_placed(graph):
    placed = set(LIBRARY) | set(APPLICATIONS) | {"gna_lens"}
    assert {package(m) for m in graph} <= placed, {package(m) for m in graph} - placed


def test_no_circle_between_packages(graph):
    packages: dict[str, set[str]] = defaultdict(set)
    for a, bs in graph.items():
        for b in bs:
            if package(a) != package(b) and package(b) != "gna_lens":
                packages[package(a)].add(package(b))
    assert circles(packages) == []


def test_the_library_imports_only_what_sits_below_it(graph):
    order = {name: i for i, name in enumerate(LIBRARY)}
    wrong = sorted(
        f"{a} -> {b}"
        for a, bs in graph.items()
        if package(a) in order
        for b in bs
        if package(b) != package(a)
        and package(b) != "gna_lens"
        and (package(b) not in order or order[package(b)] > order[package(a)])
    )
    assert wrong == []


def test_the_only_module_circle_is_the_family_registry(graph):
    for comp in circles(graph):
        outside = [m for m in comp if not m.startswith(REGISTRY)]
        assert outside == [], f"an import circle: {' -> '.join(comp)}"


def test_the_circle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings() -> list[str]:
    """``from gna_lens.X import _name`` (or ``from gna_lens.X._module import ...``) where X is
    another package than the importer's: a private name a reader of X may change freely."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith("gna_lens") or package(node.module) == package(name):
                continue
            private_module = any(_private(p) for p in node.module.split(".")[2:])
            names = [a.name for a in node.names if _private(a.name)]
            if private_module or names:
                found.append(f"{name}: from {node.module} import {', '.join(names) or '...'}")
    return sorted(found)


def test_no_private_name_crosses_a_package():
    assert private_crossings() == []


def test_the_benchmarks_import_names_that_exist():
    """The benchmarks run rarely (some on a GPU only): a name they import that a refactor moved
    fails here, not on the day the GPU is lent."""
    import importlib

    missing = []
    for path in sorted((ROOT.parent / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gna_lens"):
                module = importlib.import_module(node.module or "")
                missing += [
                    f"{path.name}: from {node.module} import {a.name}"
                    for a in node.names
                    if not hasattr(module, a.name)
                    and not (
                        hasattr(module, "__path__")  # a package: the name may be a submodule
                        and importlib.util.find_spec(f"{node.module}.{a.name}") is not None
                    )
                ]
    assert missing == []

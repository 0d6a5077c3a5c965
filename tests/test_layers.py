"""Ingot's modules form layers without circles: each module imports only from its own layer or
those below it (LAYERS, lowest first), and the import graph has no cycle.

The graph is read with `ast` from the source (nothing is imported): every `import` and `from ...
import` in a module counts, at module level and inside functions alike (a lazy import is still a
dependency). One kind of edge is left out: a package's __init__ importing its own submodules (to
register or re-export them). Python runs a package's __init__ before any of its submodules, so
counting it would make every re-exporting package a circle of its own.
"""
import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ingot"

# Lowest first. A module belongs to the first entry that names it or a package above it.
LAYERS = [
    ["ingot.errors", "ingot.dtypes", "ingot.audio_io", "ingot.progress", "ingot.untrusted", "ingot.files"],
    ["ingot.ir", "ingot.quant.formats", "ingot.quant.fit_kernels"],
    ["ingot.ops"],
    ["ingot.verify", "ingot.passes", "ingot.quant.quantize", "ingot.quant.compensate"],
    ["ingot.options", "ingot.codegen", "ingot.distributed"],   # distributed: process groups, collectives
    ["ingot.backends"],
    ["ingot.package"],
    ["ingot.runtime"],
    ["ingot.compiler"],
    ["ingot.graph"],
    ["ingot.adapters", "ingot.models"],
    ["ingot.quant"],                      # the model-level pipeline (quant.pipeline): below llm
    ["ingot.importers"],
    ["ingot.llm"],
    ["ingot.eval"],
    ["ingot.convert"],
    ["ingot.viewer", "ingot.serve", "ingot.distributed.run"],   # distributed.run: `ingot generate --tensor-parallel`
    ["ingot.cli"],
    ["ingot"],                            # the package's own __init__: the public names
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {imported ingot module: line}} for every module under root."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in files:
                return ".".join(parts[:i])
        return None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself
                targets = [known(f"{source}.{a.name}") if f"{source}.{a.name}" in files else known(source)
                           for a in node.names]
            else:
                continue
            for target in targets:
                if target is None or target == mod:
                    continue
                if path.name == "__init__.py" and target.startswith(mod + "."):
                    continue  # a package assembling itself from its submodules
                edges.setdefault(target, node.lineno)
        graph[mod] = edges
    return graph


def layer_of(mod: str) -> int | None:
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if mod == name or mod.startswith(name + "."):
                if best is None or len(name) > best[1]:
                    best = (i, len(name))
    return None if best is None else best[0]


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"{a} -> {b} (line {graph[a][b]})" for a in component for b in graph[a] if b in component]
    return "; ".join(edges)


def test_the_graph_is_read():
    graph = import_graph()
    assert "ingot.runtime" in graph and "ingot.package" in graph["ingot.runtime"]
    assert "ingot.ops" in graph["ingot.verify"]
    assert "ingot.ops" in graph["ingot.ops.nn"]               # `from . import register` in a submodule
    assert "ingot.ops.nn" not in graph["ingot.ops"]           # the package importing its submodules: left out
    assert "ingot.llm.tokenizer" in graph["ingot.eval"]       # imports inside functions count


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, f"modules in no layer of tests/test_layers.py LAYERS (add each where it belongs): {missing}"


def test_no_module_imports_from_a_layer_above_it():
    graph = import_graph()
    wrong = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}) at line {line}"
             for a, edges in graph.items() for b, line in edges.items()
             if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_named_boundaries_hold():
    """The ones the layers exist for, stated on their own so that reordering LAYERS cannot lose them."""
    graph = import_graph()
    rules = [("ingot.quant", ("ingot.llm", "ingot.eval", "ingot.convert", "ingot.cli")),
             ("ingot.ir", ("ingot.ops", "ingot.passes", "ingot.verify")),
             ("ingot.package", ("ingot.runtime", "ingot.compiler", "ingot.backends")),
             *[(low, ("ingot.runtime", "ingot.backends", "ingot.llm", "ingot.models", "ingot.cli", "ingot.compiler"))
               for low in ("ingot.ir", "ingot.ops", "ingot.passes", "ingot.verify")]]
    inside = lambda mod, name: mod == name or mod.startswith(name + ".")  # noqa: E731
    wrong = [f"{a} imports {b} (line {line})" for low, banned in rules for a, edges in graph.items() if inside(a, low)
             for b, line in edges.items() if any(inside(b, name) for name in banned)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_a_cycle_and_an_upward_import_are_caught(tmp_path):
    pkg = tmp_path / "ingot"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .ir import Node\n")
    (pkg / "ir.py").write_text("def verify():\n    from .ops import infer_type\n")
    (pkg / "ops" / "__init__.py").write_text("from ..ir import Node\nfrom . import nn\n")
    (pkg / "ops" / "nn.py").write_text("from . import register\n")
    graph = import_graph(pkg)
    assert graph["ingot.ir"] == {"ingot.ops": 2}
    assert cycles(graph) == [["ingot.ir", "ingot.ops"]]
    assert layer_of("ingot.ops") > layer_of("ingot.ir")

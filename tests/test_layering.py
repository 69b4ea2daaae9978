"""Data flows one way: the package's modules import each other without a cycle, and no floor imports one above it;
and the serving stack's functions stay short enough to read.

The import graph is read from the sources (`ast`): every ``import`` / ``from ... import`` of a ``jax_sparse_kv``
module, at module level, inside a function (a lazy import still ties two modules) or under
``if TYPE_CHECKING:`` (a type is a dependency too: `jax_sparse_kv.nn.weights` and ``parallel`` take any
``nnx.Module`` rather than name the model above them). Package ``__init__`` modules re-export and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "jax_sparse_kv"

#: floors, lowest first: a module may import its own floor and those below (README: "Data flows one way")
FLOORS = [
    ("layout", "errors", "hf_config"),
    ("platform", "sharding", "storage", "tpu_write", "compilation_cache"),
    ("cache", "checked", "paging", "ops", "multimodal"),
    ("nn", "checkpoint", "planning"),
    ("serving", "demo", "tour", "plan"),
    ("server", "__main__"),
]

#: the longest a function of the serving stack may be without its docstring saying why (with "over 80 lines")
LONG_FUNCTION = 80
SHORT_FUNCTION_PACKAGES = ("server", "serving")


def _modules() -> dict[str, Path]:
    out = {}
    for file in ROOT.rglob("*.py"):
        parts = file.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = file
    return out


def _imports(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]

    class Visitor(ast.NodeVisitor):
        def visit_Import(self, node: ast.Import) -> None:
            found.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)

    Visitor().visit(ast.parse(file.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    packages = {m for m, f in modules.items() if f.name == "__init__.py"}
    return {m: _imports(m, f, modules) - packages for m, f in modules.items() if m not in packages}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _floor(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{module}: no floor in FLOORS (add its top-level name)")


def _long_functions(source: str) -> list[tuple[str, int]]:
    """``(name, lines)`` of each function in `source` longer than `LONG_FUNCTION` lines whose docstring does not say
    why (the words "over 80 lines")."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > LONG_FUNCTION
        and f"over {LONG_FUNCTION} lines" not in (ast.get_docstring(node) or "")
    ]


def test_no_import_cycle():
    graph = _graph()
    assert "jax_sparse_kv.nn.model" in graph and graph["jax_sparse_kv.nn.model"]  # the graph was read
    assert _cycles(graph) == []  # e.g. nn.model -> nn.weights -> nn.parallel -> nn.model (types) was one


def test_no_floor_imports_one_above_it():
    up = sorted((m, d) for m, deps in _graph().items() for d in deps if _floor(d) > _floor(m))
    assert up == []


def test_serving_functions_are_short_or_say_why():
    files = [f for package in SHORT_FUNCTION_PACKAGES for f in sorted((ROOT / package).glob("*.py"))]
    assert len(files) > 10  # the files were found
    long = [(f.name, *found) for f in files for found in _long_functions(f.read_text())]
    assert long == []


def test_the_checks_catch_what_they_look_for():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _floor("jax_sparse_kv.serving.engine") > _floor("jax_sparse_kv.nn.model") > _floor("jax_sparse_kv.cache")
    body = [f"    x{i} = {i}\n" for i in range(LONG_FUNCTION)]
    assert _long_functions("def f():\n" + "".join(body)) == [("f", LONG_FUNCTION + 1)]
    assert _long_functions("def f():\n" + "".join(body[1:])) == []  # 80 lines in all
    assert _long_functions(f'def f():\n    """Why: over {LONG_FUNCTION} lines, a table."""\n' + "".join(body)) == []

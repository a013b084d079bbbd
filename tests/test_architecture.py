"""The package's structure stays as designed: module sizes, no import cycles, the error tree
drawn in ``jsqueue/errors.py`` equal to the real one, and a README layout that names every
module. The import layers themselves are checked by import-linter (``make lint``,
``[tool.importlinter]`` in pyproject.toml)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import grimp

import jsqueue
from jsqueue import errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jsqueue"
MAX_LINES = 700


def _modules() -> list[str]:
    names = ["jsqueue"]
    for info in pkgutil.walk_packages(jsqueue.__path__, "jsqueue."):
        if not info.name.endswith(".__main__"):  # importing it runs the CLI
            names.append(info.name)
    return sorted(names)


def test_no_module_is_over_700_lines() -> None:
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    assert sizes, "no modules found"
    big = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert big == {}, f"modules over {MAX_LINES} lines (split them along what they hold)"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("jsqueue", exclude_type_checking_imports=True)
    assert len(graph.modules) > 10
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The check above could fail: a graph with a cycle is reported."""
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b"]]


def _drawn_tree() -> dict[str, str | None]:
    """Class name -> parent name, from the tree drawn in errors.py's docstring: a name's
    depth is its column (after the tree's own indent) divided by four."""
    doc = (errors.__doc__ or "").split("::", 1)[1]
    tree_lines = doc.strip("\n").split("\n\n", 1)[0].splitlines()
    indent = len(tree_lines[0]) - len(tree_lines[0].lstrip())
    parents: dict[str, str | None] = {}
    path: list[str] = []
    for line in tree_lines:
        m = re.search(r"[A-Z][A-Za-z]+", line)
        assert m is not None
        depth, rest = divmod(m.start() - indent, 4)
        assert rest == 0, f"misaligned tree line: {line!r}"
        path = path[:depth]
        parents[m.group(0)] = path[-1] if path else None
        path.append(m.group(0))
    return parents


def _real_tree() -> dict[str, str | None]:
    """Every JsqueueError subclass defined in the package -> its jsqueue parent."""
    classes: dict[str, type] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, errors.JsqueueError) and obj.__module__.startswith("jsqueue"):
                classes[obj.__name__] = obj
    tree: dict[str, str | None] = {}
    for cls in classes.values():
        bases = [b for b in cls.__bases__ if issubclass(b, errors.JsqueueError)]
        tree[cls.__name__] = bases[0].__name__ if bases else None
    return tree


def test_error_tree_in_errors_py_is_the_real_class_tree() -> None:
    drawn = _drawn_tree()
    assert drawn.get("JsqueueError", "missing") is None
    assert len(drawn) > 10
    assert drawn == _real_tree()


def test_every_error_is_defined_in_errors_py() -> None:
    """One tree, one module: no error class of the tree hides elsewhere."""
    for name in _modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, errors.JsqueueError):
                assert obj.__module__ == "jsqueue.errors", f"{obj.__name__} in {obj.__module__}"


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Layout\n(.*?)(?=^## )", text, re.M | re.S)
    assert m is not None, "README.md has no '## Layout' section"
    return m.group(1)


def test_readme_layout_names_every_package_and_module() -> None:
    """Each module of the package has its one line in the README's layout section, under
    its package's line (``store/`` then ``  jetstream/`` then ``    entries.py``)."""
    layout = _readme_layout()
    listed: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in layout.splitlines():
        m = re.match(r"^(\s*)([a-z_][a-z0-9_]*(?:/|\.py))(\s+\S.*)?$", line)
        if m is None or (m.group(3) is None and not m.group(2).endswith("/")):
            continue  # a module line says what the module holds
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        full = parent + name
        listed.add(full.rstrip("/"))
        if name.endswith("/"):
            stack.append((indent, full))
    expected = set()
    for p in PACKAGE.rglob("*.py"):
        rel = p.relative_to(ROOT)
        if p.name in ("__init__.py", "__main__.py"):
            expected.add(str(rel.parent))
        else:
            expected.add(str(rel))
    missing = sorted(expected - listed)
    assert missing == [], "README layout lacks these (one line each)"
    stale = sorted(x for x in listed if x.startswith("jsqueue") and x not in expected)
    assert stale == [], "README layout names modules that do not exist"

"""The exception tree drawn in jsqueue.errors' docstring is the real class tree."""

from __future__ import annotations

import re

import jsqueue.errors as errors


def _real_tree(cls: type, depth: int = 0) -> list[tuple[int, str]]:
    rows = [(depth, cls.__name__)]
    for sub in cls.__subclasses__():
        if sub.__module__ == errors.__name__:
            rows += _real_tree(sub, depth + 1)
    return rows


def _drawn_tree() -> list[tuple[int, str]]:
    rows = []
    for line in (errors.__doc__ or "").splitlines():
        m = re.match(r"^    ((?:[│ ]   )*(?:[├└]── )?)([A-Z]\w+)", line)
        if m:
            rows.append((len(m.group(1)) // 4, m.group(2)))
    return rows


def _edges(rows: list[tuple[int, str]]) -> set[tuple[str, str]]:
    """(parent, child) pairs of a tree given depth-first as (depth, name) rows."""
    stack: list[str] = []
    edges = set()
    for depth, name in rows:
        del stack[depth:]
        if stack:
            edges.add((stack[-1], name))
        stack.append(name)
    return edges


def test_docstring_tree_equals_class_tree() -> None:
    drawn, real = _drawn_tree(), _real_tree(errors.JsqueueError)
    assert drawn[0] == real[0] == (0, "JsqueueError")
    assert _edges(drawn) == _edges(real)


def test_every_error_class_is_in_the_tree() -> None:
    drawn = {name for _, name in _drawn_tree()}
    classes = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, errors.JsqueueError)
    }
    assert classes == drawn

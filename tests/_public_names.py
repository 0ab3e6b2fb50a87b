"""Find uses of private modules and names in user-facing code (examples, README blocks).

A name is private when it starts with ``_`` and is not a dunder (``__version__``
is public). Users may import only public modules and public names: every
module path component and every imported name must be public.
"""

from __future__ import annotations

import ast

__all__ = ["is_private", "private_uses"]


def is_private(name: str) -> bool:
    """True for ``_x`` and ``__x``, false for dunders such as ``__version__`` and for ``x``."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_path(dotted: str) -> bool:
    return any(is_private(part) for part in dotted.split("."))


def private_uses(source: str) -> list[str]:
    """Every private import or private attribute of an imported module in ``source``.

    Reports ``import a._b``, ``from a._b import x``, ``from a import _x`` and
    ``a._b.x`` where ``a`` was bound by an import, each as ``"line N: text"``,
    in source order.
    Raises :class:`SyntaxError` if ``source`` does not parse.
    """
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    modules: set[str] = set()  # local names bound to imported modules or package members

    def report(node: ast.AST, what: str) -> None:
        found.append((getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_path(alias.name):
                    report(node, f"import {alias.name}")
                modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if _private_path(module):
                report(node, f"from {'.' * node.level}{module} import ...")
            for alias in node.names:
                if is_private(alias.name):
                    report(node, f"from {'.' * node.level}{module} import {alias.name}")
                modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            root: ast.expr = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                report(node, ast.unparse(node))
    return [f"line {line}: {what}" for line, what in sorted(found)]

"""A griffe extension for the API reference: the docstrings' Sphinx roles as links.

The docstrings cross-reference with Sphinx roles (:class:`~stepmachine.Model`,
:func:`run_step`, :meth:`Store.load`), which Markdown would show as they are
written. Each becomes an optional cross-reference: a link when the reference
documents the target, plain code otherwise (never a warning). A name that is
not dotted from ``stepmachine`` is looked up in the public package of the
object that mentions it (``stepmachine.providers._http`` -> ``stepmachine.providers``).
A reST literal-block marker (a paragraph ending in ``::``) becomes ``:``.
"""

from __future__ import annotations

import ast
import html
import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(?P<tilde>~?)(?P<target>[^`]+)`"
)
LITERAL = re.compile(r"::$", re.MULTILINE)
TITLED = re.compile(r"^(?P<title>.+?)\s*<(?P<target>[^>]+)>$")  # :meth:`title <target>`


def public_home(path: str) -> str:
    """The dotted path without its private parts' tail: the package a user imports from."""
    parts = path.split(".")
    for index, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:index])
    return path


def rewrite(text: str, module: str, cls: str | None = None) -> str:
    """``text`` with its roles as optional cross-references.

    ``module`` is the path of the module whose docstring it is, ``cls`` the
    public path of the class it belongs to: a bare name is looked up in the
    class first (``:meth:`run```), then in the module's public package.
    """

    def link(match: re.Match[str]) -> str:
        target = match["target"].strip()
        titled = TITLED.match(target)
        target = (titled["target"] if titled else target).removesuffix("()")
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
        if titled:
            shown = titled["title"]
        candidates = [target]
        if not target.startswith("stepmachine"):
            candidates = [f"{public_home(module)}.{target}"]
            if cls and "." not in target:
                candidates.insert(0, f"{cls}.{target}")
        attrs = f'identifier="{html.escape(candidates[0])}"'
        if len(candidates) > 1:  # autorefs tries the slug when the identifier is unknown
            attrs += f' slug="{html.escape(candidates[1])}"'
        return f"<autoref {attrs} optional><code>{html.escape(shown)}</code></autoref>"

    return LITERAL.sub(":", ROLE.sub(link, text))


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring as it is loaded."""

    def on_instance(
        self, *, node: ast.AST | griffe.ObjectNode, obj: griffe.Object, **kwargs: Any
    ) -> None:
        if obj.docstring is None:
            return
        owner = obj if obj.is_class else obj.parent
        cls = None
        if isinstance(owner, griffe.Object) and owner.is_class:
            cls = f"{public_home(owner.module.path)}.{owner.name}"
        obj.docstring.value = rewrite(obj.docstring.value, obj.module.path, cls)

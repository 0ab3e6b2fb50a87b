"""Give each public class and function the ``__module__`` of its public home.

Each public package calls :func:`publish` once, at the end of its
``__init__`` (``publish(__name__, globals())``): every class and function in
its ``__all__`` that is defined in a private module (a module path with a part
starting with ``_``) gets ``__module__`` set to the package's name, so
``repr(Step)`` shows ``stepmachine.Step``, the documentation and tracebacks
name the import a user writes, and pickle finds the class where users import
it. A name exported by a second public package keeps the home it got first.

Setting ``__module__`` changes where ``typing.get_type_hints`` and msgspec
look up a class's postponed (string) annotations: in the public package's
namespace instead of the defining module's. So, before moving a class,
:func:`publish` evaluates its own string annotations in the module that
defined it and stores the values; an annotation that does not evaluate there
(a name imported only for type checkers) becomes a ``ForwardRef`` bound to that
module, as unresolvable as it was, and in the same place.
"""

from __future__ import annotations

import inspect
import sys
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["is_private_module", "publish"]


def is_private_module(name: str) -> bool:
    """True when a part of the dotted module path starts with ``_`` (``stepmachine._codec``)."""
    return any(part.startswith("_") for part in name.split("."))


def _resolve_annotations(cls: type) -> None:
    annotations = vars(cls).get("__annotations__")  # the class's own dict, changed in place
    if not isinstance(annotations, dict):
        return
    module = sys.modules.get(cls.__module__)
    if module is None:
        return
    namespace = dict(vars(module))
    local = dict(vars(cls))
    local.setdefault(cls.__name__, cls)
    failed: list[str] = []
    for name, value in list(annotations.items()):
        if not isinstance(value, str):
            continue
        try:
            annotations[name] = eval(value, namespace, local)  # noqa: S307 - the package's own annotation text
        except Exception:  # noqa: BLE001 - a string alias inside (typing resolves those), or a
            failed.append(name)  # name only type checkers see
    if failed:
        try:
            hints = typing.get_type_hints(cls, include_extras=True)
        except Exception:  # noqa: BLE001 - a name only type checkers see: resolve it later,
            hints = {}  # in the module that defined the class, as before
        for name in failed:
            annotations[name] = hints.get(name) or typing.ForwardRef(
                annotations[name], module=cls.__module__, is_class=True
            )


def publish(package: str, namespace: Mapping[str, Any]) -> None:
    """Set ``__module__ = package`` on the classes and functions of ``namespace["__all__"]``
    that are defined in a private module of stepmachine."""
    for name in namespace["__all__"]:
        value = namespace.get(name)  # a name loaded on first use (an optional extra) is not here
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        home = getattr(value, "__module__", None)
        if not isinstance(home, str) or home.split(".")[0] != "stepmachine":
            continue
        if not is_private_module(home):
            continue
        if inspect.isclass(value):
            _resolve_annotations(value)
        value.__module__ = package

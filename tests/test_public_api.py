"""The public surface: sorted, complete __all__ lists; one error root; py.typed shipped."""

from __future__ import annotations

import importlib
import importlib.resources
import inspect
import re
import types
import typing
from collections.abc import Iterator

import pytest
from _public_names import is_private

import stepmachine
from stepmachine import StepmachineError

PUBLIC_PACKAGES = [
    "stepmachine",
    "stepmachine.extend",
    "stepmachine.operations",
    "stepmachine.providers",
    "stepmachine.stores",
    "stepmachine.testing",
]
# Public modules: the packages, and modules users import by name that define
# their own names (their other attributes are imports, not exports).
PUBLIC_MODULES = [
    *PUBLIC_PACKAGES,
    "stepmachine.testing.conformance",
    "stepmachine.durable",
    "stepmachine.inspector",
]


def ruf022_key(name: str) -> tuple[int, list[str | int]]:
    """The order ruff's RUF022 (isort-style) gives ``__all__``.

    SCREAMING_CASE first (more than one character, every cased character upper
    case), then CamelCase (first character upper case), then everything else;
    within each group a natural, case-sensitive sort (digit runs compare as
    numbers).
    """
    if len(name) > 1 and name.upper() == name and name.lower() != name:
        group = 0
    elif name[:1].isupper():
        group = 1
    else:
        group = 2
    natural: list[str | int] = [
        int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)
    ]
    return group, natural


def test_ruf022_key_matches_ruff_on_a_known_list() -> None:
    """The expected order was produced by ``ruff check --select RUF022 --fix`` (ruff 0.17)."""
    ruff_sorted = [
        "AB_C",
        "HTTP2",
        "X1",
        "ZZ",
        "A",
        "A_b",
        "Ab",
        "B",
        "Http2",
        "Http10",
        "Z",
        "_x",
        "a2",
        "a10",
        "aB",
        "a_b",
        "ab",
        "b",
    ]
    shuffled = sorted(ruff_sorted, key=lambda n: n[::-1])
    assert sorted(shuffled, key=ruf022_key) == ruff_sorted


@pytest.mark.parametrize("package", PUBLIC_MODULES)
def test_all_is_sorted_like_ruf022(package: str) -> None:
    names = list(importlib.import_module(package).__all__)
    assert names == sorted(names, key=ruf022_key)


@pytest.mark.parametrize("package", PUBLIC_MODULES)
def test_all_has_no_duplicates_and_every_name_exists(package: str) -> None:
    module = importlib.import_module(package)
    names = list(module.__all__)
    assert len(names) == len(set(names))
    missing = [n for n in names if not hasattr(module, n)]
    assert missing == []


@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_attribute_is_in_all(package: str) -> None:
    module = importlib.import_module(package)
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert sorted(public - set(module.__all__)) == []


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from stepmachine import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(stepmachine.__all__)


def test_every_error_class_derives_from_stepmachine_error() -> None:
    errors = [
        value
        for module in (
            stepmachine,
            importlib.import_module("stepmachine.testing"),
            importlib.import_module("stepmachine.stores"),
        )
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, BaseException)
    ]
    assert StepmachineError in errors
    assert len(errors) > 5
    offenders = [e.__qualname__ for e in errors if not issubclass(e, StepmachineError)]
    assert offenders == []


def test_errors_named_like_errors_are_exported() -> None:
    exported = {n for n in stepmachine.__all__ if n.endswith("Error")}
    from stepmachine import _errors

    assert set(_errors.__all__) <= exported


def test_version_is_a_string() -> None:
    assert isinstance(stepmachine.__version__, str)
    assert stepmachine.__version__


def test_py_typed_is_shipped() -> None:
    marker = importlib.resources.files("stepmachine").joinpath("py.typed")
    assert marker.is_file()


def test_kernel_does_not_import_operations_or_stores() -> None:
    """The kernel never imports ``operations`` or ``stores`` (DESIGN §4)."""
    import pathlib

    kernel = pathlib.Path(stepmachine.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+(stepmachine\.)?(operations|stores)\b", re.M)
    sources = sorted(kernel.rglob("*.py"))
    assert len(sources) > 10
    offenders = [p.name for p in sources if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def public_objects() -> Iterator[tuple[str, object]]:
    """Every public package, every name in its ``__all__``, and their public methods."""
    for package in PUBLIC_MODULES:
        module = importlib.import_module(package)
        yield package, module
        for name in module.__all__:
            value = getattr(module, name)
            yield f"{package}.{name}", value
            if not inspect.isclass(value):
                continue
            for attr, member in vars(value).items():
                if is_private(attr):
                    continue
                function = member
                if isinstance(member, (staticmethod, classmethod)):
                    function = member.__func__
                elif isinstance(member, property):
                    function = member.fget
                if inspect.isfunction(function):
                    yield f"{package}.{name}.{attr}", function


# A dotted path inside the package, or the target of a Sphinx role (:class:`x`).
DOTTED = re.compile(r"(?<![\w.])((?:stepmachine|operations|stores|providers|testing)(?:\.\w+)+)")
ROLE = re.compile(r":[a-z]+:`~?([^`<]+?)`")


def test_public_docstrings_point_only_at_public_names() -> None:
    offenders: list[str] = []
    checked = 0
    for where, value in public_objects():
        doc = inspect.getdoc(value) or ""
        checked += bool(doc)
        offenders.extend(
            f"{where}: {target}"
            for target in [*DOTTED.findall(doc), *ROLE.findall(doc)]
            if target.startswith(".") or any(is_private(p) for p in target.split("."))
        )
    assert checked > 200
    assert offenders == []


def _types_in(annotation: object, found: set[type]) -> None:
    if isinstance(annotation, type):
        found.add(annotation)
    origin = typing.get_origin(annotation)
    if isinstance(origin, type):
        found.add(origin)
    for argument in typing.get_args(annotation):
        _types_in(argument, found)


def test_every_type_in_a_public_signature_is_exported() -> None:
    """What a user needs to call, subclass or annotate is importable from a public package."""
    exported = {
        id(getattr(importlib.import_module(p), n))
        for p in PUBLIC_MODULES
        for n in importlib.import_module(p).__all__
    }
    missing: set[str] = set()
    checked = 0
    for where, value in public_objects():
        if not (inspect.isfunction(value) or inspect.isclass(value)):
            continue
        try:
            hints = typing.get_type_hints(value)
        except TypeError:  # a class whose __init__ has no annotations to resolve
            continue
        checked += 1
        found: set[type] = set()
        for hint in hints.values():
            _types_in(hint, found)
        missing |= {
            f"{t.__module__}.{t.__qualname__} (in {where})"
            for t in found
            if t.__module__.split(".")[0] == "stepmachine" and id(t) not in exported
        }
    assert checked > 200
    assert sorted(missing) == []


# -- the surface a newcomer can hold --------------------------------------------------------

# Names exported by two public packages on purpose, with the reason. None today.
DELIBERATE_REEXPORTS: dict[str, str] = {}


def test_the_top_level_has_at_most_90_names() -> None:
    assert len(stepmachine.__all__) <= 90
    assert dir(stepmachine) == list(stepmachine.__all__)


def test_every_public_class_and_function_names_its_public_home() -> None:
    wrong = [
        f"{package}.{name}: {value.__module__}"
        for package in PUBLIC_MODULES
        for name in importlib.import_module(package).__all__
        if (
            inspect.isclass(value := getattr(importlib.import_module(package), name))
            or inspect.isfunction(value)
        )
        and value.__module__.split(".")[0] == "stepmachine"
        and value.__module__ != package
        and f"{package}.{name}" not in DELIBERATE_REEXPORTS
    ]
    assert wrong == []


def test_no_name_is_exported_by_two_public_packages() -> None:
    homes: dict[str, list[str]] = {}
    for package in PUBLIC_MODULES:
        for name in importlib.import_module(package).__all__:
            homes.setdefault(name, []).append(package)
    twice = {n: p for n, p in homes.items() if len(p) > 1 and n not in DELIBERATE_REEXPORTS}
    assert twice == {}


def _moved() -> list[tuple[str, str, str]]:
    extend = importlib.import_module("stepmachine.extend")
    return [
        *((name, "stepmachine.extend", name) for name in extend.__all__),
        ("FEEDBACK", "stepmachine.operations", "FEEDBACK"),
        ("estimate_tokens", "stepmachine.operations", "estimate_tokens"),
        ("serve", "stepmachine", "run_worker"),
    ]


@pytest.mark.parametrize(("old", "module", "new"), _moved())
def test_a_moved_name_warns_with_its_new_import_and_is_the_same_object(
    old: str, module: str, new: str
) -> None:
    with pytest.warns(DeprecationWarning, match=re.escape(f"from {module} import {new}")) as seen:
        value = getattr(stepmachine, old)
    assert value is getattr(importlib.import_module(module), new)
    assert seen[0].filename == __file__  # the warning points at the line that used the old name
    assert old not in stepmachine.__all__


def test_a_moved_name_still_imports_with_from() -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match="stepmachine.extend"):
        exec("from stepmachine import apply_batch", namespace)
    assert namespace["apply_batch"] is importlib.import_module("stepmachine.extend").apply_batch


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = stepmachine.no_such_name  # type: ignore[attr-defined]

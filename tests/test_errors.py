"""The error tree: one root never raised itself, definition errors apart from run errors.

The tree drawn in ``stepmachine._errors``'s docstring is checked against the
classes, every public error class of every public package is walked, and the
package source is parsed to prove that no ``raise`` names the root (or one of
the two family classes) directly.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys
from typing import Any

import pytest

from stepmachine import (
    CancelToken,
    ConfigurationError,
    Continue,
    DefinitionError,
    InvalidFieldError,
    Message,
    Operation,
    Outcome,
    RunError,
    Runtime,
    StateMachine,
    StepContext,
    StepContractError,
    StepmachineError,
    StoreClosedError,
)
from stepmachine import _errors as errors_module
from stepmachine.stores import MemoryStore, SQLiteStore

PUBLIC_PACKAGES = (
    "stepmachine",
    "stepmachine.operations",
    "stepmachine.stores",
    "stepmachine.providers",
    "stepmachine.testing",
)
ABSTRACT = (StepmachineError, DefinitionError, RunError)


def public_error_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[f"{package}.{name}"] = value
    return found


def test_every_public_error_is_under_the_root_in_exactly_one_family() -> None:
    classes = public_error_classes()
    assert len(classes) > 25
    outside = [name for name, cls in classes.items() if not issubclass(cls, StepmachineError)]
    assert outside == []
    leaves = {name: cls for name, cls in classes.items() if cls not in ABSTRACT}
    both_or_neither = [
        name
        for name, cls in leaves.items()
        if issubclass(cls, DefinitionError) == issubclass(cls, RunError)
    ]
    assert both_or_neither == []


def test_definition_errors_are_type_errors_and_run_errors_are_not() -> None:
    for cls in (ConfigurationError, InvalidFieldError, StepContractError):
        assert issubclass(cls, DefinitionError)
        assert issubclass(cls, TypeError)
    assert issubclass(InvalidFieldError, ValueError)  # unchanged: it was both
    run_errors = [c for c in public_error_classes().values() if issubclass(c, RunError)]
    assert len(run_errors) > 15
    assert [c.__qualname__ for c in run_errors if issubclass(c, TypeError)] == []


def _drawn_class(package: str, name: str) -> object:
    """The class a tree entry names: ``X`` in the kernel, ``pkg.X`` in ``stepmachine.pkg``.

    A class its package does not export (``stores.FileLockTimeoutError``) is
    found in the package's private modules.
    """
    if not package:
        return getattr(errors_module, name, None)
    module = importlib.import_module(f"stepmachine.{package}")
    if hasattr(module, name):
        return getattr(module, name)
    prefix = f"{module.__name__}._"
    found = [
        getattr(m, name)
        for n, m in sorted(sys.modules.items())
        if n.startswith(prefix) and hasattr(m, name)
    ]
    return found[0] if found else None


def test_the_drawn_tree_matches_the_classes() -> None:
    """Each name drawn in the module docstring derives from the name drawn above it."""
    doc = errors_module.__doc__
    assert doc is not None
    tree = doc[doc.index("StepmachineError  ") :]
    stack: list[tuple[int, type[BaseException]]] = []
    checked = 0
    for line in tree.splitlines():
        if not line.strip():
            break
        text = line.lstrip(" │├└─")
        column = len(line) - len(text)
        word = text.split()[0].rstrip(",")
        package, _, name = word.rpartition(".")
        cls = _drawn_class(package, name)
        assert isinstance(cls, type), f"the tree names {word!r}, which is no class"
        while stack and stack[-1][0] >= column:
            stack.pop()
        if stack:
            assert issubclass(cls, stack[-1][1]), f"{name} is drawn under {stack[-1][1].__name__}"
        stack.append((column, cls))
        checked += 1
    assert checked >= 20
    drawn = set(tree.replace(",", " ").replace(".", " ").split())
    assert set(errors_module.__all__) <= drawn


def _package_sources() -> list[pathlib.Path]:
    roots = {
        pathlib.Path(importlib.import_module(package).__file__ or "").resolve().parent
        for package in PUBLIC_PACKAGES
    }
    return sorted({path.resolve() for root in roots for path in root.rglob("*.py")})


def raised_names(source: str) -> list[str]:
    """The class names raised by ``raise X`` / ``raise X(...)`` / ``raise m.X(...)`` in source."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                names.append(target.id)
            elif isinstance(target, ast.Attribute):
                names.append(target.attr)
    return names


def test_raised_names_sees_every_form() -> None:
    source = (
        "raise StepmachineError('x')\nraise errors.RunError\ntry:\n    pass\nexcept E:\n    raise\n"
    )
    assert raised_names(source) == ["StepmachineError", "RunError"]


def test_the_root_and_the_families_are_never_raised_in_the_package() -> None:
    sources = _package_sources()
    assert len(sources) > 40
    forbidden = {cls.__name__ for cls in ABSTRACT}
    offenders = [
        f"{path.name}: raise {name}"
        for path in sources
        for name in raised_names(path.read_text(encoding="utf-8"))
        if name in forbidden
    ]
    assert offenders == []


class NotAnOutcome(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return "done"  # type: ignore[return-value]


class EmptyContinue(Operation[Any]):
    async def run(self, ctx: StepContext[Any]) -> Outcome:
        return Continue([])


@pytest.mark.parametrize("step", [NotAnOutcome(), EmptyContinue()], ids=type)
async def test_a_step_breaking_its_contract_raises_step_contract_error(
    step: Operation[Any],
) -> None:
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    with pytest.raises(StepContractError, match=repr(step.name)) as raised:
        await StateMachine([step]).run(Runtime(store=store), "s")
    assert type(raised.value) is StepContractError
    assert isinstance(raised.value, TypeError)
    assert await store.batches("s") == []


class ForgetsReturn(Operation[Any]):
    """A step whose ``run`` lacks its ``return`` (it returns ``None``)."""

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        ctx.session.revision  # noqa: B018 - does its work, then forgets to return
        return None  # type: ignore[return-value]


@pytest.mark.parametrize("token", [False, True], ids=["no token", "with a cancel token"])
@pytest.mark.parametrize("step", [ForgetsReturn(), NotAnOutcome()], ids=type)
async def test_a_step_returning_none_or_a_non_outcome_is_a_contract_error_naming_it(
    step: Operation[Any], token: bool
) -> None:
    """Not a silent ``cancelled``: the error names the step, the value and the fix."""
    store = MemoryStore()
    await store.create("s", conversation=[Message.user("hi", id="u1")])
    machine = StateMachine([step], cancel=CancelToken() if token else None)
    with pytest.raises(StepContractError) as raised:
        await machine.run_report(Runtime(store=store), "s")
    message = str(raised.value)
    assert repr(step.name) in message
    assert "Refuse" in message
    assert "Continue" in message
    assert "Yield" in message
    if isinstance(step, ForgetsReturn):
        assert "None" in message
        assert "return" in message
    assert await store.batches("s") == []


async def test_the_step_harness_names_a_step_returning_none() -> None:
    from stepmachine.testing import make_session, run_step

    with pytest.raises(StepContractError, match="'ForgetsReturn' returned None"):
        await run_step(ForgetsReturn(), make_session(Message.user("hi", id="u1")))


async def test_a_closed_store_raises_a_run_error_naming_the_store(tmp_path: pathlib.Path) -> None:
    store = await SQLiteStore.open(tmp_path / "s.db")
    await store.aclose()
    with pytest.raises(StoreClosedError, match=r"s\.db") as raised:
        await store.load("s")
    assert isinstance(raised.value, RunError)

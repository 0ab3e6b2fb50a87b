"""The Runtime: the application's IO dependencies, handed to every step.

Steps never reach for globals: the store, the models, the HTTP client, the
clock and the id source all come from the :class:`Runtime` given to
``StateMachine.run``, so a test swaps any of them freely.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import httpx

from ._errors import ConfigurationError
from ._model import Model
from ._store import EffectHandler, SessionLoader, Store
from ._telemetry import Telemetry

if TYPE_CHECKING:
    from ._messages import Message, ToolCallPart, ToolResultPart
    from ._tools import ToolContext

ToolCaller: TypeAlias = "Callable[[ToolCallPart, ToolContext], Awaitable[ToolResultPart | Message]]"
"""How the ``Tools`` step answers a call instead of running its tool (``Runtime.tool_caller``):
the result, or a ``tool`` message holding it and the images and documents it carries."""

__all__ = ["Runtime", "ToolCaller", "counter_ids", "uuid_ids", "with_handler"]


def uuid_ids() -> str:
    """A random id (32 hex digits): a version-4 UUID's hex. The default id source.

    The same value ``uuid.uuid4().hex`` gives (16 bytes from ``os.urandom``,
    the version and variant bits set), without building a ``UUID`` object.
    """
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # RFC 4122 variant
    return raw.hex()


def counter_ids(prefix: str = "m") -> Callable[[], str]:
    """A deterministic id source: ``m1``, ``m2``, ... (for tests and examples)."""
    count = 0

    def next_id() -> str:
        nonlocal count
        count += 1
        return f"{prefix}{count}"

    return next_id


@dataclass(frozen=True)
class Runtime:
    """IO dependencies for one run.

    Attributes:
        store: a store used as both loader and effect handler.
        loader: overrides ``store`` for loading.
        handler: overrides ``store`` for persisting effects.
        model: the default model for ``ModelInference``.
        models: named models, for steps that pick one by name.
        http: a shared ``httpx.AsyncClient`` for tools and providers.
        clock: seconds since the epoch; stamps every applied batch.
        ids: returns a new unique message id on each call.
        services: anything else the application's steps and tools need.
        telemetry: what the run tells logs and traces (:class:`Telemetry`:
            content capture off, the global OpenTelemetry tracer provider).
        model_override: ``None`` (the default), or the model that answers
            every model call a step makes through ``ctx.request_model``
            (inference, a compaction's summary, a step's own judge model),
            whatever model the step names: :func:`~stepmachine.replay` uses it
            so that no step reaches a real model.
        tool_caller: ``None`` (the default): the ``Tools`` step runs each
            call's tool. Otherwise it awaits ``tool_caller(call, context)``
            for the call's result instead (a ``ToolResultPart``, or a
            ``tool`` message holding it and the media it carries; that
            message's id is not used), and runs nothing (the journal,
            approvals and budgets still apply): :func:`~stepmachine.replay`
            answers calls from the stored history this way.
    """

    store: Store | None = None
    loader: SessionLoader | None = None
    handler: EffectHandler | None = None
    model: Model | None = None
    models: Mapping[str, Model] = field(default_factory=dict)
    http: httpx.AsyncClient | None = None
    clock: Callable[[], float] = time.time
    ids: Callable[[], str] = uuid_ids
    services: Mapping[str, Any] = field(default_factory=dict)
    telemetry: Telemetry = field(default_factory=Telemetry)
    tool_caller: ToolCaller | None = None
    model_override: Model | None = None

    def session_loader(self) -> SessionLoader:
        """The loader to use. Raises :class:`ConfigurationError` if there is none."""
        loader = self.loader if self.loader is not None else self.store
        if loader is None:
            raise ConfigurationError("the Runtime has no store or loader")
        return loader

    def effect_handler(self) -> EffectHandler:
        """The handler to use. Raises :class:`ConfigurationError` if there is none."""
        handler = self.handler if self.handler is not None else self.store
        if handler is None:
            raise ConfigurationError("the Runtime has no store or effect handler")
        return handler

    def get_model(self, name: str | None = None) -> Model:
        """The model called ``name``, or the default model when ``name`` is None.

        Raises:
            ConfigurationError: no such model is configured.
        """
        if name is None:
            if self.model is None:
                raise ConfigurationError("the Runtime has no model; pass Runtime(model=...)")
            return self.model
        try:
            return self.models[name]
        except KeyError:
            raise ConfigurationError(
                f"the Runtime has no model named {name!r}; it has {sorted(self.models)!r}"
            ) from None


def with_handler(runtime: Runtime, handler: EffectHandler) -> Runtime:
    """``dataclasses.replace(runtime, handler=handler)``, without its per-field work for a
    plain :class:`Runtime` (a subclass goes through ``replace``, its ``__post_init__`` too)."""
    if type(runtime) is not Runtime:
        return dataclasses.replace(runtime, handler=handler)
    fenced = object.__new__(Runtime)
    fenced.__dict__.update(runtime.__dict__)
    object.__setattr__(fenced, "handler", handler)
    return fenced

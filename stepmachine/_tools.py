"""Tools from typed Python functions: schema, validation, fingerprints.

:func:`tool` turns a typed function (sync or async) into a :class:`Tool`. Its
JSON schema is derived from the signature through a msgspec Struct built from
the parameters, and the model's arguments are validated by msgspec against
that Struct before the function is called. Describe a parameter with
``Annotated[str, msgspec.Meta(description="...")]``; the docstring's first
paragraph describes the tool. A parameter annotated :class:`ToolContext` is
not part of the schema: it receives the runtime, the call id and a stable
idempotency key. The :class:`stepmachine.Tools` step runs them.

A tool's result is text: a ``str`` as it is, anything else as JSON. A tool
whose result carries an image or a document (a screenshot, a chart, a PDF)
returns an :class:`~stepmachine.ImagePart` or a
:class:`~stepmachine.DocumentPart`, or a :class:`ToolOutput` with text and
such parts; the ``Tools`` step stores them after the result in its ``tool``
message (:meth:`~stepmachine.Message.tool_result` with ``media=``).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, overload

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec

from ._async import asyncio_here
from ._checks import check_str, tuple_of
from ._errors import ConfigurationError, ToolArgumentsError, ToolError
from ._media import AudioPart, DocumentPart, ImagePart
from ._messages import ToolCallPart
from ._model import ToolDefinition
from ._runtime import Runtime

__all__ = [
    "EDITED_ARGUMENTS",
    "SideEffects",
    "Tool",
    "ToolContext",
    "ToolLike",
    "ToolOutput",
    "effective_arguments",
    "fingerprint",
    "idempotency_key",
    "tool",
]


def idempotency_key(session_id: str, call_id: str, message_id: str = "") -> str:
    """The stable idempotency key of one tool call.

    A hash of the session id, the id of the message holding the call and the
    call id: stable across retries and processes, and different for a later
    call that reuses an earlier call id (models do, after a compaction).
    """
    digest = hashlib.sha256(f"{session_id}\x00{message_id}\x00{call_id}".encode()).hexdigest()
    return f"sm-{digest[:32]}"


SideEffects: TypeAlias = Literal["pure", "idempotent", "non_idempotent"]

EDITED_ARGUMENTS = "stepmachine.edited_arguments"
"""Notes namespace on a tool call holding ``{"arguments": ...}`` to run it with instead."""

_canonical = msgspec.json.Encoder(order="sorted")


def effective_arguments(call: ToolCallPart) -> Any:
    """The arguments ``call`` runs with.

    An edit recorded on the call (an ``Annotate`` with namespace
    :data:`EDITED_ARGUMENTS` and key ``"arguments"``, e.g. by an approval that
    edited them) wins over what the model sent; the original stays in history.
    """
    edit = call.notes.get(EDITED_ARGUMENTS)
    if edit is not None and "arguments" in edit:
        return edit["arguments"]
    return call.arguments


def fingerprint(name: str, arguments: Any) -> str:
    """A stable fingerprint of a call: tool name plus a hash of canonical JSON arguments.

    Keys are sorted, so ``{"a": 1, "b": 2}`` and ``{"b": 2, "a": 1}`` agree.
    """
    digest = hashlib.sha256(name.encode() + b"\x00" + _canonical.encode(arguments)).hexdigest()
    return f"{name}:{digest[:32]}"


@dataclass(frozen=True, slots=True)
class ToolContext:
    """Injected into a tool parameter annotated ``ToolContext``.

    Attributes:
        runtime: the run's IO dependencies (HTTP client, services, ...).
        session_id: the session the call belongs to.
        call_id: the model's id for this call.
        idempotency_key: stable for this session and call, across retries and
            processes; pass it to external APIs that deduplicate requests.
    """

    runtime: Runtime
    session_id: str
    call_id: str
    idempotency_key: str


def media_line(part: ImagePart | DocumentPart) -> str:
    """A short line naming a media part that follows a result:
    ``[image follows: image/png, 1,234 bytes]``."""
    kind = "image" if isinstance(part, ImagePart) else "document"
    if part.data is not None:
        where = f"{part.media_type}, {len(part.data):,} bytes"
    else:
        where = f"{part.url}" + (f", {part.media_type}" if part.media_type else "")
    title = getattr(part, "title", None)
    if title:
        where = f"{title!r}, {where}"
    return f"[{kind} follows: {where}]"


@dataclass(frozen=True, slots=True)
class ToolOutput:
    """A tool result that carries images or documents along with its text.

    Return one from a tool (or ``ToolLike.call``): ``text`` is what the
    result says (:attr:`content`), ``media`` the parts stored after it in its
    ``tool`` message, in order. A tool returning just an ``ImagePart`` or a
    ``DocumentPart`` returns ``ToolOutput(media=(part,))``.

    Attributes:
        text: the result's text; may be empty.
        media: the images and documents it carries (a list becomes a tuple).

    Raises:
        InvalidFieldError: ``text`` is not a str, or an item of ``media`` is
            not an ``ImagePart`` or ``DocumentPart``.
    """

    text: str = ""
    media: Sequence[ImagePart | DocumentPart] = ()  # always a tuple once built

    def __post_init__(self) -> None:
        check_str("ToolOutput", "text", self.text)
        expected = "ImagePart or DocumentPart"
        items = tuple_of("ToolOutput", "media", self.media, (ImagePart, DocumentPart), expected)
        object.__setattr__(self, "media", items)

    @property
    def content(self) -> str:
        """The result's content: ``text``, or, when it is empty, one line per media part
        saying it follows (:func:`media_line`), so no provider sees an empty result."""
        if self.text or not self.media:
            return self.text
        return "\n".join(map(media_line, self.media))


def tool_output(result: object) -> str | ToolOutput:
    """What a tool function's return value is as a result (see the module docstring).

    A ``str`` or a :class:`ToolOutput` as it is; an ``ImagePart`` or
    ``DocumentPart`` (or a list of them) as a ``ToolOutput`` carrying it;
    anything else as JSON.

    Raises:
        ToolError: it holds media otherwise (audio, an image inside a dict):
            an error result saying so, never the bytes as base64 text.
        TypeError: the value does not encode as JSON (msgspec's error).
    """
    if isinstance(result, str | ToolOutput):
        return result
    if isinstance(result, ImagePart | DocumentPart):
        return ToolOutput(media=(result,))
    if (
        isinstance(result, list | tuple)
        and result
        and all(isinstance(item, ImagePart | DocumentPart) for item in result)
    ):
        return ToolOutput(media=tuple(result))
    if _holds_media(result):
        raise ToolError(
            "the tool returned media a result cannot carry (audio, or images inside other "
            "values); a tool returns an ImagePart, a DocumentPart, a list of them, or "
            "ToolOutput(text, media)"
        )
    return msgspec.json.encode(result).decode()


def _holds_media(value: object, depth: int = 0) -> bool:
    """Whether ``value`` holds a media part anywhere (lists, tuples, dicts; bounded depth)."""
    if isinstance(value, ImagePart | DocumentPart | AudioPart):
        return True
    if depth > 32:
        return False
    if isinstance(value, dict):
        return any(_holds_media(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_media(v, depth + 1) for v in value)
    return False


def check_timeout(owner: str, timeout: object) -> float | None:
    """``timeout`` if it is ``None`` or a number of seconds > 0 (``inf`` included).

    Raises:
        ConfigurationError: anything else (0, a negative number, NaN, a bool, a
            string): such a timeout would answer every call "timed out" or
            "failed" without running it.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigurationError(
            f"{owner}: timeout must be None or a number of seconds > 0, got {timeout!r}"
        )
    return timeout


class ToolLike(Protocol):
    """What the :class:`~stepmachine.Tools` step runs: :class:`Tool` is one.

    Anything with these attributes and ``call`` can be run by a step built on
    ``Tools`` (``McpTools`` runs the tools of MCP servers this way): the
    journal reads ``side_effects``, the step bounds ``call`` by ``timeout``,
    and the model is shown ``definition``. ``call`` returns ``str`` (as
    before) or a :class:`ToolOutput` (text with images and documents): an
    implementation that returns ``str`` keeps working unchanged.
    """

    @property
    def name(self) -> str:
        """The name the model calls it by."""
        ...

    @property
    def definition(self) -> ToolDefinition:
        """What models are shown: name, description, JSON schema of the arguments."""
        ...

    @property
    def side_effects(self) -> SideEffects:
        """What may happen if it runs twice (see :class:`Tool`)."""
        ...

    @property
    def timeout(self) -> float | None:
        """Seconds a call may take, or ``None`` (then the step's timeout applies)."""
        ...

    async def call(self, arguments: Any, context: ToolContext) -> str | ToolOutput:
        """Run the call; its result as text, or a :class:`ToolOutput` when it
        carries images or documents.

        Raises:
            ToolArgumentsError: the arguments are not acceptable.
            ToolError: the result is an error result with exactly this text.
            ToolAbortError: fail closed (see ``Tools``).
            Exception: anything else; an error result naming it.
        """
        ...


class Tool:
    """A callable the model may ask for, with a schema and validated arguments.

    Build one with :func:`tool`. Attributes: ``name``, ``description``,
    ``parameters`` (JSON schema), ``definition`` (what models are shown),
    ``side_effects`` and ``timeout`` (seconds, or ``None``).

    ``side_effects`` says what may happen if the tool runs twice, which
    decides what the journal does after a crash left a call with an intent
    and no result: ``"pure"`` (no effects) and ``"idempotent"`` (running again
    with the same idempotency key is harmless) are re-run;
    ``"non_idempotent"`` (the default, the safe assumption) is never re-run
    blindly.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        thread: bool = True,
        side_effects: SideEffects = "non_idempotent",
        timeout: float | None = None,
    ) -> None:
        if side_effects not in ("pure", "idempotent", "non_idempotent"):
            raise ConfigurationError(
                f"side_effects must be 'pure', 'idempotent' or 'non_idempotent', "
                f"got {side_effects!r}"
            )
        self.fn = fn
        self.side_effects: SideEffects = side_effects
        self.timeout = check_timeout(f"Tool {name or getattr(fn, '__name__', '')!r}", timeout)
        self.name: str = name or str(getattr(fn, "__name__", ""))
        doc = inspect.getdoc(fn) or ""
        self.description: str = description or doc.split("\n\n", 1)[0].strip()
        self.is_async = inspect.iscoroutinefunction(fn)
        self.thread = thread
        self._context_param, self.arguments_type = _arguments_struct(fn, self.name)
        self.parameters: dict[str, Any] = _schema(self.arguments_type)
        self.definition = ToolDefinition(
            name=self.name, description=self.description, parameters=self.parameters
        )

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r})"

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The keyword arguments for the function, validated.

        Raises:
            ToolArgumentsError: ``arguments`` is not an object matching the schema.
        """
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(
                f"arguments for tool {self.name!r} must be a JSON object, got "
                f"{type(arguments).__name__}"
            )
        try:
            value = msgspec.convert(arguments, self.arguments_type)
        except msgspec.ValidationError as exc:
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: {exc}") from exc
        return msgspec.structs.asdict(value)  # every field by its Python name

    async def call(self, arguments: Any, context: ToolContext) -> str | ToolOutput:
        """Validate ``arguments``, run the function, and return its result.

        A ``str`` or a :class:`ToolOutput` is returned as is; an
        ``ImagePart`` or ``DocumentPart`` as a ``ToolOutput`` carrying it;
        anything else is JSON-encoded. Sync functions run in a worker thread
        unless built with ``thread=False``.

        Raises:
            ToolArgumentsError: the arguments do not validate.
            Exception: whatever the function raises.

        Cancellation (a run cancelled, or the tool's ``timeout``): an async
        tool is cancelled at its next await. A sync tool in a worker thread
        cannot be stopped (Python cannot kill a thread): the call stops
        waiting for it and the thread runs on to its end, what it returns
        dropped. The ``Tools`` step answers such a call "timed out" (after its
        timeout) or, after a run's cancellation, gives the thread up to
        a second (``THREAD_GRACE``) to end (then it keeps the real result)
        before the call is answered "interrupted". Either way the call is
        answered once and never run again (at most once), but a non-idempotent
        sync tool's side effect may still happen after that answer: give such a
        tool a timeout of its own (an HTTP client's, a socket's) or make it
        ``async``.
        """
        kwargs = self.validate(arguments)
        if self._context_param is not None:
            kwargs[self._context_param] = context
        if self.is_async:
            result = await self.fn(**kwargs)
        elif self.thread:
            late = _LateThread(functools.partial(self.fn, **kwargs))
            try:
                result = await anyio.to_thread.run_sync(
                    late.run, abandon_on_cancel=True, limiter=_thread_tokens()
                )
            except anyio.get_cancelled_exc_class():
                abandoned = ABANDONED.get()
                if abandoned is not None:
                    abandoned.append(late)  # for the Tools step running this call
                raise
        else:
            result = self.fn(**kwargs)
        return tool_output(result)


class _Done:
    """Set once, when a worker thread ends: what a ``threading.Event`` does here, on one
    lock (an Event builds a condition and a lock, and notifies under it: a few
    microseconds per tool call where this costs a fraction of one).

    ``set`` is called once, by the thread; ``is_set`` reads a flag set before the
    lock is released; ``wait`` takes the lock and hands it back, so any number of
    waiters return once it is set.
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock = threading.Lock()
        self._lock.acquire()  # released by set()

    def set(self) -> None:
        """Mark it set (once) and wake the waiters."""
        self._set = True
        self._lock.release()

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """Block until it is set, or ``timeout`` seconds; whether it is set."""
        if not self._set and self._lock.acquire(timeout=-1 if timeout is None else timeout):
            self._lock.release()
        return self._set


class _LateThread:
    """A sync tool's function run in a worker thread that may be abandoned: what it
    returned or raised, once it has ended (``done``)."""

    __slots__ = ("done", "error", "fn", "value")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = _Done()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> Any:
        """Run the function (in the worker thread), keeping its outcome (``done`` is set
        when it ends)."""
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done.set()
        return self.value

    def outcome(self) -> str | ToolOutput:
        """The result of the ended call, as :meth:`Tool.call` returns it.

        Raises:
            Exception: what the function raised (or :func:`tool_output`).
        """
        if self.error is not None:
            raise self.error
        return tool_output(self.value)


class _Tokens(anyio.CapacityLimiter):
    """anyio's default thread limiter, entered with one scheduling point fewer.

    ``anyio.to_thread.run_sync`` enters its limiter with ``async with``; on
    asyncio the limiter's own ``acquire`` checks for a cancellation, takes a
    free token for the current task, then yields to the event loop under a
    shielded cancel scope (a scope and a loop iteration per call). This one
    does the same without that last yield (``run_sync`` has just yielded, in
    its own checkpoint): the same tokens of the same limiter, borrowed by the
    same task, so the thread limit (``total_tokens``, 40 by default, shared
    with every other ``anyio.to_thread`` call) is the one anyio documents. With
    no free token it waits in the limiter's own ``acquire``.
    """

    __slots__ = ("_limiter",)

    def __new__(cls, limiter: anyio.CapacityLimiter) -> _Tokens:
        return object.__new__(cls)

    def __init__(self, limiter: anyio.CapacityLimiter) -> None:
        self._limiter = limiter

    async def __aenter__(self) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()
        try:
            self._limiter.acquire_nowait()
        except anyio.WouldBlock:
            await self._limiter.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self._limiter.release()

    @property
    def total_tokens(self) -> float:
        return self._limiter.total_tokens

    @total_tokens.setter
    def total_tokens(self, value: float) -> None:
        self._limiter.total_tokens = value

    @property
    def borrowed_tokens(self) -> int:
        return self._limiter.borrowed_tokens

    @property
    def available_tokens(self) -> float:
        return self._limiter.available_tokens

    def acquire_nowait(self) -> None:
        self._limiter.acquire_nowait()

    def acquire_on_behalf_of_nowait(self, borrower: object) -> None:
        self._limiter.acquire_on_behalf_of_nowait(borrower)

    async def acquire(self) -> None:
        await self._limiter.acquire()

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self._limiter.acquire_on_behalf_of(borrower)

    def release(self) -> None:
        self._limiter.release()

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)

    def statistics(self) -> anyio.CapacityLimiterStatistics:
        return self._limiter.statistics()


def _thread_tokens() -> anyio.CapacityLimiter | None:
    """The limiter a sync tool's worker thread is run under: on asyncio anyio's default
    one, entered as :class:`_Tokens` does; elsewhere ``None`` (anyio's default, as is)."""
    if asyncio_here():
        return _Tokens(anyio.to_thread.current_default_thread_limiter())
    return None


ABANDONED: contextvars.ContextVar[list[_LateThread] | None] = contextvars.ContextVar(
    "stepmachine_abandoned_threads", default=None
)
"""Set by the ``Tools`` step around one call: :meth:`Tool.call` adds the worker thread
it stopped waiting for (a cancellation, a timeout), so the step can tell and decide."""

THREAD_GRACE = 1.0
"""Seconds the ``Tools`` step waits, after a run's cancellation, for a sync tool's
worker thread to end (so a tool finishing as the cancellation lands keeps its real
result); a thread still running then is abandoned."""


@overload
def tool(
    fn: Callable[..., Any],
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    thread: bool = True,
    side_effects: SideEffects = "non_idempotent",
    timeout: float | None = None,
) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    thread: bool = True,
    side_effects: SideEffects = "non_idempotent",
    timeout: float | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    thread: bool = True,
    side_effects: SideEffects = "non_idempotent",
    timeout: float | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a :class:`Tool` from a typed function; usable as ``@tool``, ``@tool(...)``, or
    ``tool(fn, side_effects=..., ...)`` (the options count in every form).

    Raises:
        ConfigurationError: a parameter lacks a type annotation, is ``*args`` or
            ``**kwargs``, or its type has no JSON schema.
    """
    if fn is not None:
        return Tool(
            fn,
            name=name,
            description=description,
            thread=thread,
            side_effects=side_effects,
            timeout=timeout,
        )
    return lambda f: Tool(
        f,
        name=name,
        description=description,
        thread=thread,
        side_effects=side_effects,
        timeout=timeout,
    )


def _method_advice(fn: Callable[..., Any], tool_name: str, first: str) -> str:
    """What to do when a tool's first parameter is an unannotated ``self`` or ``cls``."""
    qualname = str(getattr(fn, "__qualname__", ""))
    owner = qualname.rsplit(".", 2)[-2] if qualname.count(".") else "MyClass"
    method = str(getattr(fn, "__name__", "method"))
    return (
        f"tool {tool_name!r}: its first parameter is {first!r}, so it looks like @tool was "
        "applied to a method in a class body, where it gets the plain function and the model "
        f"would have to supply {first!r}; make the tool from the method of an instance "
        f"instead: remove @tool from the method and write tool(instance.{method}) (e.g. "
        f"Tools([tool({owner}().{method})])), or make it a module-level function or a "
        "@staticmethod"
    )


def _arguments_struct(
    fn: Callable[..., Any], tool_name: str
) -> tuple[str | None, type[msgspec.Struct]]:
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ConfigurationError(
            f"tool {tool_name!r}: a tool is made from a plain function or method, got {fn!r}"
        )
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot read the annotations of tool {tool_name!r}: {exc}; every name its "
            "annotations use must be importable where the function is defined"
        ) from exc
    context_param: str | None = None
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for index, param in enumerate(inspect.signature(fn).parameters.values()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(
                f"tool {tool_name!r}: *args and **kwargs have no schema ({param.name!r}); "
                "declare each argument as a named, annotated parameter"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigurationError(
                f"tool {tool_name!r}: parameter {param.name!r} is positional-only; tools are "
                "called with keyword arguments: remove the '/' from its signature"
            )
        if param.name not in hints and param.name in ("self", "cls") and not index:
            raise ConfigurationError(_method_advice(fn, tool_name, param.name))
        if param.name not in hints:
            raise ConfigurationError(
                f"tool {tool_name!r}: parameter {param.name!r} needs a type annotation "
                f"(e.g. {param.name}: str): the model is given a JSON schema built from them"
            )
        annotation = hints[param.name]
        if annotation is ToolContext:
            context_param = param.name
            continue
        if param.default is param.empty:
            fields.append((param.name, annotation))
        else:
            fields.append((param.name, annotation, param.default))
    struct = msgspec.defstruct(
        f"{tool_name}_arguments", fields, kw_only=True, forbid_unknown_fields=True
    )
    return context_param, struct


def _schema(arguments_type: type[msgspec.Struct]) -> dict[str, Any]:
    try:
        (ref,), components = msgspec.json.schema_components(
            [arguments_type], ref_template="#/$defs/{name}"
        )
    except TypeError as exc:
        tool_name = arguments_type.__name__.removesuffix("_arguments")
        raise ConfigurationError(
            f"the arguments of tool {tool_name!r} have no JSON schema: {exc}; annotate its "
            "parameters with types a JSON schema describes (str, int, float, bool, lists, "
            "dicts, msgspec Structs, dataclasses, Literal, ...)"
        ) from exc
    top_name = ref["$ref"].rsplit("/", 1)[-1]
    schema = dict(components.pop(top_name))
    schema.pop("title", None)
    if components:
        schema["$defs"] = components
    return schema

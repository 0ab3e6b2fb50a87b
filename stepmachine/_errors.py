"""The error hierarchy: one root, and each error names what it protects.

Every error raised by stepmachine derives from :class:`StepmachineError`, which
is never raised itself: each raise site uses the most specific class. Two
families sit under the root. A :class:`DefinitionError` (also a ``TypeError``)
means the program is wrong -- the step list, a constructor call, a step's
return value -- and is fixed in code. A :class:`RunError` happens while
running correct code -- a conflict, a missing session, damaged data, a failed
model call -- and is handled at run time. Each class documents the guarantee
or contract it protects, and every raise site puts the offending
value in the message, so a log line alone tells a reader what went wrong and
where::

    StepmachineError                  root; never raised directly
    ├── DefinitionError (TypeError)   the program is wrong; fix the code
    │   ├── ConfigurationError        steps or runtime wired wrongly
    │   ├── InvalidFieldError         a constructor got a wrong field (also ValueError)
    │   └── StepContractError         a step returned something ``run`` may not return
    └── RunError                      something happened while running
        ├── ConflictError             compare-and-set lost (no lost updates)
        ├── EffectError               an effect does not apply to the session
        ├── HistoryError              conversation not provider-valid (valid history)
        ├── InvalidSessionIdError     an id a store cannot accept (also ValueError)
        ├── LeaseLostError            a write with a lease that is no longer current
        ├── MediaTooLargeError        a media part over a store's limit (also ValueError)
        ├── SessionBusyError          another runner holds the session's lease
        ├── SessionExistsError
        ├── SessionNotFoundError      (also LookupError)
        ├── StoreClosedError          a store used after ``aclose()``
        ├── StoredDataError           a record does not decode (stored data is data)
        ├── ToolAbortError            a tool failed closed
        ├── ToolArgumentsError        tool arguments fail their schema
        ├── ToolError                 a tool's error result, worded by the tool
        ├── ModelError                a model call failed
        │   ├── ContextLengthError
        │   │   └── providers.ContextLengthExceededError (also BadRequestError)
        │   ├── UnexpectedModelCallError   a scripted model had no turn left
        │   └── providers.ProviderError    and its typed subclasses
        ├── providers.RedactedCauseError   a foreign exception in a provider error's chain, redacted
        ├── operations.ApprovalError        a decision cannot be recorded
        ├── operations.BudgetExhaustedError
        ├── operations.InvalidToolCallError
        ├── operations.NoOutputError        (also LookupError)
        └── stores.FileLockTimeoutError     (also TimeoutError)
"""

from __future__ import annotations

__all__ = [
    "ConfigurationError",
    "ConflictError",
    "ContextLengthError",
    "DefinitionError",
    "EffectError",
    "HistoryError",
    "InvalidFieldError",
    "InvalidSessionIdError",
    "LeaseLostError",
    "MediaTooLargeError",
    "ModelError",
    "RunError",
    "SessionBusyError",
    "SessionExistsError",
    "SessionNotFoundError",
    "StepContractError",
    "StepmachineError",
    "StoreClosedError",
    "StoredDataError",
    "ToolAbortError",
    "ToolArgumentsError",
    "ToolError",
    "UnexpectedModelCallError",
]


class StepmachineError(Exception):
    """Root of every error stepmachine raises; never raised itself.

    Catch it to handle anything stepmachine raises; catch :class:`DefinitionError`
    or :class:`RunError` (or a leaf) to tell a bug in the program from a failure
    while running.
    """


class DefinitionError(StepmachineError, TypeError):
    """The program is wrong: steps, runtime, a constructor call or a step's return value.

    Fixed in code, not retried. A ``TypeError``, so code that treats wrong usage
    as ``TypeError`` keeps working.
    """


class RunError(StepmachineError):
    """Something failed while running a correct program: storage, data, a model, a tool."""


class ConfigurationError(DefinitionError):
    """The step list or runtime is wired wrongly.

    Raised before any model call, for example when two steps advertise the same
    tool name, or a step needs a model and the runtime has none.
    """


class StepContractError(DefinitionError):
    """A step's ``run`` broke its contract.

    It returned something other than ``Refuse()``, ``Continue(effects)`` or
    ``Yield(effects, reason)`` (``None`` too: a ``run`` without its ``return``),
    or it returned ``Continue`` with no effects and committed nothing (the
    session would not change, so the next cycle would decide the same, forever).
    Nothing was written for that cycle.
    """


class ConflictError(RunError):
    """Compare-and-set failed: another writer moved the session on (no lost updates).

    Attributes:
        session_id: the session written to.
        expected: the revision the writer read.
        actual: the revision the store holds now.
    """

    def __init__(self, session_id: str, expected: int, actual: int) -> None:
        self.session_id = session_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"no lost updates: session {session_id!r} is at revision "
            f"{actual}, but the batch was computed from revision {expected}"
        )


class SessionBusyError(RunError):
    """Another runner holds the session's lease, and the lease policy says not to wait.

    Raised by ``run()`` with ``LeasePolicy(busy="fail")``, or with ``"wait"``
    when ``wait_timeout`` passed. Nothing was written.

    Attributes:
        session_id: the session.
        holder: who holds it (an owner string), and ``expires_in``: seconds until
            its lease lapses without renewal (``None`` where leases do not lapse).
    """

    def __init__(self, session_id: str, holder: str, expires_in: float | None) -> None:
        self.session_id = session_id
        self.holder = holder
        self.expires_in = expires_in
        when = "" if expires_in is None else f" (lease expires in {expires_in:.1f} s)"
        super().__init__(f"session {session_id!r} is being run by {holder!r}{when}")


class LeaseLostError(RunError):
    """A write carried a lease that is no longer the session's current one (fencing).

    The lease expired and another runner claimed the session, or it was
    released. Nothing of the refused write was stored; the run stops. Whatever
    the new holder does next is decided from the stored session.

    Attributes:
        session_id: the session.
        owner: the lost lease's owner; ``epoch``: its epoch.
        why: how it was found lost (``""``: a write was refused).
    """

    def __init__(self, session_id: str, owner: str, epoch: int, why: str = "") -> None:
        self.session_id = session_id
        self.owner = owner
        self.epoch = epoch
        self.why = why
        detail = f": {why}" if why else ""
        super().__init__(
            f"the lease of {owner!r} (epoch {epoch}) on session {session_id!r} is no longer "
            f"current{detail}; nothing was written"
        )


class SessionNotFoundError(RunError, LookupError):
    """The store holds no session with this id."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(f"no session with id {session_id!r}")


class SessionExistsError(RunError):
    """``create`` was asked for an id the store already holds."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        super().__init__(f"a session with id {session_id!r} already exists")


class InvalidSessionIdError(RunError, ValueError):
    """A session id a store cannot accept safely (a path, NUL bytes, too long, ...)."""


class StoreClosedError(RunError):
    """A store was used after ``aclose()``; nothing was done."""


class StoredDataError(RunError):
    """A stored or wire record could not be decoded (stored data is data).

    Decoding fails closed: unknown tags and malformed records raise this error,
    naming where the record came from, and nothing is rewritten.
    """


class MediaTooLargeError(RunError, ValueError):
    """A media part holds more bytes than the store takes; nothing was written.

    Attributes:
        session_id: the session the batch or conversation was for.
        message_id: the message holding the part (``""`` for application data).
        size: the part's bytes.
        limit: the store's ``max_media_bytes``.
        field: where in the application data the part is (``"picture"``,
            ``"pages[2]"``), or None for a part in a message.
    """

    def __init__(
        self, session_id: str, message_id: str, size: int, limit: int, field: str | None = None
    ) -> None:
        self.session_id = session_id
        self.message_id = message_id
        self.size = size
        self.limit = limit
        self.field = field
        if field is None:
            where = f"a media part of message {message_id!r} in session {session_id!r}"
            advice = ""
        else:
            where = f"a media part in application data field {field!r} of session {session_id!r}"
            advice = (
                " (media in application data are stored inline in every record and snapshot:"
                " keep large media in messages, which the store keeps once by digest, and a"
                " reference to them in the data)"
            )
        super().__init__(
            f"{where} holds {size:,} bytes; this store takes at most {limit:,} per part "
            f"(max_media_bytes){advice}; nothing was written"
        )

    def __reduce__(
        self,
    ) -> tuple[type[MediaTooLargeError], tuple[str, str, int, int, str | None]]:
        return type(self), (self.session_id, self.message_id, self.size, self.limit, self.field)


class EffectError(RunError):
    """An effect cannot be applied to the session it was computed for.

    For example, an annotation names a message id the conversation does not hold.
    The batch containing it is rejected whole; the session is unchanged.
    """


class HistoryError(RunError):
    """The conversation is not provider-valid (valid history).

    Raised before a model request is built from a history in which a tool call
    lacks its result, a result answers no call, or call ids repeat.
    """


class ToolArgumentsError(RunError):
    """A tool's arguments failed validation against its schema."""


class ToolError(RunError):
    """Raised by a tool to answer its call with an error result saying exactly this.

    The model reads the message as the call's error result (``is_error``),
    without the ``"tool 'x' failed: ValueError: "`` prefix any other exception
    gets; the run goes on. For a problem the model can fix (a file that does
    not exist, a date in the past) or an error a remote tool reported (an MCP
    result with ``isError``).
    """


class ToolAbortError(RunError):
    """Raised by a tool to fail closed: stop the whole batch, and the run.

    Calls of the batch not yet started are not started (they get a "not
    executed" error result), and the run yields with reason ``tool_failed``
    and this message.
    """


class ModelError(RunError):
    """A model call failed. Provider adapters raise typed subclasses."""


class ContextLengthError(ModelError):
    """The request does not fit the model's context window.

    ``ModelInference`` answers the first one by marking the last message
    (notes ``{"<step>": {"context_length_exceeded": True}}``) and continuing, so
    a compaction step can react; a second one in a row propagates.
    """


class UnexpectedModelCallError(ModelError):
    """A scripted model was called when its script had no turn left."""


class InvalidFieldError(DefinitionError, ValueError):
    """A public constructor got a value of the wrong type (or an unknown literal) for a field.

    Messages, parts, effects and sessions check their fields when built (by
    hand, by a factory such as ``Message.user`` or by ``msgspec.structs.replace``),
    so a mistake fails where it is made, not steps later. It is both a
    ``TypeError`` and a ``ValueError``; decoding wraps it in msgspec's
    ``ValidationError`` like any other invalid field.

    Attributes:
        owner: the class or factory, e.g. ``"Message.parts"``'s ``"Message"``.
        field: the field, with an index for an item (``"parts[1]"``).
        expected: what the field takes, in words.
        value: the value given.
    """

    def __init__(self, owner: str, field: str, expected: str, value: object) -> None:
        self.owner = owner
        self.field = field
        self.expected = expected
        self.value = value
        super().__init__(
            f"{owner}.{field}: expected {expected}, got {type(value).__name__} {_short_repr(value)}"
        )

    def __reduce__(self) -> tuple[type[InvalidFieldError], tuple[str, str, str, object]]:
        return type(self), (self.owner, self.field, self.expected, self.value)


def _short_repr(value: object) -> str:
    if isinstance(value, bytes | bytearray | memoryview) and len(value) > 32:
        return f"<{len(value):,} bytes>"  # never the whole repr of an image's bytes
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

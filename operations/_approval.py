"""Approval: tool calls that wait for a human decision before they run.

:class:`Approval` is a policy step. Its policy (a collection of tool names, or
a callable over the call and the session) says which tool calls need
approval. A call that needs approval runs only with a valid decision recorded
in the session, bound to that exact call:

* an *approval* whose fingerprint (:func:`stepmachine.fingerprint` of the tool
  name and :func:`stepmachine.effective_arguments`) equals the call's current
  one and that has not expired (``expires_at`` against ``runtime.clock()``);
* or an *always allow this tool* decision recorded anywhere in the session.

Decisions are recorded from outside the machine with :func:`approve` and
:func:`deny`, which validate them and persist them as effects (an
``Annotate`` on the tool call, in the step's notes namespace, recorded in the
audit log under the step's name). Nothing is held in memory: a fresh machine
in a new process decides the same (state is the session).

Notes on a tool call, namespace ``name`` (default ``"approval"``), two typed
records (:class:`stepmachine.Record`)::

    {"request":  ApprovalRequest,    # written by run()
     "decision": ApprovalDecision}   # written by approve() / deny()

A stored request or decision that does not convert raises
:class:`~stepmachine.StoredDataError` (naming the session and call): a damaged
decision never approves anything, and is never taken for "no decision".

Edited arguments are recorded as a note in :data:`stepmachine.EDITED_ARGUMENTS`
on the call (the model's original stays in history), so every tool runner
executes the edited arguments, and the approval is bound to their fingerprint.
If the effective arguments change after the approval, the fingerprint no
longer matches and the call is pending again.

Decisions survive compaction as long as the compaction hides the original
messages instead of deleting them (the notes stay on the hidden messages;
"always allow" is found among hidden messages too). A compaction that deletes
them loses the decisions, which fails safe: the tool asks again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, Final, Literal, TypeAlias

import msgspec

from stepmachine import (
    Annotate,
    AppendMessage,
    ConfigurationError,
    Continue,
    Effect,
    Message,
    Operation,
    Outcome,
    Refuse,
    RunError,
    Session,
    StepContext,
    Store,
    Tool,
    ToolArgumentsError,
    ToolCallPart,
    ToolResultPart,
    Yield,
    submit,
)
from stepmachine.extend import (
    EDITED_ARGUMENTS,
    TAG_FIELD,
    YieldReason,
    effective_arguments,
    fingerprint,
    note_value,
    open_tool_calls,
    read_record,
)

from ._records import ApprovalDecision, ApprovalRequest

__all__ = [
    "APPROVED",
    "DENIED",
    "Approval",
    "ApprovalDecision",
    "ApprovalError",
    "ApprovalPolicy",
    "ApprovalRequest",
    "PendingCall",
    "always_allowed",
    "approve",
    "deny",
    "recorded_decision",
]

DEFAULT_NAME = "approval"
APPROVED: Final = "approved"
"""``decision.outcome`` of an approval."""
DENIED: Final = "denied"
"""``decision.outcome`` of a denial."""

ApprovalPolicy: TypeAlias = Collection[str | Tool] | Callable[[ToolCallPart, Session[Any]], bool]
"""Which calls need approval: tool names (or tools), or ``(call, session) -> bool``."""

Status: TypeAlias = Literal["approved", "denied", "pending"]


class ApprovalError(RunError):
    """A decision cannot be recorded (approval bound to the exact call).

    Raised by :func:`approve` and :func:`deny` when the call does not exist or
    is not pending, when the decision conflicts with an earlier one, or when
    edited arguments do not validate. Nothing was written.
    """


class PendingCall(msgspec.Struct, frozen=True):
    """A tool call waiting for a decision.

    Attributes:
        call_id: the call's id (pass it to :func:`approve` / :func:`deny`).
        name: the tool name.
        arguments: the arguments it would run with (edits included).
        fingerprint: the fingerprint an approval is bound to.
    """

    call_id: str
    name: str
    arguments: Any
    fingerprint: str


# -- reading decisions --------------------------------------------------------------------


def recorded_decision(
    call: ToolCallPart, *, name: str = DEFAULT_NAME, where: str = "a session"
) -> ApprovalDecision | None:
    """The decision recorded on ``call`` in namespace ``name``, or ``None``.

    Raises:
        StoredDataError: the stored decision does not convert (names ``where``
            and the call).
    """
    return read_record(
        call.notes,
        name,
        ApprovalDecision,
        key="decision",
        where=f"{where}, tool call {call.call_id!r}",
    )


def _unexpired(decision: ApprovalDecision, now: float) -> bool:
    return decision.expires_at is None or now < decision.expires_at


def _valid_approval(call: ToolCallPart, decision: ApprovalDecision | None, now: float) -> bool:
    """True when ``decision`` approves exactly this call (fingerprint) and is unexpired."""
    return (
        decision is not None
        and decision.outcome == APPROVED
        and decision.fingerprint == fingerprint(call.name, effective_arguments(call))
        and _unexpired(decision, now)
    )


def _call_at(message: Message, call_id: str) -> ToolCallPart | None:
    """The first call with ``call_id`` in ``message`` (the one ``Annotate`` notes)."""
    for call in message.tool_calls:
        if call.call_id == call_id:
            return call
    return None


def always_allowed(
    session: Session[Any], *, name: str = DEFAULT_NAME, now: float
) -> frozenset[str]:
    """The tools an unexpired "always allow" decision covers in ``session``.

    Every message counts, hidden ones too, so the decision survives a
    compaction that hides the originals. Reads only the calls with notes in
    ``name`` (:meth:`stepmachine.HistoryIndex.noted`), not the whole history.
    """
    allowed: set[str] = set()
    conversation = session.conversation
    where = f"session {session.id!r}"
    for position, call_id in session.history.noted(name):
        if call_id is None:
            continue
        call = _call_at(conversation[position], call_id)
        decision = None if call is None else recorded_decision(call, name=name, where=where)
        if (
            call is not None
            and decision is not None
            and decision.outcome == APPROVED
            and decision.always
            and _unexpired(decision, now)
        ):
            allowed.add(decision.tool or call.name)
    return frozenset(allowed)


def _open_calls(session: Session[Any]) -> list[tuple[str, ToolCallPart]]:
    """Like ``open_tool_calls``, with the id of the message holding each call. O(open calls)."""
    conversation = session.conversation
    return [
        (conversation[position].id, call)
        for position, call in session.history.open_call_positions()
    ]


# -- the step -------------------------------------------------------------------------------


class Approval(Operation[Any]):
    """Holds back tool calls that need approval until a valid decision is recorded.

    Args:
        policy: which calls need approval: a collection of tool names (or
            :class:`~stepmachine.Tool` objects; a single one will do), or a callable
            ``(call, session) -> bool`` (pure: it is asked every cycle).
        name: the step name; also the notes namespace of requests and
            decisions (pass the same ``name`` to :func:`approve` / :func:`deny`).

    Behaviour of ``run``, over the open tool calls (visible, without a result):

    * a call with a recorded denial gets an error tool result telling the
      model who denied it, their message, and not to retry -> ``Continue``;
    * otherwise, if a call that needs approval has no valid decision (none,
      expired, or approved for other arguments) -> ``Yield`` with reason
      ``awaiting_approval`` and ``data={"calls": [{"call_id", "name",
      "arguments", "fingerprint"}, ...]}``; the calls are annotated with a
      ``request`` note (when requested and for which fingerprint) the first
      time they are reported, so the yield writes nothing when repeated;
    * otherwise it refuses: the tool step runs the calls.

    ``check_call`` objects to every denied call and to every call that needs
    approval and lacks a valid decision, so the Tools step holds them back
    whatever the order of the steps (approval cannot be bypassed).

    Placement: before ``Tools`` and before ``ModelInference``. Before Tools,
    so the run stops for a decision before any call of the model's batch runs
    (the human sees the batch as proposed) and denials become tool results in
    the same cycle they are found. Before inference, so a denial is answered
    before the model could be asked again (``ModelInference`` refuses while
    calls are open, so this matters for inference steps that answer open
    calls themselves). Misordering is safe, never a bypass: the Tools step
    asks every step's ``check_call``, so a call without a valid approval is
    held back even when Tools comes first (it then runs the calls that need no
    approval before this step yields).

    Cancellation: ``run`` does no IO and has nothing to keep; ``finalize``
    returns nothing.
    """

    def __init__(self, policy: ApprovalPolicy | str | Tool, *, name: str = DEFAULT_NAME) -> None:
        self._name = name
        self._predicate: Callable[[ToolCallPart, Session[Any]], bool]
        if isinstance(policy, str | Tool):
            policy = (policy,)
        if callable(policy):
            self._predicate = policy
        elif isinstance(policy, Collection):
            names: set[str] = set()
            for item in policy:
                if isinstance(item, Tool):
                    names.add(item.name)
                elif isinstance(item, str):
                    names.add(item)
                else:
                    raise ConfigurationError(
                        f"approval policy items are tool names or Tools, got {item!r}"
                    )
            frozen = frozenset(names)
            self._predicate = lambda call, _session: call.name in frozen
        else:
            raise ConfigurationError(
                "an approval policy is a collection of tool names or a callable "
                f"(call, session) -> bool, got {policy!r}"
            )

    @property
    def name(self) -> str:
        return self._name

    def needs_approval(self, call: ToolCallPart, session: Session[Any]) -> bool:
        """True when the policy says ``call`` needs approval."""
        return bool(self._predicate(call, session))

    def status(
        self,
        call: ToolCallPart,
        session: Session[Any],
        *,
        now: float,
        allowed: frozenset[str] | None = None,
    ) -> Status | None:
        """The state of ``call``: ``"denied"``, ``"approved"``, ``"pending"``, or
        ``None`` when it needs no approval.

        A denial always counts. ``allowed`` is :func:`always_allowed` of the
        session when the caller has computed it already.
        """
        decision = recorded_decision(call, name=self._name, where=f"session {session.id!r}")
        if decision is not None and decision.outcome == DENIED:
            return DENIED
        if not self.needs_approval(call, session):
            return None
        if _valid_approval(call, decision, now):
            return APPROVED
        if allowed is None:
            allowed = always_allowed(session, name=self._name, now=now)
        return APPROVED if call.name in allowed else "pending"

    def pending(self, session: Session[Any], *, now: float | None = None) -> list[PendingCall]:
        """The open calls that need approval and have no valid decision, oldest first.

        ``now`` defaults to ``time.time()``; pass the runtime's clock in tests.
        """
        now = time.time() if now is None else now
        allowed = always_allowed(session, name=self._name, now=now)
        return [
            _pending_call(call)
            for _, call in _open_calls(session)
            if self.status(call, session, now=now, allowed=allowed) == "pending"
        ]

    def check_call(self, ctx: StepContext[Any], call: ToolCallPart) -> str | None:
        """Object to a denied call, and to one that needs approval and lacks a valid one."""
        status = self.status(call, ctx.session, now=ctx.runtime.clock())
        if status == DENIED:
            return f"tool call {call.call_id!r} ({call.name}) was denied"
        if status == "pending":
            return (
                f"tool call {call.call_id!r} ({call.name}) needs an approval bound to "
                f"fingerprint {fingerprint(call.name, effective_arguments(call))!r}"
            )
        return None

    async def run(self, ctx: StepContext[Any]) -> Outcome:
        session = ctx.session
        # The cheap check first (shared with the other steps this cycle): with no
        # open call there is nothing to approve or deny.
        if not open_tool_calls(session):
            return Refuse("no open tool call waits for approval")
        now = ctx.runtime.clock()
        allowed = always_allowed(session, name=self._name, now=now)
        denied: list[ToolCallPart] = []
        waiting: list[tuple[str, ToolCallPart]] = []
        for message_id, call in _open_calls(session):
            status = self.status(call, session, now=now, allowed=allowed)
            if status == DENIED:
                denied.append(call)
            elif status == "pending":
                waiting.append((message_id, call))
        if denied:
            return Continue([self._denial_result(ctx, call) for call in denied])
        if not waiting:
            return Refuse("no open tool call waits for approval")
        pending = [_pending_call(call) for _, call in waiting]
        annotations: list[Effect] = []
        for (message_id, call), item in zip(waiting, pending, strict=True):
            where = f"session {session.id!r}, message {message_id!r}, tool call {call.call_id!r}"
            request = read_record(
                call.notes, self._name, ApprovalRequest, key="request", where=where
            )
            if request is None or request.fingerprint != item.fingerprint:
                record = ApprovalRequest(fingerprint=item.fingerprint, requested_at=now)
                annotations.append(
                    Annotate(
                        message_id,
                        self._name,
                        {"request": note_value(record)},
                        call_id=call.call_id,
                    )
                )
        names = ", ".join(f"{p.name} ({p.call_id})" for p in pending)
        reason = YieldReason(
            YieldReason.AWAITING_APPROVAL,
            f"{len(pending)} tool call(s) await approval: {names}",
            data={"calls": [msgspec.to_builtins(p) for p in pending]},
        )
        return Yield(annotations, reason)

    def _denial_result(self, ctx: StepContext[Any], call: ToolCallPart) -> Effect:
        decision = recorded_decision(call, name=self._name, where=f"session {ctx.session.id!r}")
        by = (decision.by if decision else "") or "a reviewer"
        message = (decision.message if decision else "") or "no reason given"
        content = (
            f"The call to {call.name!r} was denied by {by}: {message}. "
            "It was not run. Do not retry it."
        )
        result = ToolResultPart.for_call(call, content, is_error=True)
        return AppendMessage(Message.tool_result(result, id=ctx.new_id()))


def _pending_call(call: ToolCallPart) -> PendingCall:
    arguments = effective_arguments(call)
    return PendingCall(
        call_id=call.call_id,
        name=call.name,
        arguments=arguments,
        fingerprint=fingerprint(call.name, arguments),
    )


# -- recording decisions ----------------------------------------------------------------------


def _find_pending(
    session: Session[Any], call_id: str, name: str
) -> tuple[str, ToolCallPart, ApprovalDecision | None]:
    for message_id, call in _open_calls(session):
        if call.call_id == call_id:
            where = f"session {session.id!r}, message {message_id!r}"
            _check_step_name(call, name, where)
            return message_id, call, recorded_decision(call, name=name, where=where)
    if session.history.call_position(call_id) is not None:
        raise ApprovalError(
            f"approval bound to the exact call: tool call {call_id!r} of session "
            f"{session.id!r} is not pending: it already has a result or is hidden from the model"
        )
    raise ApprovalError(
        f"approval bound to the exact call: session {session.id!r} holds no tool call {call_id!r}"
    )


def _check_step_name(call: ToolCallPart, name: str, where: str) -> None:
    """Refuse a decision under ``name`` when another Approval step asked for this call.

    A decision is read only by the step of that name: one written under a name
    no step asked under (a typo) would be ignored while the step still waits.
    A call nobody asked about yet (decided ahead of the run) is left alone.
    """
    if read_record(call.notes, name, ApprovalRequest, key="request", where=where) is not None:
        return
    askers = sorted(
        namespace
        for namespace, value in call.notes.items()
        if isinstance(value, dict)
        and isinstance(value.get("request"), dict)
        and value["request"].get(TAG_FIELD) == ApprovalRequest.__struct_config__.tag
    )
    if askers:
        raise ApprovalError(
            f"approval bound to the exact call: tool call {call.call_id!r} "
            f"({where}) awaits approval from the step named {askers[0]!r}, not {name!r}: "
            "a decision under another name would never be read (pass name=)"
        )


def _check_by(by: str) -> None:
    if not isinstance(by, str) or not by.strip():
        raise ApprovalError(f"a decision names who made it: by={by!r}")


async def approve(
    store: Store,
    session_id: str,
    call_id: str,
    *,
    by: str,
    reason: str = "",
    edited_arguments: Any = None,
    always: bool = False,
    expires_at: float | None = None,
    tool: Tool | None = None,
    name: str = DEFAULT_NAME,
    clock: Callable[[], float] = time.time,
) -> Session[Any]:
    """Record an approval of the pending tool call ``call_id``.

    The approval is bound to the call's fingerprint (tool name and effective
    arguments). With ``edited_arguments``, those are validated against
    ``tool``'s schema, recorded as an :data:`~stepmachine.EDITED_ARGUMENTS`
    note on the call (the tool runs with them), and the approval is bound to
    their fingerprint. ``always=True`` also allows every later call of this
    tool in the session (until ``expires_at``, if given). ``expires_at`` is
    seconds since the epoch, compared with the runtime's clock when the call
    is about to run. Approving a call again (after it expired, or its
    arguments changed) replaces the earlier approval.

    One batch in the audit log, under step name ``name``, validated and
    written compare-and-set on the same revision (retried on conflict).

    Returns:
        The session after the decision.

    Raises:
        ApprovalError: no such call; it is not pending (it has a result); it
            was denied; ``by`` is empty; ``expires_at`` has passed;
            ``edited_arguments`` without ``tool``, or for another tool, or
            that do not validate. Nothing was written.
        ConflictError: still conflicting after 16 attempts.
        SessionNotFoundError: no such session.

    Cancellation: the decision is written whole or not at all.
    """
    _check_by(by)
    if edited_arguments is not None and tool is None:
        raise ApprovalError(
            f"edited arguments for tool call {call_id!r} are validated against the tool's "
            "schema: pass tool=<the Tool>"
        )

    def compute(session: Session[Any]) -> list[Effect]:
        message_id, call, earlier = _find_pending(session, call_id, name)
        if earlier is not None and earlier.outcome == DENIED:
            raise ApprovalError(
                f"tool call {call_id!r} ({call.name}) of session {session.id!r} was denied by "
                f"{earlier.by!r}; a denied call cannot be approved"
            )
        if tool is not None and tool.name != call.name:
            raise ApprovalError(
                f"tool call {call_id!r} calls {call.name!r}, not {tool.name!r} (tool=...)"
            )
        now = clock()
        if expires_at is not None and not expires_at > now:
            raise ApprovalError(
                f"approval of tool call {call_id!r} would expire at {expires_at}, "
                f"which is not after now ({now})"
            )
        effects: list[Effect] = []
        arguments = effective_arguments(call)
        if edited_arguments is not None:
            assert tool is not None  # checked above
            arguments = msgspec.to_builtins(edited_arguments)
            try:
                tool.validate(arguments)
            except ToolArgumentsError as exc:
                raise ApprovalError(
                    f"edited arguments for tool call {call_id!r} do not validate: {exc}"
                ) from exc
            effects.append(
                Annotate(message_id, EDITED_ARGUMENTS, {"arguments": arguments}, call_id=call_id)
            )
        record = ApprovalDecision(
            outcome=APPROVED,
            fingerprint=fingerprint(call.name, arguments),
            tool=call.name,
            by=by,
            reason=reason,
            message="",
            decided_at=now,
            expires_at=expires_at,
            always=always,
            edited=edited_arguments is not None,
        )
        effects.append(
            Annotate(message_id, name, {"decision": note_value(record)}, call_id=call_id)
        )
        return effects

    # submit() runs ``compute`` (which validates and raises ApprovalError) again on
    # every attempt, against exactly the revision the batch is written on top of:
    # a decision racing another decision or a tool run is never written unchecked.
    return await submit(store, session_id, compute, step=name, clock=clock)


async def deny(
    store: Store,
    session_id: str,
    call_id: str,
    *,
    by: str,
    message: str,
    reason: str = "",
    name: str = DEFAULT_NAME,
    clock: Callable[[], float] = time.time,
) -> Session[Any]:
    """Record a denial of the pending tool call ``call_id``.

    The next ``run()`` answers the call with an error result for the model,
    naming ``by`` and carrying ``message``, telling it not to retry. ``reason``
    is for the audit log only. A call of a tool that is "always allowed"
    may still be denied while it has not run: the denial of this one call is
    the more specific decision, and a denial always wins.

    Returns:
        The session after the decision.

    Raises:
        ApprovalError: no such call; it is not pending; it holds a valid
            approval of its own; ``by`` is empty. Nothing was written.
        ConflictError: still conflicting after 16 attempts.
        SessionNotFoundError: no such session.

    Cancellation: the decision is written whole or not at all.
    """
    _check_by(by)

    def compute(session: Session[Any]) -> list[Effect]:
        message_id, call, earlier = _find_pending(session, call_id, name)
        now = clock()
        if _valid_approval(call, earlier, now):
            raise ApprovalError(
                f"tool call {call_id!r} ({call.name}) of session {session.id!r} is approved "
                f"(by {earlier.by if earlier else None!r}); an approved call cannot be "
                "denied"
            )
        record = ApprovalDecision(
            outcome=DENIED,
            fingerprint=fingerprint(call.name, effective_arguments(call)),
            tool=call.name,
            by=by,
            reason=reason,
            message=message,
            decided_at=now,
        )
        return [Annotate(message_id, name, {"decision": note_value(record)}, call_id=call_id)]

    # submit() runs ``compute`` (which validates and raises ApprovalError) again on
    # every attempt, against exactly the revision the batch is written on top of:
    # a decision racing another decision or a tool run is never written unchecked.
    return await submit(store, session_id, compute, step=name, clock=clock)

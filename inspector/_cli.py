"""The ``stepmachine`` command: list, inspect, decide on, fork, export and watch sessions.

Built on Click, rendered with rich (extra ``cli``). Every command names its
store with the global ``--store URL`` option or the ``STEPMACHINE_STORE``
environment variable (see :mod:`._open` for the URL forms).

Read commands (``sessions list``, ``show``, ``log``, ``fsck``, ``export``,
``serve``) open the store so that nothing can be written: a missing store is
an error, never created. Write commands (``approve``, ``deny``,
``resolve-unknown``, ``submit-event``, ``fork``) write through the same
validated operations as the Python API (:func:`~stepmachine.operations.approve`
and the others), so a decision made here is exactly one made in code.

Exit status: 0 done; 1 the command failed (an unknown session, a call that is
not pending, a store written by a newer schema...: one line on stderr, no
traceback); 2 a usage error (Click's); ``fsck`` exits 1 when it found problems.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import click
from rich.console import Console

from stepmachine import (
    SessionNotFoundError,
    StepmachineError,
    StoredDataError,
    Tool,
    resolve_unknown_outcome,
)
from stepmachine.operations import approve, deny, submit_event

from ._html import render_html
from ._open import UsageError, list_entries, load_codec, load_object, open_store
from ._status import STATUSES, session_status
from ._terminal import clean, json_text, print_log, print_sessions, print_show
from ._view import History, batch_view, finite, history_problems, load_view
from ._web_extra import require_web

__all__ = ["cli", "main"]

T = TypeVar("T")


class _Settings:
    def __init__(self, store: str | None, codec: str | None, backend: str) -> None:
        self.store = store
        self.codec = codec
        self.backend = backend


def _settings(ctx: click.Context) -> _Settings:
    settings = ctx.find_object(_Settings)
    assert settings is not None  # the group made it
    return settings


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


@contextmanager
def _errors() -> Iterator[None]:
    """Expected failures as one line on stderr and exit status 1 (no traceback)."""
    try:
        yield
    except UsageError as exc:
        raise click.UsageError(clean(exc)) from exc
    except SessionNotFoundError as exc:
        raise click.ClickException(clean(f"SessionNotFoundError: {exc}")) from exc
    except (StepmachineError, OSError, ValueError, sqlite3.Error) as exc:
        raise click.ClickException(clean(f"{type(exc).__name__}: {exc}")) from exc


def _run(ctx: click.Context, work: Callable[[Any], Awaitable[T]], *, write: bool = False) -> T:
    """Open the store, run ``work(store)``, close the store; on the chosen async backend."""
    settings = _settings(ctx)

    async def main() -> T:
        codec = load_codec(settings.codec) if settings.codec else None
        store = await open_store(settings.store or "", codec=codec, write=write)
        try:
            return await work(store)
        except StoredDataError as exc:
            if codec is not None or "does not validate" not in str(exc):
                raise  # damage (a checksum, a torn or malformed record) is not the codec's
            raise StoredDataError(
                f"{exc} (a session that keeps its own data or effects reads with the "
                "application's codec: --codec module:attribute)"
            ) from exc
        finally:
            await store.aclose()

    with _errors():
        return anyio.run(main, backend=settings.backend)


def _not_json(token: str) -> float:
    raise ValueError(f"{token} is not a JSON number")


def _finite_number(token: str) -> float:
    number = float(token)
    if not math.isfinite(number):
        raise ValueError(f"{token} is out of range")
    return number


def _json_argument(value: str | None, option: str) -> Any:
    """``value`` parsed as strict JSON: no ``NaN``/``Infinity``, no number that overflows
    (they would be stored as ``null``, not as given)."""
    if value is None:
        return None
    try:
        return json.loads(value, parse_constant=_not_json, parse_float=_finite_number)
    except ValueError as exc:  # json.JSONDecodeError too
        raise click.BadParameter(f"not JSON: {exc}", param_hint=option) from exc
    except RecursionError:
        raise click.BadParameter("nested too deeply to read", param_hint=option) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    envvar="STEPMACHINE_STORE",
    metavar="URL",
    help="sqlite:///PATH, file:///FOLDER or postgresql://... [env: STEPMACHINE_STORE]",
)
@click.option(
    "--codec",
    envvar="STEPMACHINE_CODEC",
    metavar="MODULE:ATTR",
    help="the application's Codec, for sessions with their own data or effects "
    "(imports MODULE) [env: STEPMACHINE_CODEC]",
)
@click.option(
    "--backend",
    type=click.Choice(["asyncio", "trio"]),
    default="asyncio",
    show_default=True,
    help="the async backend the command runs on",
)
@click.version_option(package_name="stepmachine")
@click.pass_context
def cli(ctx: click.Context, store: str | None, codec: str | None, backend: str) -> None:
    """Inspect and operate the sessions of a stepmachine store."""
    ctx.obj = _Settings(store, codec, backend)


# -- sessions ---------------------------------------------------------------------------------


@cli.group()
def sessions() -> None:
    """The sessions of the store."""


async def _session_row(store: Any, session_id: str) -> dict[str, Any]:
    session = await store.load(session_id)
    last = await store.batches(session_id, after=session.revision - 1) if session.revision else []
    return {
        "id": session.id,
        "revision": session.revision,
        "last_activity": finite(last[-1].timestamp) if last else None,
        "status": session_status(session),
    }


@sessions.command("list")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(STATUSES),
    help="only sessions with this status (repeatable)",
)
@click.option("--match", metavar="PATTERN", help="only ids matching this glob (like 'support-*')")
@click.option("--limit", type=click.IntRange(min=1), help="at most this many, most recent first")
@click.option("--json", "as_json", is_flag=True, help="JSON lines instead of a table")
@click.pass_context
def sessions_list(
    ctx: click.Context,
    statuses: tuple[str, ...],
    match: str | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List sessions: id, revision, last activity and status.

    A session that does not decode is listed with status "unreadable" and
    the error, and the others are still listed.
    """

    async def work(store: Any) -> list[dict[str, Any]]:
        rows = []
        for session_id, damage in await list_entries(store):
            if match is not None and not fnmatch.fnmatchcase(session_id, match):
                continue
            error = damage
            if damage is None:
                try:
                    rows.append(await _session_row(store, session_id))
                    continue
                except (StepmachineError, ValueError, OSError) as exc:
                    error = str(exc)
            rows.append(
                {
                    "id": session_id,
                    "revision": None,
                    "last_activity": None,
                    "status": "unreadable",
                    "error": error,
                }
            )
        return rows

    rows = _run(ctx, work)
    if statuses:
        rows = [row for row in rows if row["status"] in statuses]
    if limit is not None:
        rows = sorted(rows, key=lambda r: r["last_activity"] or 0.0, reverse=True)[:limit]
    if as_json:
        for row in rows:
            click.echo(json_text(row))
        return
    print_sessions(_console(), rows)
    for row in rows:
        if "error" in row:
            click.echo(clean(f"{row['id']}: {row['error']}"), err=True)


# -- show, log --------------------------------------------------------------------------------


@cli.command()
@click.argument("session_id", metavar="SESSION")
@click.option("--at", type=click.IntRange(min=0), help="the session as it was at this revision")
@click.option("--json", "as_json", is_flag=True, help="the whole view as JSON")
@click.option("--model-view", is_flag=True, help="only what the model sees (no hidden messages)")
@click.option("--notes", is_flag=True, help="also every message's notes, as stored")
@click.pass_context
def show(
    ctx: click.Context,
    session_id: str,
    at: int | None,
    as_json: bool,
    model_view: bool,
    notes: bool,
) -> None:
    """The conversation: messages, tool calls with their journal state, approvals,
    compactions, notes; hidden messages marked."""
    view = _run(ctx, lambda store: load_view(store, session_id, at))
    if as_json:
        click.echo(json_text(view, indent=2))
        return
    print_show(_console(), view, model_view=model_view, notes=notes)


@cli.command()
@click.argument("session_id", metavar="SESSION")
@click.option("--after", type=click.IntRange(min=0), default=0, help="only batches after this")
@click.option("--json", "as_json", is_flag=True, help="JSON lines (one batch each)")
@click.pass_context
def log(ctx: click.Context, session_id: str, after: int, as_json: bool) -> None:
    """The audit log: one line per batch (revision, step, cycle, time, effects, refusals)."""

    async def work(store: Any) -> list[dict[str, Any]]:
        await store.load(session_id)  # an unknown session is an error, not an empty log
        views = []
        previous = None
        history = History((await store.load_at(session_id, 0)).conversation)
        for batch in await store.batches(session_id):
            view = batch_view(batch, previous=previous, history=history)
            previous = batch.timestamp
            if batch.revision > after:
                views.append(view)
        return views

    views = _run(ctx, work)
    if as_json:
        for view in views:
            click.echo(json_text(view))
        return
    print_log(_console(), views)


# -- fsck -------------------------------------------------------------------------------------


@cli.command()
@click.argument("session_id", metavar="[SESSION]", required=False)
@click.pass_context
def fsck(ctx: click.Context, session_id: str | None) -> None:
    """Check histories (one session, or all): what a provider would refuse, records that do
    not decode. Changes nothing. Exit status 1 when a problem was found.

    A call still waiting for its result (its tool, an approval) is a state, not a problem."""

    async def work(store: Any) -> list[tuple[str, str]]:
        entries = [(session_id, None)] if session_id is not None else await list_entries(store)
        ids = [each for each, _ in entries]
        found: list[tuple[str, str]] = []
        for each, damage in entries:
            if damage is not None:
                found.append((each, f"unreadable: {damage}"))
                continue
            try:
                session = await store.load(each)
                await store.batches(each)
            except SessionNotFoundError:
                raise
            except (StepmachineError, ValueError, OSError) as exc:
                found.append((each, f"unreadable: {exc}"))
                continue
            found.extend(
                (each, f"{problem.kind} at message {problem.message_id}: {problem.detail}")
                for problem in history_problems(session)
            )
        click.echo(f"checked {len(ids)} session(s)", err=True)
        return found

    found = _run(ctx, work)
    for each, problem in found:
        click.echo(clean(f"{each}: {problem}"))
    if found:
        ctx.exit(1)
    click.echo("no problems found")


# -- decisions --------------------------------------------------------------------------------


def _load_tool(spec: str) -> Tool:
    with _errors():
        value = load_object(spec, "--tool")
    if not isinstance(value, Tool):
        raise click.BadParameter(f"{spec} is not a stepmachine Tool", param_hint="--tool")
    return value


def _done(session: Any, what: str) -> None:
    click.echo(clean(f"{what}; session {session.id} is at revision {session.revision}"))


@cli.command("approve")
@click.argument("session_id", metavar="SESSION")
@click.argument("call_id")
@click.option("--by", required=True, help="who decides (recorded)")
@click.option("--why", default="", help="why (recorded in the audit log)")
@click.option("--args", "arguments", metavar="JSON", help="run the call with these arguments")
@click.option("--tool", metavar="MODULE:ATTR", help="the Tool that validates --args")
@click.option("--always", is_flag=True, help="also allow later calls of this tool")
@click.option("--expires-in", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS")
@click.option("--name", default="approval", show_default=True, help="the Approval step's name")
@click.pass_context
def approve_command(
    ctx: click.Context,
    session_id: str,
    call_id: str,
    by: str,
    why: str,
    arguments: str | None,
    tool: str | None,
    always: bool,
    expires_in: float | None,
    name: str,
) -> None:
    """Approve the pending tool call CALL_ID (bound to its tool and arguments)."""
    edited = _json_argument(arguments, "--args")
    if arguments is not None and not isinstance(edited, dict):
        raise click.BadParameter(
            f"the edited arguments must be a JSON object, not {type(edited).__name__}",
            param_hint="--args",
        )
    if arguments is not None and tool is None:
        raise click.UsageError(
            "--args are validated against the tool's schema: pass --tool module:attribute"
        )
    the_tool = _load_tool(tool) if tool is not None else None
    expires_at = None if expires_in is None else time.time() + expires_in
    session = _run(
        ctx,
        lambda store: approve(
            store,
            session_id,
            call_id,
            by=by,
            reason=why,
            edited_arguments=edited,
            always=always,
            expires_at=expires_at,
            tool=the_tool,
            name=name,
        ),
        write=True,
    )
    _done(session, f"approved {call_id}")


@cli.command("deny")
@click.argument("session_id", metavar="SESSION")
@click.argument("call_id")
@click.option("--by", required=True, help="who decides (recorded)")
@click.option("--why", required=True, help="what the model is told")
@click.option("--reason", default="", help="for the audit log only")
@click.option("--name", default="approval", show_default=True, help="the Approval step's name")
@click.pass_context
def deny_command(
    ctx: click.Context, session_id: str, call_id: str, by: str, why: str, reason: str, name: str
) -> None:
    """Deny the pending tool call CALL_ID: the model is told, and the call never runs."""
    session = _run(
        ctx,
        lambda store: deny(
            store, session_id, call_id, by=by, message=why, reason=reason, name=name
        ),
        write=True,
    )
    _done(session, f"denied {call_id}")


@cli.command("resolve-unknown")
@click.argument("session_id", metavar="SESSION")
@click.argument("call_id")
@click.option("--by", required=True, help="who decides (recorded)")
@click.option(
    "--rerun/--no-rerun",
    required=True,
    help="run the call again on the next run, or answer it 'not re-run' now",
)
@click.option("--note", default="", help="recorded with the decision")
@click.pass_context
def resolve_unknown(
    ctx: click.Context, session_id: str, call_id: str, by: str, rerun: bool, note: str
) -> None:
    """Decide on a call whose outcome a crash left unknown."""
    session = _run(
        ctx,
        lambda store: resolve_unknown_outcome(
            store, session_id, call_id, rerun=rerun, by=by, note=note
        ),
        write=True,
    )
    _done(session, f"{'re-run allowed for' if rerun else 'not re-running'} {call_id}")


@cli.command("submit-event")
@click.argument("session_id", metavar="SESSION")
@click.argument("kind")
@click.option("--payload", metavar="JSON", help="the event's payload")
@click.option("--id", "event_id", help="the event id (a repeated id is stored once)")
@click.option("--namespace", default="events", show_default=True)
@click.pass_context
def submit_event_command(
    ctx: click.Context,
    session_id: str,
    kind: str,
    payload: str | None,
    event_id: str | None,
    namespace: str,
) -> None:
    """Store an external event KIND for the session; its next run consumes it."""
    value = _json_argument(payload, "--payload")
    receipt = _run(
        ctx,
        lambda store: submit_event(
            store, session_id, kind, value, event_id=event_id, namespace=namespace
        ),
        write=True,
    )
    if receipt.accepted:
        click.echo(clean(f"event {receipt.event_id} stored at revision {receipt.revision}"))
    else:
        click.echo(clean(f"event {receipt.event_id} was already stored; nothing written"))


# -- fork, export -----------------------------------------------------------------------------


@cli.command()
@click.argument("session_id", metavar="SESSION")
@click.option("--at", "revision", type=click.IntRange(min=0), required=True)
@click.option("--as", "new_id", metavar="NEW", help="the new session's id")
@click.pass_context
def fork(ctx: click.Context, session_id: str, revision: int, new_id: str | None) -> None:
    """Copy SESSION as it was at a revision into a new session (audit log included)."""
    target = new_id if new_id is not None else f"{session_id}-fork-{revision}"

    async def work(store: Any) -> Any:
        if not hasattr(store, "fork"):
            raise UsageError(f"{type(store).__name__} cannot fork sessions")
        return await store.fork(session_id, revision, target)

    session = _run(ctx, work, write=True)
    _done(session, f"forked {session_id} at revision {revision} as {session.id}")


@cli.command()
@click.argument("session_id", metavar="SESSION")
@click.option("--html", "html_file", type=click.Path(dir_okay=False, writable=True), metavar="FILE")
@click.option("--json", "json_file", type=click.Path(dir_okay=False, writable=True), metavar="FILE")
@click.option("--at", type=click.IntRange(min=0), help="the session as it was at this revision")
@click.pass_context
def export(
    ctx: click.Context,
    session_id: str,
    html_file: str | None,
    json_file: str | None,
    at: int | None,
) -> None:
    """Write the session's timeline: one self-contained HTML file (no network needed to
    read it), or the view as JSON. FILE - is standard output."""
    if html_file is None and json_file is None:
        raise click.UsageError("say what to write: --html FILE and/or --json FILE")
    if html_file == "-" and json_file == "-":
        raise click.UsageError("only one of --html and --json can write to standard output (-)")
    view = _run(ctx, lambda store: load_view(store, session_id, at))
    with _errors():
        for path, render in ((html_file, render_html), (json_file, _json_export)):
            if path == "-":
                click.echo(render(view), nl=False)
            elif path is not None:
                _write(path, render(view))
                # On stderr when the other one went to standard output, which it must not mix with.
                click.echo(clean(f"wrote {path}"), err="-" in (html_file, json_file))


def _json_export(view: Any) -> str:
    return json_text(view, indent=2) + "\n"


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: a temporary file beside it, then a rename."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


# -- serve ------------------------------------------------------------------------------------


@cli.command()
@click.argument("store_url", metavar="[STORE]", required=False)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--poll", default=0.25, show_default=True, type=click.FloatRange(min=0.01))
@click.option(
    "--allow-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="also answer requests addressed to this host name or address (repeatable); "
    "by default only loopback names (localhost, 127.0.0.1, [::1])",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="seconds a connection has to send a request's headers",
)
@click.option(
    "--max-connections",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="connections open at once; the one idle longest is closed to make room",
)
@click.pass_context
def serve(
    ctx: click.Context,
    store_url: str | None,
    host: str,
    port: int,
    poll: float,
    allowed_hosts: tuple[str, ...],
    header_timeout: float,
    max_connections: int,
) -> None:
    """Serve the session list and live timelines over HTTP (needs the web extra).

    Answers requests addressed to loopback names only, unless --allow-host
    names another (a DNS-rebinding page cannot read the sessions).
    """
    settings = _settings(ctx)
    url = store_url or settings.store or ""
    with _errors():
        require_web()
        from ._web import serve as serve_web  # noqa: PLC0415 - needs the web extra

        codec = load_codec(settings.codec) if settings.codec else None
        serve_web(
            url,
            host=host,
            port=port,
            codec=codec,
            poll_interval=poll,
            allowed_hosts=allowed_hosts,
            header_timeout=header_timeout,
            max_connections=max_connections,
        )


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        cli.main(args=argv, prog_name="stepmachine", standalone_mode=True)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0

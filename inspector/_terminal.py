"""The inspector's terminal output: session lists, conversations and audit logs, with rich.

Everything shown comes from the stored session, which is not trusted: text
is never interpreted as rich markup (it is always a :class:`rich.text.Text`),
and control characters (an ANSI escape in a tool result could move the
cursor, retitle the window or hide lines), bidirectional controls and
zero-width characters are shown escaped, ``\\x1b`` (:mod:`._visible`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any, Final

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._records import BUDGET, EVENT, MARK, SUMMARY, WAIT, describe
from ._view import MEDIA_TYPES, media_label
from ._visible import json_escaped, visible

__all__ = ["clean", "json_text", "print_log", "print_sessions", "print_show", "when"]

_STATUS_STYLE: Final = {
    "done": "green",
    "awaiting approval": "bold yellow",
    "awaiting event": "yellow",
    "budget exhausted": "bold red",
    "outcome unknown": "bold red",
    "idle": "dim",
}


def clean(text: object) -> str:
    """``text`` with control, bidirectional and zero-width characters shown escaped.

    Which characters, and how, is :mod:`._visible`'s (the HTML pages show the same).
    """
    return visible(text)


def json_text(value: Any, *, indent: int | None = None) -> str:
    """``value`` as strict JSON that is safe to print.

    Non-ASCII text stays readable, but the characters :func:`clean` escapes
    (C1 controls, line and paragraph separators, bidirectional and
    zero-width characters) are
    written as ``\\uXXXX`` escapes (JSON's own escapes already cover
    ``\\x00``-``\\x1f``), so neither a terminal nor a line-splitting reader
    sees them raw. The views hold no infinite or NaN number (JSON has neither:
    :func:`~._view.finite` turns them into ``None`` where a store can hold one).

    Raises:
        ValueError: ``value`` holds an infinite or NaN number.
    """
    text = json.dumps(value, ensure_ascii=False, indent=indent, allow_nan=False)
    return json_escaped(text)


def _text(value: object, style: str = "") -> Text:
    return Text(clean(value), style=style)


def when(timestamp: object) -> str:
    """A batch timestamp as UTC ISO 8601 to the second (``-`` when there is none)."""
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        return "-"
    try:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    except (OverflowError, OSError, ValueError):
        return clean(repr(timestamp))
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def print_sessions(console: Console, rows: Sequence[dict[str, Any]]) -> None:
    """A table of sessions: ``{"id", "revision", "last_activity", "status"}`` each."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("session", "revision", "last activity", "status"):
        table.add_column(column, justify="right" if column == "revision" else "left")
    for row in rows:
        table.add_row(
            _text(row["id"]),
            _text(row["revision"]),
            _text(when(row["last_activity"])),
            _text(row["status"], _STATUS_STYLE.get(str(row["status"]), "")),
        )
    console.print(table)


def _arguments(part: dict[str, Any]) -> str:
    try:
        return json.dumps(part["arguments"], ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return str(part.get("raw_arguments", ""))


def _call_lines(part: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[Text]:
    state = part.get("state", "")
    line = Text("  call ", style="cyan")
    line.append(clean(part["name"]), style="bold cyan")
    line.append(clean(f"({_arguments(part)})"))
    line.append(clean(f"  id {part['call_id']}"), style="dim")
    if state:
        line.append(f"  [{state}]", style=_STATE_STYLE.get(state, ""))
    lines = [line]
    for key, style in (("journal", "dim"), ("decision", "yellow")):
        record = part.get(key)
        if isinstance(record, dict):
            lines.append(_text(f"    {describe(record)}", style))
    result = results.get(str(part["call_id"]))
    if result is not None:
        style = "red" if result["is_error"] else "green"
        lines.append(_text(f"    -> {result['content']}", style))
    return lines


_STATE_STYLE: Final = {
    "answered": "green",
    "error": "red",
    "awaiting approval": "bold yellow",
    "outcome unknown": "bold red",
    "open": "yellow",
}
_ROLE_STYLE: Final = {
    "user": "bold blue",
    "assistant": "bold magenta",
    "system": "bold",
    "tool": "dim",
}


_SHOWN_RECORDS: Final = frozenset(
    {
        SUMMARY,
        MARK,
        BUDGET,
        EVENT,
        WAIT,
    }
)
"""Records shown under their message (calls show their journal and decision themselves)."""


def _record_line(record: dict[str, Any]) -> str | None:
    return describe(record) if record.get("record") in _SHOWN_RECORDS else None


def print_show(
    console: Console, view: dict[str, Any], *, model_view: bool = False, notes: bool = False
) -> None:
    """The conversation of a view: as stored (hidden messages marked) or as the model sees it."""
    title = Text()
    title.append(clean(view["id"]), style="bold")
    title.append(f"  revision {view['revision']}  ")
    title.append(clean(view["status"]), style=_STATUS_STYLE.get(str(view["status"]), ""))
    totals = view.get("totals") or {}
    title.append(
        f"  {totals.get('model_replies', 0)} model replies, "
        f"{totals.get('input_tokens', 0)} in / {totals.get('output_tokens', 0)} out tokens",
        style="dim",
    )
    console.print(title)
    results: dict[str, dict[str, Any]] = {}
    for message in view["messages"]:
        for part in message["parts"]:
            if part.get("type") == "tool_result":
                results.setdefault(str(part["call_id"]), part)
    for message in view["messages"]:
        if model_view and not message["visible_to_model"]:
            continue
        head = Text()
        head.append(clean(message["role"]), style=_ROLE_STYLE.get(str(message["role"]), ""))
        head.append(clean(f"  {message['id']}"), style="dim")
        if message.get("added_at") is not None:
            head.append(f"  rev {message['added_at']}", style="dim")
        if not message["visible_to_model"]:
            head.append("  [hidden from the model]", style="bold red")
        if not message["visible_to_user"]:
            head.append("  [hidden from the user]", style="red")
        usage = message.get("usage")
        if isinstance(usage, dict):
            head.append(
                clean(
                    f"  {message.get('model') or ''} {usage.get('input_tokens', 0)} in / "
                    f"{usage.get('output_tokens', 0)} out"
                ),
                style="dim",
            )
        console.print(head)
        for part in message["parts"]:
            kind = part.get("type")
            if kind == "text":
                console.print(_text(_indent(part["text"])))
            elif kind == "reasoning":
                console.print(_text(_indent(part["text"]), "dim italic"))
            elif kind == "tool_call":
                for line in _call_lines(part, results):
                    console.print(line)
            elif kind == "tool_result":
                call_id = str(part["call_id"])
                if message["role"] == "tool" and results.get(call_id) is part:
                    console.print(_text(f"  (the result of {call_id}, under its call)", "dim"))
                    continue
                style = "red" if part["is_error"] else ""
                console.print(_text(f"  result for {part['call_id']}: {part['content']}", style))
            elif kind in MEDIA_TYPES:
                console.print(_text(f"  [{media_label(part)}]", "cyan"))
            else:
                console.print(_text(f"  {json.dumps(part, ensure_ascii=False)}", "dim"))
        for record in message.get("records", []):
            said = _record_line(record)
            if said is not None:
                console.print(_text(f"  {said}", "yellow"))
        if notes and message.get("notes"):
            console.print(
                _text(_indent(json.dumps(message["notes"], indent=2, sort_keys=True)), "dim")
            )
    for problem in view.get("problems", []):
        console.print(
            _text(
                f"problem: {problem.get('kind')} at {problem.get('message_id')}: "
                f"{problem.get('detail')}",
                "bold red",
            )
        )


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in str(text).splitlines() or [""])


def print_log(console: Console, batches: Sequence[dict[str, Any]]) -> None:
    """The audit log: one line per batch (revision, step, cycle, time, effects, refusals)."""
    for batch in batches:
        line = Text()
        line.append(f"{batch['revision']:>5} ", style="bold")
        line.append(clean(batch["step"]), style="cyan")
        line.append(f" c{batch['cycle']} ", style="dim")
        line.append(when(batch["timestamp"]), style="dim")
        elapsed = batch.get("elapsed")
        if isinstance(elapsed, int | float):
            line.append(f" +{elapsed:.3f}s", style="dim")
        line.append("  ")
        line.append(clean(batch["summary"]))
        if batch["refused"]:
            refused = "; ".join(f"{r['step']}: {r['why']}" for r in batch["refused"])
            line.append(clean(f"  refused: {refused}"), style="dim yellow")
        console.print(line, soft_wrap=True)

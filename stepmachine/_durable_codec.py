"""What durable turns put in DBOS's tables: msgspec JSON, never pickle.

:class:`MsgspecSerializer` is DBOS's serializer hook (``DBOSConfig["serializer"]``)
with msgspec JSON; :func:`dbos_config` builds a config with it;
:class:`CycleSummary` and :class:`TurnReport` are what the steps and the turn
workflow return (as plain dictionaries); :class:`DurableTurnError` is an error
DBOS recorded, read back. Re-exported by :mod:`stepmachine.durable`, which
explains the whole design.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from typing import Any, Literal, cast

import msgspec
from dbos import DBOSConfig, Serializer

from ._errors import ConfigurationError, RunError

__all__ = [
    "SERIALIZER_NAME",
    "CycleSummary",
    "DurableTurnError",
    "MsgspecSerializer",
    "TurnReport",
    "check_serializer",
    "dbos_config",
]

SERIALIZER_NAME = "stepmachine.msgspec_json"
"""What DBOS records in its ``serialization`` column for values :class:`MsgspecSerializer` wrote."""

_ERROR_KEY = "stepmachine.error"


class DurableTurnError(RunError):
    """An exception DBOS recorded for a durable turn or step, read back from its tables.

    DBOS records the exception a step or workflow raised; :class:`MsgspecSerializer`
    keeps its type name and message (never the object), and reading the record
    gives this error.

    Attributes:
        error_type: the recorded exception's class name (``"ModelError"``, ...).
        message: its ``str()``.
    """

    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


class MsgspecSerializer(Serializer):
    """DBOS's serializer hook, with msgspec JSON instead of pickle.

    ``serialize`` encodes builtins and msgspec Structs (tuples become arrays;
    JSON has no NaN or infinity, and msgspec writes them as ``null``);
    an exception becomes ``{"stepmachine.error": {"type": ..., "message": ...}}``.
    ``deserialize`` decodes to builtins only (it constructs no class from the
    data), and such an error record to a :class:`DurableTurnError`.

    Raises (``serialize``): ``TypeError`` for a value msgspec cannot encode.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder()

    def serialize(self, data: Any) -> str:
        """``data`` as msgspec JSON text (an exception as its error record)."""
        if isinstance(data, BaseException):
            error_type = (
                data.error_type if isinstance(data, DurableTurnError) else type(data).__name__
            )
            message = data.message if isinstance(data, DurableTurnError) else str(data)
            data = {_ERROR_KEY: {"type": error_type, "message": message}}
        try:
            return self._encoder.encode(data).decode()
        except (TypeError, msgspec.EncodeError) as exc:
            raise TypeError(
                f"MsgspecSerializer encodes builtins and msgspec Structs, not {type(data)!r}: {exc}"
            ) from exc

    def deserialize(self, serialized_data: str) -> Any:
        """The builtins ``serialized_data`` holds (an error record as :class:`DurableTurnError`)."""
        value = self._decoder.decode(serialized_data)
        if isinstance(value, dict) and set(value) == {_ERROR_KEY}:
            record = value[_ERROR_KEY]
            if isinstance(record, dict):
                return DurableTurnError(str(record.get("type")), str(record.get("message")))
        return value

    def name(self) -> str:
        """:data:`SERIALIZER_NAME`."""
        return SERIALIZER_NAME


def dbos_config(
    name: str,
    system_database_url: str,
    *,
    executor_id: str | None = None,
    application_version: str | None = None,
    **options: Any,
) -> DBOSConfig:
    """A DBOS config for durable turns: ``DBOS(config=dbos_config(...))``.

    Args:
        name: the DBOS application name (workers and submitters of one
            application use the same).
        system_database_url: where DBOS keeps its tables, e.g. the store's
            PostgreSQL database (``postgresql://user@host/db``; DBOS uses the
            ``dbos`` schema, the store the ``stepmachine`` schema).
        executor_id: this process's executor id; stable per worker slot and
            never shared by two live processes (see the module docs). ``None``
            keeps DBOS's default (``DBOS__VMID``, else ``"local"``).
        application_version: the version DBOS recovers and dequeues workflows
            for; ``None`` lets DBOS hash the registered workflows' source.
        options: any other :class:`dbos.DBOSConfig` key.

    Returns:
        The config, with :class:`MsgspecSerializer` as its serializer.

    Raises:
        ConfigurationError: ``options`` names another serializer; or
            ``system_database_url`` is an SQLite database and DBOS cannot
            create its tables there with this Python (on Python 3.12 and
            later, DBOS needs a Python that links SQLite 3.42 or later).
    """
    given = options.pop("serializer", None)
    if given is not None and not isinstance(given, MsgspecSerializer):
        raise ConfigurationError(
            f"durable turns serialize with msgspec (MsgspecSerializer), not {given!r}"
        )
    problem = _sqlite_system_database_problem(system_database_url)
    if problem is not None:
        raise ConfigurationError(problem)
    config: dict[str, Any] = {
        **options,
        "name": name,
        "system_database_url": system_database_url,
        "serializer": MsgspecSerializer(),
    }
    if executor_id is not None:
        config["executor_id"] = executor_id
    if application_version is not None:
        config["application_version"] = application_version
    return cast(DBOSConfig, config)  # the keys are DBOSConfig's own


def _sqlite_system_database_problem(url: str) -> str | None:
    """Why DBOS cannot keep its tables in the SQLite database ``url`` here, or ``None``.

    DBOS's SQLite tables give their timestamps a default expression (DBOS's
    own for this Python), and its launch inserts rows that rely on it. On
    Python 3.12 and later, DBOS 3.4 uses ``unixepoch('subsec')``, which SQLite
    evaluates only from version 3.42: with an older SQLite linked into Python
    (Debian 12 ships 3.40) the default is NULL and ``DBOS.launch()`` fails on
    a ``NOT NULL`` constraint.
    The expression is evaluated here, on the SQLite this Python links, so a
    DBOS or SQLite that gets it right passes. Any other URL (PostgreSQL) is
    ``None``, and so is a DBOS that no longer names the expression.
    """
    if not url.startswith("sqlite"):
        return None
    try:
        from dbos._migration import get_sqlite_timestamp_expr  # noqa: PLC0415
    except ImportError:  # another DBOS release: nothing known to check
        return None
    timestamp = get_sqlite_timestamp_expr()
    with closing(sqlite3.connect(":memory:")) as connection:
        try:
            value = connection.execute(f"SELECT {timestamp}").fetchone()[0]
        except sqlite3.Error:
            value = None
    if value is not None:
        return None
    why = " (the 'subsec' modifier needs SQLite 3.42 or later)" if "subsec" in timestamp else ""
    return (
        f"DBOS cannot keep its tables in an SQLite system database ({url}) with this "
        f"Python: its timestamps default to {timestamp}, which SQLite "
        f"{sqlite3.sqlite_version} (the one this Python links) does not evaluate{why}, so "
        "DBOS's launch would fail. Use a PostgreSQL system database (postgresql://...), or a "
        "Python that links SQLite 3.42 or later (or Python 3.11, for which DBOS uses another "
        "expression)"
    )


class CycleSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What one cycle step did, as DBOS records it.

    Attributes:
        cycle: the cycle's number in its turn (1, 2, ...).
        revision: the session's revision after the cycle.
        status: ``"continue"`` (a step applied and continued), ``"yielded"``
            (a step yielded) or ``"idle"`` (no step applied).
        step: the name of the step that applied (``""`` when idle).
        reason: the yield reason's kind (``"done"``, ``"idle"``,
            ``"call_held"``, ...); ``""`` for ``"continue"``.
        conflicts: compare-and-set conflicts the cycle reloaded after.
    """

    cycle: int
    revision: int
    status: Literal["continue", "yielded", "idle"]
    step: str = ""
    reason: str = ""
    conflicts: int = 0


class TurnReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a durable turn did: the workflow's result.

    Attributes:
        session_id: the session.
        start_revision: its revision when the turn started.
        revision: its revision when the turn ended.
        reason: why the turn ended: the last cycle's reason, or ``"cycle_limit"``.
        cycles: the cycles, in order.
    """

    session_id: str
    start_revision: int
    revision: int
    reason: str
    cycles: tuple[CycleSummary, ...] = ()

    @classmethod
    def from_output(cls, value: object) -> TurnReport:
        """The report from a turn workflow's output as DBOS returns it (a dict), or itself.

        Raises:
            msgspec.ValidationError: ``value`` is not a turn's output.
        """
        return value if isinstance(value, TurnReport) else msgspec.convert(value, cls)


def check_serializer() -> None:
    """Refuse a DBOS whose serializer is not msgspec (it would pickle)."""
    from dbos import _dbos  # noqa: PLC0415 - DBOS keeps its instance there; no public accessor

    instance = getattr(_dbos, "_dbos_global_instance", None)
    if instance is None:
        raise ConfigurationError(
            "DurableMachine.launch() needs DBOS(config=stepmachine.durable.dbos_config(...)) first"
        )
    serializer = getattr(instance, "_serializer", None)
    if serializer is not None and not isinstance(serializer, MsgspecSerializer):
        raise ConfigurationError(
            f"DBOS is configured with {type(serializer).__name__} ({serializer.name()!r}), "
            "which pickles; durable turns serialize with msgspec: build the config with "
            "stepmachine.durable.dbos_config(...)"
        )

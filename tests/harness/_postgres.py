"""A PostgreSQL server for tests and harnesses (not a test module).

:func:`postgres_server` yields the DSN of a server the caller may create databases in:

- the value of ``STEPMACHINE_TEST_POSTGRES`` when it is set (any libpq DSN, URI or
  ``key=value``; the server is the caller's and is left running);
- otherwise a throwaway server started here: ``initdb`` in a new temporary folder,
  ``pg_ctl start -w`` listening on a free port of 127.0.0.1 only, its unix socket in
  that folder, trust authentication (loopback and the private socket only). On exit
  it is stopped (``pg_ctl stop -m fast``) and the folder removed. A process killed
  with SIGKILL leaves the server running: stop it with
  ``pg_ctl -D /tmp/stepmachine-pg-*/data stop``.

initdb refuses to run as root. Run as root, every server command runs as the
``postgres`` system user (``runuser -u postgres --``, else ``su``), which owns the
temporary folder; run as any other user, the commands run as that user.

The binaries are found on ``PATH`` (``initdb`` and ``pg_ctl`` together), then in
``pg_config --bindir``, then in ``/usr/lib/postgresql/<version>/bin`` (newest first),
the layout of Debian's packages. :func:`unavailable_reason` says, without starting
anything, why no server can be started here (``None`` when one can);
:class:`PostgresUnavailable` carries that reason when :func:`postgres_server` is
asked anyway. A server that can be started but fails to start raises
:class:`RuntimeError` with the tail of its log: a broken start is a failure, not a skip.

:func:`fresh_database` creates a database (a copy of ``template1``) and yields its
DSN, dropping it afterwards (``WITH (FORCE)``: connections left open are ended);
it needs psycopg (the ``postgres`` extra).

The server settings favour speed: ``fsync=off`` and ``full_page_writes=off`` (a
client killed with SIGKILL loses nothing acknowledged; only a crash of the server
machine would); ``postgres_server(durable=True)`` keeps PostgreSQL's defaults, for
benchmarks. The harness scripts import this file by name (``tests/harness`` is on
``sys.path`` both for pytest and for a script in that folder).

Run as a script::

    python tests/harness/_postgres.py check    # prints where the binaries are, or why not (exit 1)
    python tests/harness/_postgres.py serve    # starts a server, prints its DSN, waits for Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "ENV_VAR",
    "PostgresUnavailable",
    "Restarter",
    "Server",
    "find_bindir",
    "fresh_database",
    "postgres_server",
    "restart",
    "throwaway_server",
    "unavailable_reason",
    "with_database",
]

ENV_VAR = "STEPMACHINE_TEST_POSTGRES"
SERVER_USER = "postgres"
DEBIAN_BINDIRS = "/usr/lib/postgresql"
INITDB_OPTIONS = ("-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections


class PostgresUnavailable(Exception):  # noqa: N818 - it names a state, like FileNotFoundError
    """No PostgreSQL server can be started here; ``str()`` says why."""


def find_bindir(path: str | None = None, debian_root: str = DEBIAN_BINDIRS) -> Path | None:
    """The folder holding ``initdb`` and ``pg_ctl``, or ``None``.

    Looks on ``path`` (default: ``$PATH``), then in ``pg_config --bindir``, then in
    ``<debian_root>/<version>/bin`` with the highest version first.
    """
    initdb = shutil.which("initdb", path=path)
    if initdb is not None and shutil.which("pg_ctl", path=path) is not None:
        return Path(initdb).resolve().parent
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config", path=path)
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            ).stdout.strip()
            candidates.append(Path(out))
    versions = sorted(
        (p for p in Path(debian_root).glob("*/bin")),
        key=lambda p: _version_key(p.parent.name),
        reverse=True,
    )
    candidates.extend(versions)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    return None


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in name.split("."))


def unavailable_reason(
    environ: Mapping[str, str] | None = None,
    *,
    debian_root: str = DEBIAN_BINDIRS,
    euid: int | None = None,
    server_user: str = SERVER_USER,
) -> str | None:
    """Why :func:`postgres_server` cannot give a server here, or ``None`` when it can.

    ``None`` at once when ``STEPMACHINE_TEST_POSTGRES`` is set in ``environ``
    (default: ``os.environ``). Otherwise the binaries must be found
    (:func:`find_bindir` with ``environ["PATH"]``) and, run as root (``euid``,
    default: this process's), the ``server_user`` system user must exist, with
    ``runuser`` or ``su`` to switch to it. Starts nothing.
    """
    env = os.environ if environ is None else environ
    if env.get(ENV_VAR):
        return None
    path = env.get("PATH", os.defpath)
    if find_bindir(path, debian_root) is None:
        return (
            f"no PostgreSQL server binaries (initdb and pg_ctl) on PATH, in pg_config --bindir "
            f"or in {debian_root}/*/bin; install PostgreSQL (Debian: apt-get install "
            f"postgresql) or set {ENV_VAR} to the DSN of a server"
        )
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    try:
        pwd.getpwnam(server_user)
    except KeyError:
        return (
            f"running as root, which initdb refuses, and there is no {server_user!r} system "
            f"user to run the server as: run the tests as another user or set {ENV_VAR}"
        )
    if shutil.which("runuser", path=path) is None and shutil.which("su", path=path) is None:
        return f"running as root, and neither runuser nor su is on PATH to become {server_user!r}"
    return None


@dataclass(frozen=True)
class Server:
    """A throwaway server: its DSN (database ``postgres``), port and temporary folder.

    ``bindir``, ``data`` and ``as_other`` are what :func:`restart` needs.
    """

    dsn: str
    port: int
    folder: Path
    bindir: Path = Path()
    data: Path = Path()
    as_other: bool = False


def restart(server: Server, mode: str = "fast") -> None:
    """Restart ``server`` (``pg_ctl restart -m <mode> -w``) on the same port and settings.

    ``fast``: sessions are ended (their clients get ``AdminShutdown``) and the
    server shuts down cleanly; ``immediate``: the server's processes quit at once
    and the restart recovers from its write-ahead log, as after a crash. Every
    pooled connection of every client dies either way. Returns once the server
    accepts connections again.

    Raises:
        ValueError: ``mode`` is not ``fast`` or ``immediate``.
        RuntimeError: ``pg_ctl`` failed (with the tail of its log).
    """
    if mode not in ("fast", "immediate"):
        raise ValueError(f"restart mode is 'fast' or 'immediate', not {mode!r}")
    _run(
        server.bindir / "pg_ctl",
        [
            "-D",
            str(server.data),
            "-l",
            str(server.folder / "server.log"),
            "-m",
            mode,
            "-w",
            "-t",
            str(START_TIMEOUT),
            "restart",
        ],
        as_other=server.as_other,
        log=server.folder / "pg_ctl.log",
    )


@contextlib.contextmanager
def postgres_server(*, durable: bool = False) -> Iterator[str]:
    """Yield a DSN of a server (database ``postgres``) where databases may be created.

    Raises :class:`PostgresUnavailable` (before starting anything) when
    :func:`unavailable_reason` gives a reason; :class:`RuntimeError` when the server
    does not start. See the module docstring for what is started and removed.
    """
    given = os.environ.get(ENV_VAR)
    if given:
        yield given
        return
    reason = unavailable_reason()
    if reason is not None:
        raise PostgresUnavailable(reason)
    with throwaway_server(durable=durable) as server:
        yield server.dsn


@contextlib.contextmanager
def throwaway_server(*, durable: bool = False) -> Iterator[Server]:
    """Start a server of our own (even when ``STEPMACHINE_TEST_POSTGRES`` is set); stop it.

    Raises :class:`PostgresUnavailable` when the binaries are not found, and
    :class:`RuntimeError` when a command fails. On exit the server is stopped and its
    folder removed, whatever the body raised.
    """
    reason = unavailable_reason({k: v for k, v in os.environ.items() if k != ENV_VAR})
    if reason is not None:
        raise PostgresUnavailable(reason)
    bindir = find_bindir()
    assert bindir is not None  # unavailable_reason found it
    as_other = os.geteuid() == 0
    base = "/tmp" if os.path.isdir("/tmp") else None  # short socket path; postgres can traverse it
    folder = Path(tempfile.mkdtemp(prefix="stepmachine-pg-", dir=base))
    try:
        if as_other:
            user = pwd.getpwnam(SERVER_USER)
            os.chown(folder, user.pw_uid, user.pw_gid)
        data = folder / "data"
        _run(
            bindir / "initdb",
            ["-D", str(data), *INITDB_OPTIONS],
            as_other=as_other,
            log=folder / "initdb.log",
        )
        settings = ["-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={folder}"]
        if not durable:
            settings += ["-c", "fsync=off", "-c", "full_page_writes=off"]
        port = _start(bindir, data, folder, settings, as_other=as_other)
        try:
            dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
            yield Server(dsn, port, folder, bindir, data, as_other)
        finally:
            _stop(bindir, data, as_other=as_other)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start(bindir: Path, data: Path, folder: Path, settings: list[str], *, as_other: bool) -> int:
    """Start on a free port; retry with another port if one was taken in between."""
    log = folder / "server.log"
    for attempt in range(3):
        port = _free_port()
        options = " ".join([*settings, "-c", f"port={port}"])
        wait = ["-w", "-t", str(START_TIMEOUT)]
        try:
            _run(
                bindir / "pg_ctl",
                ["-D", str(data), "-l", str(log), "-o", options, *wait, "start"],
                as_other=as_other,
                log=folder / "pg_ctl.log",
            )
        except RuntimeError:
            if attempt == 2 or "could not bind" not in _tail(log):
                raise
            continue
        return port
    raise AssertionError("unreachable")  # pragma: no cover


def _stop(bindir: Path, data: Path, *, as_other: bool) -> None:
    try:
        _run(bindir / "pg_ctl", ["-D", str(data), "-m", "fast", "-w", "stop"], as_other=as_other)
    except RuntimeError:
        _run(
            bindir / "pg_ctl", ["-D", str(data), "-m", "immediate", "-w", "stop"], as_other=as_other
        )


def _run(program: Path, args: Sequence[str], *, as_other: bool, log: Path | None = None) -> None:
    """Run a server command (as the ``postgres`` user when ``as_other``); raise with its output."""
    command = [str(program), *args]
    if as_other:
        if shutil.which("runuser") is not None:
            command = ["runuser", "-u", SERVER_USER, "--", *command]
        else:
            command = ["su", SERVER_USER, "-s", "/bin/sh", "-c", shlex.join(command)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        timeout=START_TIMEOUT + 30,
        stdin=subprocess.DEVNULL,
        cwd="/",
    )
    output = done.stdout + done.stderr
    if log is not None:
        with contextlib.suppress(OSError):
            log.write_text(output)
    if done.returncode != 0:
        server_log = Path(args[args.index("-l") + 1]) if "-l" in args else None
        extra = f"\nserver log:\n{_tail(server_log)}" if server_log is not None else ""
        raise RuntimeError(
            f"{program.name} exited {done.returncode}: {' '.join(command)}\n{output[-2000:]}{extra}"
        )


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Restarter:
    """Restarts a throwaway server in a background thread, on a schedule (harnesses).

    ``schedule`` is a list of ``(seconds after start(), mode)``; each restart
    runs :func:`restart` and appends ``(mode, seconds it took)`` to ``done``,
    or a failure to ``errors``. :meth:`join` waits for the schedule to end.
    """

    def __init__(self, server: Server, schedule: Sequence[tuple[float, str]]) -> None:
        self.server = server
        self.schedule = sorted(schedule)
        self.done: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="pg-restarter", daemon=True)
        self._stop = threading.Event()
        self.started = False

    def start(self) -> None:
        """Start the schedule's clock (and thread)."""
        self._began = time.monotonic()
        self.started = True
        self._thread.start()

    def _run(self) -> None:
        for at, mode in self.schedule:
            if self._stop.wait(max(0.0, self._began + at - time.monotonic())):
                return
            began = time.monotonic()
            try:
                restart(self.server, mode)
            except Exception as exc:
                self.errors.append(f"pg_ctl restart -m {mode}: {exc}")
            else:
                self.done.append((mode, time.monotonic() - began))

    @property
    def finished(self) -> bool:
        """Every scheduled restart was made (or failed)."""
        return len(self.done) + len(self.errors) == len(self.schedule)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the schedule to end (at most ``timeout`` seconds)."""
        self._thread.join(timeout)

    def stop(self) -> None:
        """Skip the restarts not made yet, and wait for one under way."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def with_database(dsn: str, name: str) -> str:
    """``dsn`` with its database replaced by ``name`` (URIs stay URIs). Needs psycopg."""
    if dsn.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(dsn)
        return urlunsplit(parts._replace(path="/" + name))
    from psycopg.conninfo import make_conninfo

    return make_conninfo(dsn, dbname=name)  # raises on a malformed DSN


@contextlib.contextmanager
def fresh_database(server_dsn: str, *, prefix: str = "stepmachine_test") -> Iterator[str]:
    """Create an empty database on the server of ``server_dsn``; yield its DSN; drop it.

    The copy of ``template1`` takes milliseconds. On exit the database is dropped
    ``WITH (FORCE)``, ending connections still open on it. Needs psycopg.
    """
    import psycopg
    from psycopg import sql

    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template1").format(sql.Identifier(name)))
    try:
        yield with_database(server_dsn, name)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def main(argv: Sequence[str]) -> int:
    command = argv[0] if argv else ""
    if command == "check":
        reason = unavailable_reason()
        if reason is not None:
            print(reason)
            return 1
        print(f"{ENV_VAR} is set" if os.environ.get(ENV_VAR) else find_bindir())
        return 0
    if command == "serve":
        with postgres_server() as dsn:
            print(dsn, flush=True)
            # Blocked only now: the server must not inherit a mask that ignores pg_ctl stop.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

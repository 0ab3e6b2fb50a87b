"""The inspector on the demo's database: list, show, log, check, approve and export sessions.

    python examples/inspector.py [--db PATH]   (the extra cli: pip install 'stepmachine[cli]')

(Not ``inspect.py``: a script's folder comes first on ``sys.path``, and a
file named like a standard-library module hides it from every example here.)

Uses the database of ``python3 dev.py demo`` (``demo-data/hello_world.sqlite3``;
it runs the demo first when there is none), adds a session that waits for an
approval (``examples/approval.py start``), and then runs the ``stepmachine``
command on it, as a user would in a shell, printing each command and what it
printed:

- ``sessions list``: every session with its revision, last activity and status;
- ``show`` and ``log``: a conversation, and its audit log (which step applied
  in each cycle, and which refused, and why);
- ``fsck``: history problems (none here; the exit status says so);
- ``approve``: the pending payment, from the command line; then
  ``approval.py resume`` runs the agent again and it pays;
- ``export --html``: the payment session's timeline, one self-contained file
  to open in a browser.

The store is named once, in ``STEPMACHINE_STORE``. ``stepmachine serve`` (the
extra ``web``) shows the same timelines live in a browser.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def sh(*args: str, env: dict[str, str], quiet: bool = False) -> str:
    """Run ``stepmachine ARGS`` (as ``python -m stepmachine``); print the command and its output."""
    print(f"$ stepmachine {' '.join(args)}")
    done = subprocess.run(  # noqa: S603 - this interpreter, the stepmachine command
        [sys.executable, "-m", "stepmachine", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    print("(JSON, read by this script)" if quiet else done.stdout.rstrip() or "(no output)")
    if done.returncode != 0:
        print(f"(exit status {done.returncode}) {done.stderr.strip()}")
        raise SystemExit(done.returncode)
    print()
    return done.stdout


def example(name: str, *args: str) -> str:
    """Run another example (this interpreter), return what it printed."""
    done = subprocess.run(  # noqa: S603 - an example beside this one
        [sys.executable, str(HERE / name), *args], capture_output=True, text=True, check=True
    )
    return done.stdout


def main(db: Path) -> None:
    if not db.exists():
        print(f"no database at {db}: running the demo first\n")
        example("hello_world.py", "--db", str(db))
    started = example("approval.py", "start", "--db", str(db))
    payment = next(
        line.split(": ", 1)[1] for line in started.splitlines() if line.startswith("session: ")
    )
    env = {**os.environ, "STEPMACHINE_STORE": f"sqlite:///{db}"}
    print(f"STEPMACHINE_STORE={env['STEPMACHINE_STORE']}\n")

    listed = sh("sessions", "list", "--json", env=env, quiet=True)
    hello = next(
        row["id"]
        for row in map(json.loads, listed.splitlines())
        if row["id"].startswith("hello-") and row["status"] == "done"
    )
    sh("sessions", "list", env=env)
    sh("show", hello, env=env)
    sh("log", hello, env=env)
    sh("fsck", env=env)

    view = json.loads(sh("show", payment, "--json", env=env, quiet=True))
    (pending,) = [
        part
        for message in view["messages"]
        for part in message["parts"]
        if part.get("state") == "awaiting approval"
    ]
    sh("approve", payment, pending["call_id"], "--by", "you", "--why", "invoice checked", env=env)
    print(f"$ python examples/approval.py resume --db {db} --session {payment}")
    print(example("approval.py", "resume", "--db", str(db), "--session", payment))
    sh("log", payment, env=env)
    html = db.parent / f"{payment}.html"
    sh("export", payment, "--html", str(html), env=env)
    print(f"open {html.resolve().as_uri()} in a browser (no network needed), or watch live:")
    print(f"  python -m stepmachine serve sqlite:///{db}   (extra web)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=Path("demo-data") / "hello_world.sqlite3")
    main(parser.parse_args().db)

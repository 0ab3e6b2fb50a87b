"""``python -m stepmachine``: the inspector's command line (extra ``cli``).

Also the ``stepmachine`` console script. Without the extra it says which one
to install and exits with status 1.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Run ``stepmachine`` with the process's arguments; returns the exit status."""
    try:
        import click  # noqa: F401, PLC0415 - only to know the extra is installed
        import rich  # noqa: F401, PLC0415
    except ImportError as exc:
        print(  # noqa: T201 - the command's own message
            f"the stepmachine command needs the extra cli ({exc.name} is missing): "
            "pip install 'stepmachine[cli]'",
            file=sys.stderr,
        )
        return 1
    from stepmachine.inspector._cli import main as run  # noqa: PLC0415 - after the check

    return run(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())

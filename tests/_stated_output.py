"""What a documentation block says it prints: shared by the README and docs tests.

A ``print(...)  # text`` line states one output line; when every ``print``
line of a block carries one, the block must print exactly those lines, in
order, ``...`` matching anything.
"""

from __future__ import annotations

import re

PRINT = re.compile(r"^\s*print\(.*\)\s*#\s*(?P<expected>.+?)\s*$")


def expected_output(code: str) -> list[str] | None:
    """The stated output lines, or None when some ``print`` line states nothing."""
    prints = [line for line in code.splitlines() if re.match(r"^\s*print\(", line)]
    matches = [PRINT.match(line) for line in prints]
    if not prints or not all(matches):
        return None
    return [m.group("expected") for m in matches if m]


def output_problem(stdout: str, expected: list[str]) -> str | None:
    """What is wrong with ``stdout`` against the stated lines, or None."""
    lines = stdout.splitlines()
    patterns = [re.escape(e).replace(re.escape("..."), ".*") for e in expected]
    if len(lines) != len(patterns):
        return f"printed {len(lines)} lines, the block states {len(patterns)}"
    for number, (got, pattern) in enumerate(zip(lines, patterns, strict=True), 1):
        if not re.fullmatch(pattern, got):
            return f"output line {number}: {got!r} does not match {expected[number - 1]!r}"
    return None

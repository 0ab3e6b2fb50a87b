"""Root conftest: every async test runs on asyncio AND trio.

The anyio pytest plugin (shipped inside anyio) runs in auto mode
(``anyio_mode = "auto"`` in pyproject.toml): every ``async def`` test runs
once per value of the ``anyio_backend`` fixture. Pinning both backends here,
and importing trio unconditionally, means a missing trio fails the run
instead of silently dropping the trio variants.
"""

from __future__ import annotations

import pytest
import trio  # noqa: F401 - fail loudly if trio is missing: its variants must not vanish


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Both backends, for every async test."""
    return str(request.param)

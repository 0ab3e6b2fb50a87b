"""PostgresStore's leases: the lease conformance suite on a real PostgreSQL server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepmachine import Codec
from stepmachine.stores import PostgresStore
from stepmachine.testing.leases import LeaseConformance

pytest.importorskip("psycopg", reason="psycopg is not installed (the postgres extra)")


class TestPostgresStoreLeases(LeaseConformance):
    @pytest.fixture(autouse=True)
    def _dsn(self, postgres_dsn: str) -> None:
        self.dsn = postgres_dsn

    async def make_store(self, codec: Codec[Any], path: Path) -> PostgresStore:
        return await PostgresStore.open(self.dsn, codec)

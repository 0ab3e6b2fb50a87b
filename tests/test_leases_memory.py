"""MemoryStore's leases pass the lease conformance suite."""

from pathlib import Path
from typing import Any

from stepmachine import Codec
from stepmachine.stores import MemoryStore
from stepmachine.testing.leases import LeaseConformance


class TestMemoryStoreLeases(LeaseConformance):
    def make_store(self, codec: Codec[Any], path: Path) -> MemoryStore:
        return MemoryStore(codec=codec)


class TestMemoryStoreExpiringLeases(LeaseConformance):
    def make_store(self, codec: Codec[Any], path: Path) -> MemoryStore:
        return MemoryStore(codec=codec, expiring_leases=True)

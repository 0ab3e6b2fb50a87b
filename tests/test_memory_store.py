"""MemoryStore passes the store conformance suite (and nothing more is special)."""

from stepmachine.stores import MemoryStore
from stepmachine.testing.conformance import StoreConformance


class TestMemoryStore(StoreConformance):
    def make_store(self, codec, path):  # type: ignore[no-untyped-def]
        return MemoryStore(codec)

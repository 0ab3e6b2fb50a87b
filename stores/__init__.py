"""Stores: where sessions and their effect logs live.

Every store implements :class:`stepmachine.SessionLoader` and
:class:`stepmachine.EffectHandler` (compare-and-set, atomic batches) and the
management API of :class:`stepmachine.Store`, and passes the store
conformance suite in :mod:`stepmachine.testing.conformance`.

- :class:`MemoryStore`: in process, for tests and short-lived agents.
"""

from ._memory import MemoryStore

__all__ = ["MemoryStore"]

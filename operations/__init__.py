"""Built-in operations, installed as ``stepmachine.operations``.

The kernel ships the :class:`~stepmachine.Tools` operation and the
:class:`~stepmachine.ModelInference` step. Policy operations (tool journal,
approval, compaction, budgets, invalid-call recovery, external events,
structured output, history guard) live here as they land.
"""

__all__: list[str] = []

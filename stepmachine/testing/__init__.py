"""The testing kit: fakes, not mocks.

- :class:`ScriptedModel` and :class:`FunctionModel`: models with no network.
- :func:`run_step`: run ONE step against a session value, no store needed.
- :func:`make_session`, :func:`reply`, :func:`call`: build inputs quickly.
- :mod:`stepmachine.testing.conformance`: the store conformance suite (it
  imports pytest, so it is a separate module).
"""

from stepmachine._public import publish as _publish

from ._harness import StepCheck, make_session, run_step
from ._models import FunctionModel, ScriptedModel, call, reply, stream_response

__all__ = [
    "FunctionModel",
    "ScriptedModel",
    "StepCheck",
    "call",
    "make_session",
    "reply",
    "run_step",
    "stream_response",
]

_publish(__name__, globals())

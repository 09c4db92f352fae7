"""A DALI graph defined without DALI's record of each operator's Python stack: the adapter to DALI's private switch
(``nvidia.dali._utils.dali_trace``), the only module that touches it.

While a graph is defined, DALI records, for every operator, the Python stack that made it
(``traceback.extract_stack`` and ``linecache``'s ``stat`` of each file on it), for an error at run time to name the
line of the graph's definition. The Loader names a failed batch itself in one line (:func:`fastio.errors.dali_reason`:
the operator and what DALI said, which DALI's message holds either way), so for the graphs of fastio's own kinds the
record is never read; it cost ~1.6 ms of the ~8 ms of Python a build takes on the way to the first batch (issue 45).
A graph a user writes (:class:`fastio.Graph`, a kind of their own) keeps it (:attr:`GraphDef.traced`). The switch is
DALI's, for the process: another thread defining a DALI graph of its own during such a build (milliseconds) gets no
record either (its errors still name the operator). Where DALI has no such switch the graph is built as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["untraced"]


@contextmanager
def untraced() -> Iterator[None]:
    """Define DALI graphs in the ``with`` body without recording each operator's stack; the switch is put back as it
    was after it. Callers hold the build lock (one build at a time in the process)."""
    try:
        from nvidia.dali._utils import dali_trace
        enabled = dali_trace.is_tracing_enabled()
    except (ImportError, AttributeError):  # another DALI: no such switch
        yield
        return
    dali_trace.set_tracing(enabled=False)
    try:
        yield
    finally:
        dali_trace.set_tracing(enabled=enabled)

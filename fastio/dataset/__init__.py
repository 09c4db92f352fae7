"""One dataset on disk: its manifest, sample table (``samples.fxi``), files (local or ``s3://``), the shard
writer, and ``Dataset`` (:mod:`fastio.dataset.dataset`).

``from fastio.dataset import Dataset`` (the documented import) is resolved lazily, so importing the package
imports nothing else.
"""

from __future__ import annotations

from fastio.lazy import lazy_exports

_LAZY = {"Dataset": "fastio.dataset.dataset"}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

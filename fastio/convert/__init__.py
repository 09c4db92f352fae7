"""Making datasets: ``convert`` (:mod:`fastio.convert.run`), ``merge``, parts, ``--split``, ``fastio index``
(:mod:`fastio.convert.wds_index`), token datasets (``--tokenizer``: :mod:`fastio.convert.token_convert`;
``fastio index --eos-id``: :mod:`fastio.convert.token_index`) and the synthetic inputs of demo, tests and bench.

``from fastio.convert import ConvertConfig, convert`` (the documented import) is resolved lazily from
:mod:`fastio.convert.run`, so importing the package imports nothing else.
"""

from __future__ import annotations

from fastio.lazy import lazy_exports

_LAZY = {"ConvertConfig": "fastio.convert.run", "convert": "fastio.convert.run"}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

"""fastio: a data layer for training on GPU clusters.

The public API is imported lazily, so that ``fastio convert`` and friends start without torch or DALI.
"""

from __future__ import annotations

from fastio.lazy import lazy_exports

__version__ = "0.1.0"

_LAZY = {
    "Dataset": "fastio.dataset.dataset",
    "ShardWriter": "fastio.dataset.shards",
    "convert": "fastio.convert",  # the subpackage (its convert, ConvertConfig): importing it binds the name anyway
    "index_shards": "fastio.convert.wds_index",
    "IndexConfig": "fastio.convert.wds_index",
    "Loader": "fastio.loader",
    "LoaderConfig": "fastio.loader",
    "Mixture": "fastio.read.mixture",
    "ImageTrain": "fastio.pipelines",
    "ImageEval": "fastio.pipelines",
    "Raw": "fastio.pipelines",
    "Graph": "fastio.pipelines",
    "VideoClips": "fastio.pipelines",
    "AudioClips": "fastio.pipelines",
    "Tokens": "fastio.pipelines",
    "ImageText": "fastio.pipelines",
    "Tokenize": "fastio.pipelines",
    "Pipeline": "fastio.pipelines",
    "order_quality": "fastio.report.inspect",
    "Checkpointer": "fastio.checkpoint",
    "CheckpointConfig": "fastio.checkpoint",
    "TrainState": "fastio.checkpoint",
    "exit_cleanly": "fastio.exits",
    "FastioError": "fastio.errors",
    "DatasetError": "fastio.errors",
    "ConvertError": "fastio.errors",
    "LoaderStateError": "fastio.errors",
    "LoaderArgumentError": "fastio.errors",
    "CheckpointError": "fastio.errors",
    "StorageError": "fastio.errors",
}

__all__ = ["__version__", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

"""Pipeline objects: one per kind of data, each owning its options, the fields it needs, its DALI graph (or
none) and how its batch is assembled (:mod:`fastio.pipelines.base` describes the interface the Loader uses: six
hooks; the image kinds' defaults are :class:`ImageKind`'s).

Built in: :class:`ImageTrain`, :class:`ImageEval`, :class:`Raw`, :class:`Graph` (a user's DALI graph),
:class:`Tokens` (packed token sequences), :class:`ImageText` (packed image-text sequences), and the clip kinds
:class:`VideoClips` and :class:`AudioClips`
(``media.py``).
"""

from __future__ import annotations

from fastio.pipelines.base import (
    BuiltPipeline,
    Delivery,
    FieldChoice,
    GraphDef,
    Pipeline,
    Placement,
    ReadFields,
    Source,
    build_graph,
    evaluation_of,
)
from fastio.pipelines.graph import Graph
from fastio.pipelines.image import IMAGENET_MEAN, IMAGENET_STD, ImageEval, ImageKind, ImageTrain, decodable
from fastio.pipelines.image_text import ImageText
from fastio.pipelines.media import AudioClips, VideoClips
from fastio.pipelines.raw import Raw
from fastio.pipelines.text import Tokenize
from fastio.pipelines.tokens import Tokens

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "AudioClips", "BuiltPipeline", "Delivery", "FieldChoice", "Graph",
           "GraphDef", "ImageEval", "ImageKind", "ImageText", "ImageTrain", "Pipeline", "Placement", "Raw", "ReadFields",
           "Source", "Tokenize", "Tokens", "VideoClips", "build_graph", "decodable", "evaluation_of"]

"""Describe a converted dataset (:func:`inspect`): counts, fields, classes, image sizes and, on request,
how well each shuffle mode of the Loader mixes it (:func:`order_quality`).

Accepts a dataset directory or a DEST written with ``split`` (holding ``splits.json``), in which case
each split is described. Sample bytes (labels, image headers) are read through
:class:`fastio.read.reader.Reader`; the order itself comes from the pure :func:`fastio.order.sampler.epoch_order`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from struct import error as struct_error
from typing import Any

import numpy as np

from fastio.dataset.dataset import Dataset
from fastio.dataset.files import dest_child, dest_split_names
from fastio.dataset.manifest import ImageTextInfo
from fastio.errors import DatasetError
from fastio.formats.image_text import is_image_text
from fastio.formats.images import image_size, is_image_field
from fastio.formats.media import CPU_VIDEO_CODECS
from fastio.formats.megatron import MegatronIndex
from fastio.order.sampler import SHUFFLE_MODES, epoch_order
from fastio.read.reader import Reader
from fastio.words import count

__all__ = ["inspect", "order_quality", "packing_report"]

_READ_BATCH = 256  # samples per Reader call while probing images (bounds the bytes held at once)


def inspect(dest: str | Path, *, max_images: int = 1000, order: bool = False, seed: int = 0, epoch: int = 0,
            batch_size: int = 256, block_shards: int = 4, cache_dir: str | Path | None = None,
            cache_size: int | str | None = None, storage_options: dict | None = None, seq_len: int = 2048,
            window: int = 4096) -> dict[str, Any]:
    """Samples, shards, bytes, fields (with how many samples have each), classes with counts, image
    formats (``image_formats``: how many samples have their image as ``jpg``, ``png``, ...; a sample's image
    is whichever image field it has) and image size statistics (headers of at most ``max_images`` evenly
    spaced images, whatever their format).

    With ``order``, also ``"order"``: one :func:`order_quality` result per shuffle mode for epoch
    ``epoch`` of a Loader with ``seed`` and ``block_shards``, in global batches of ``batch_size``
    (capped at the dataset size). ``skipped`` counts the inputs the conversion or index left out,
    ``skipped_inputs`` lists them (``{path, reason}``). An image-text dataset: also ``"image_text"``, its
    vocabulary (``vocab_size``, ``max_id``, ``embedding_size``, ``tokenizer_sha256``; None where not recorded). A
    token dataset: documents and tokens (its manifest's ``tokens`` entry, ``tokenizer_sha256`` among them where
    recorded) instead of fields and images, and with ``order`` its ``"packing"`` (:func:`packing_report`
    for ``seq_len`` and ``window``, as :class:`fastio.Tokens` packs it). For a split DEST: ``{"path", "splits":
    {name: <that dict>}}``.
    JSON-serialisable. ValueError names a bad parameter; DatasetError a bad DEST.

    An ``s3://`` DEST is read through the node-local cache (``cache_dir``, ``cache_size``, ``storage_options``
    as for :class:`fastio.Dataset`).
    """
    if max_images < 0:
        raise ValueError(f"max_images must be 0 or more, got {max_images}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    options = {"max_images": max_images, "order": order, "seed": seed, "epoch": epoch, "batch_size": batch_size,
               "block_shards": block_shards, "seq_len": seq_len, "window": window,
               "opening": {"cache_dir": cache_dir, "cache_size": cache_size, "storage_options": storage_options}}
    splits = dest_split_names(dest, storage_options)
    if splits is None:
        return _inspect_one(dest, **options)
    return {"path": str(dest), "splits": {name: _inspect_one(dest_child(dest, name), **options) for name in splits}}


def packing_report(ds: Dataset, seq_len: int, window: int) -> dict[str, Any]:
    """What packing token dataset ``ds`` into sequences of ``seq_len + 1`` tokens gives, per packing: ``concat``
    (sequences, tokens left out as the tail), ``best-fit`` and ``first-fit`` (sequences and padding fraction,
    each window of ``window`` documents packed on its own). From the ``.idx`` files; no ``.bin`` is read."""
    from fastio.tokens.loading import open_tables
    from fastio.tokens.packing import BestFitPacking, ConcatPacking

    tables = open_tables(ds)
    common = {"fingerprint": ds.fingerprint, "block_docs": window}
    concat = ConcatPacking(tables, seq_len, **common)
    out: dict[str, Any] = {"seq_len": seq_len, "window": window,
                           "concat": {"sequences": concat.sequences,
                                      "tail_tokens": concat.total_tokens - concat.sequences * seq_len}}
    for fit in ("best", "first"):
        packing = BestFitPacking(tables, seq_len, fit=fit, **common)
        out[f"{fit}-fit"] = {"sequences": packing.sequences, "padding_fraction": round(packing.padding_fraction, 6)}
    return out


def _inspect_tokens(ds: Dataset, order: bool, seq_len: int, window: int) -> dict[str, Any]:
    """A token dataset: documents, tokens, token type, end-of-document id, tokens per document (from the
    ``.idx`` files; no ``.bin`` is read); with ``order`` the packing report."""
    lengths = np.concatenate([np.diff(MegatronIndex(s.idx_path, ds.manifest.tokens.dtype).starts(
        np.arange(s.samples + 1))) for s in ds.shards] or [np.zeros(0, np.int64)])
    per_doc = ({"min": int(lengths.min()), "median": float(np.median(lengths)), "mean": round(float(lengths.mean()), 1),
                "max": int(lengths.max())} if lengths.size else None)
    return {"path": str(ds.root), "samples": len(ds), "shards": len(ds.shards),
            "bytes": sum(s.bytes for s in ds.shards), "fingerprint": ds.fingerprint, "source": ds.manifest.converted_from,
            "fields": {}, "skipped": len(ds.manifest.skipped or []), "skipped_inputs": ds.manifest.skipped or [],
            "tokens": {**ds.manifest.tokens.as_dict(), "per_document": per_doc},
            **({"packing": packing_report(ds, seq_len, window)} if order else {})}


def order_quality(shard_sizes: Sequence[int], labels: np.ndarray, *, seed: int = 0, epoch: int = 0,
                  mode: str = "global", batch_size: int = 256, block_shards: int = 4,
                  fingerprint: str = "external") -> dict[str, Any]:
    """How well the epoch order of ``mode`` mixes a dataset whose samples have ``labels`` (in manifest order).

    ``shard_sizes``, ``seed``, ``epoch``, ``block_shards`` and ``fingerprint`` (the dataset's, for the
    order a Loader really delivers) determine the order as :func:`fastio.order.sampler.epoch_order` does.

    Returns ``{"mode", "samples", "batch_size", "classes", "class_mixing", "class_mixing_ideal",
    "class_mixing_ratio", "mean_displacement", "mean_displacement_ideal"}``: class mixing is the mean
    number of distinct classes per batch (ideal: expected under a uniform random permutation); mean
    displacement is the mean ``|position - stored index| / N`` (about 1/3 for a uniform permutation).
    """
    labels = np.asarray(labels)
    order = epoch_order(list(shard_sizes), seed, epoch, fingerprint, mode, block_shards)
    n = len(order)
    if len(labels) != n:
        raise ValueError(f"labels has {count(len(labels), 'entry', 'entries')}, shard sizes add up to {n}")
    if batch_size < 1 or batch_size > n:
        raise ValueError(f"batch_size must be in 1..{n}, got {batch_size}")
    _, lab = np.unique(labels, return_inverse=True)
    lab = lab.reshape(-1)
    k = int(lab.max()) + 1 if n else 0
    full = n // batch_size
    per_batch = lab[order[: full * batch_size]].reshape(full, batch_size)
    counts = np.zeros((full, k), np.int64)
    np.add.at(counts, (np.repeat(np.arange(full), batch_size), per_batch.ravel()), 1)
    mixing = float((counts > 0).sum(1).mean())
    # Expected distinct classes in a batch drawn without replacement: sum_c 1 - C(N-n_c, B)/C(N, B).
    freq = np.bincount(lab, minlength=k)
    ideal = 0.0
    for n_c in freq:
        ratio = 1.0
        for j in range(batch_size):
            ratio *= max(n - n_c - j, 0) / (n - j)
            if ratio == 0.0:
                break
        ideal += 1.0 - ratio
    displacement = float(np.abs(np.arange(n) - order).mean() / n)
    return {
        "mode": mode, "samples": n, "batch_size": batch_size, "classes": k,
        "class_mixing": mixing, "class_mixing_ideal": ideal,
        "class_mixing_ratio": mixing / ideal if ideal else 1.0,
        "mean_displacement": displacement, "mean_displacement_ideal": (n * n - 1) / (3 * n * n),
    }


def _label_value(raw: bytes) -> int | str:
    text = raw.strip()
    return int(text) if text.lstrip(b"-").isdigit() else text.decode(errors="replace")


def _read(ds: Dataset, field: str, indices: np.ndarray) -> list[bytes]:
    """``field`` of samples ``indices``, in batches so that image probes hold little in memory."""
    out: list[bytes] = []
    with Reader(ds, [field], threads=1, files=ds.files.shard_files(ds.shards, read_ahead=0)) as reader:
        for start in range(0, len(indices), _READ_BATCH):
            out.extend(bytes(a) for a in reader.read(indices[start:start + _READ_BATCH])[field])
    return out


def _image_fields(ds: Dataset) -> list[str]:
    """The dataset's image fields, its main one first (the manifest's ``image_fields``, else by extension)."""
    listed = ds.manifest.image_fields or [f for f in ds.fields if is_image_field(f)]
    main = [ds.image_field] if ds.image_field in listed and ds.image_field in ds.table.offsets else []
    return main + sorted(f for f in listed if f not in main and f in ds.table.offsets)


def _size_or_none(data: bytes) -> tuple[int, int] | None:
    try:
        return image_size(data)
    except (ValueError, IndexError, struct_error):
        return None


def _stats(values: list[int]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "mean": round(statistics.fmean(values), 1),
            "median": statistics.median(values)}


def _label_classes(ds: Dataset, info: dict[str, Any]) -> list | None:
    """Put the label classes and their counts in ``info``; every sample's label (None: some sample has none)."""
    label, table = ds.label_field, ds.table
    if label not in table.offsets:
        return None
    have = np.flatnonzero(table.sizes[label] >= 0)
    values = [_label_value(raw) for raw in _read(ds, label, have)]
    names = {v: k for k, v in (ds.label_map or {}).items()}
    counts: dict[int | str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    classes = set(counts) | set(names)  # classes of the label map that no sample has count 0
    info["classes"] = [{"label": k, "name": names.get(k), "count": counts.get(k, 0)}
                       for k in sorted(classes, key=lambda v: (isinstance(v, str), v))]
    return values if len(have) == len(ds) else None  # not every sample has a label: no order statistics


def _image_info(ds: Dataset, max_images: int) -> dict[str, Any]:
    """``image_formats`` and ``image_sizes`` (up to ``max_images`` headers probed), or nothing without images."""
    image_fields, table = _image_fields(ds), ds.table
    if not image_fields:
        return {}
    # A sample's image is whichever image field it has (the main one first): datasets mix formats.
    which = np.full(len(ds), -1, np.int64)
    for k, f in enumerate(image_fields):
        which[(which < 0) & (table.sizes[f] >= 0)] = k
    have = np.flatnonzero(which >= 0)
    step = max(1, len(have) // max_images) if max_images > 0 else len(have) + 1
    probe = have[::step][:max_images]
    sizes = []
    for k, f in enumerate(image_fields):
        part = probe[which[probe] == k]
        if len(part):
            sizes += [s for s in (_size_or_none(data) for data in _read(ds, f, part)) if s is not None]
    nbytes = [int(table.sizes[image_fields[which[i]]][i]) for i in have.tolist()]
    return {"image_formats": {f: int((which == k).sum()) for k, f in enumerate(image_fields) if (which == k).any()},
            "image_sizes": {
                "field": ds.image_field or image_fields[0], "probed": len(probe),
                "unreadable": len(probe) - len(sizes), "width": _stats([w for w, _ in sizes]) if sizes else None,
                "height": _stats([h for _, h in sizes]) if sizes else None,
                "bytes": _stats(nbytes) if nbytes else None}}


def _videos(ds: Dataset) -> dict[str, Any]:
    """``{"videos": [{codec, count, cpu}]}`` from the manifest's count (``cpu``: DALI's CPU decoder reads it, else
    NVDEC on a GPU and PyAV on a CPU, ``VideoClips(cpu_fallback="auto")``), or nothing when it has none."""
    codecs = ds.manifest.video_codecs or {}
    return {"videos": [{"codec": c, "count": r["count"], "cpu": c in CPU_VIDEO_CODECS}
                       for c, r in sorted(codecs.items())]} if codecs else {}


def _image_text(ds: Dataset) -> dict[str, Any]:
    """An image-text dataset's ``{"image_text": {vocab_size, max_id, embedding_size, tokenizer_sha256}}`` (each None
    where not recorded), or nothing for another dataset."""
    if not is_image_text(ds.manifest.convert_options):
        return {}
    info = ds.manifest.image_text or ImageTextInfo()
    return {"image_text": {"vocab_size": info.vocab_size, "max_id": info.max_id,
                           "embedding_size": info.embedding_size, "tokenizer_sha256": ds.manifest.tokenizer_sha256}}


def _inspect_one(root: str | Path, *, max_images: int, order: bool, seed: int, epoch: int, batch_size: int,
                 block_shards: int, seq_len: int, window: int, opening: dict[str, Any]) -> dict[str, Any]:
    ds = Dataset(root, **opening)
    if ds.manifest.tokens is not None:
        return _inspect_tokens(ds, order, seq_len, window)
    table = ds.table
    n = len(ds)
    info: dict[str, Any] = {
        "path": str(root), "samples": n, "shards": len(ds.shards), "bytes": sum(s.bytes for s in ds.shards),
        "fingerprint": ds.fingerprint, "source": ds.manifest.converted_from,
        "fields": {f: int((table.sizes[f] >= 0).sum()) for f in ds.fields},
        "image_field": ds.image_field, "label_field": ds.label_field,
        "skipped": len(ds.manifest.skipped or []), "skipped_inputs": ds.manifest.skipped or [],
        **_videos(ds), **_image_text(ds),
    }
    label = ds.label_field
    values = _label_classes(ds, info)
    info.update(_image_info(ds, max_images))
    if order:
        if label is None:
            raise DatasetError(f"{root}: dataset has no label field; order quality needs labels")
        if values is None:
            why = "is missing on some samples" if label in table.offsets else "is not among the fields"
            raise DatasetError(f"{root}: order quality needs a label on every sample; label field {label!r} {why}")
        labels = np.array(values if all(isinstance(v, int) for v in values) else [str(v) for v in values])
        sizes_per_shard = [s.samples for s in ds.shards]
        info["order"] = [order_quality(sizes_per_shard, labels, seed=seed, epoch=epoch, mode=mode,
                                       batch_size=min(batch_size, n), block_shards=block_shards,
                                       fingerprint=ds.fingerprint) for mode in SHUFFLE_MODES]
    return info

"""Image-text samples (``fastio convert --image-field``, :mod:`fastio.formats.image_text`) packed into sequences as
the Loader's units, for :class:`fastio.ImageText`: their plan (:func:`image_text_packing`) and what reads them
(:class:`ImageTextReader`).

**The plan.** Each sample is one document of the best-fit packing of :mod:`fastio.tokens.packing` (the same
blocks, rule, order and sampler as ``fastio.Tokens(packing="best-fit")``), its length its cost in tokens once each
image token is expanded: ``len(tokens) - images + images * image_seq_len``. Costs come from ``samples.fxi`` alone
(``size:tokens.i32 / 4`` and the number of ``N.EXT`` image fields a sample has: :class:`SampleCosts`, one per
shard), so no shard is read to plan. A piece of the packing is a whole sample (one too long for ``seq_len + 1`` is
refused when the Loader is made, never cut); its "token offset" is the sum of the costs before it in its shard,
which :meth:`SampleCosts.samples` maps back to the sample. ``max_images`` is the packing's ``budget``: a sequence
holds at most that many images (a sample with more is refused), a sequence whose images are spent takes no more.

**The read.** A batch of sequence ids becomes the global indices of their samples, in row order, read by the read
set's stored-sample reader (:class:`fastio.read.reader.Reader`: ``tokens.i32``, ``mask.bits`` and every image field,
the image fields optional) in its threads; the reader thread that finishes the read also lays the sequences out
(:meth:`ImageTextReader.lay_out`: numpy over the whole batch, each image token repeated ``image_seq_len`` times,
the loss mask False on image tokens and padding) and collects the images in the order of their runs, each with its
header's (width, height) and its draw key (:func:`draw_keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastio.dataset.dataset import Dataset
from fastio.errors import DatasetError
from fastio.formats.image_text import (
    MASK_FIELD,
    TOKENS_FIELD,
    expanded_length,
    image_number,
    options_image_token_id,
)
from fastio.formats.images import image_size
from fastio.futures import gathered
from fastio.order.sampler import SamplerSpec
from fastio.tokens.packing import (
    BestFitPacking,
    cu_from,
    piece_bounds,
    piece_starts,
    positions_from,
    ramp,
    segment_ids,
)
from fastio.words import count

__all__ = ["IMAGE_KEY_BITS", "ImageTextBatch", "ImageTextReader", "ImageTextSource", "MixedReader", "SampleCosts",
           "draw_keys", "image_members", "image_text_packing", "image_token_id", "merged"]

IMAGE_KEY_BITS = 16
"""An image's draw key is ``(sample << IMAGE_KEY_BITS) | image number`` (:func:`draw_keys`): a sample holds at most
``2 ** IMAGE_KEY_BITS`` images."""
PAD_ID = 0
"""The token id of padding (``loss_mask`` False, ``segment_ids`` 0 there)."""


def image_token_id(ds: Dataset) -> int:
    """The image token's id an image-text dataset records (``convert_options.image_text.image_token_id``);
    DatasetError naming ``ds`` for any other dataset."""
    image_id = options_image_token_id(ds.manifest.convert_options)
    if ds.manifest.tokens is not None or image_id is None:
        what = "a token dataset" if ds.manifest.tokens is not None else f"a dataset of kind {ds.manifest.kind!r}"
        raise DatasetError(f"{ds.root}: {what}, not an image-text dataset (its manifest records no "
                           "convert_options.image_text): fastio.ImageText reads datasets of fastio convert "
                           "--image-field (docs/image-text.md)")
    return image_id


def image_members(ds: Dataset) -> tuple[str, ...]:
    """The image fields (``N.EXT``) of an image-text dataset, by number then name."""
    return tuple(sorted((f for f in ds.fields if image_number(f) is not None), key=lambda f: (image_number(f), f)))


def draw_keys(samples: np.ndarray, numbers: np.ndarray) -> np.ndarray:
    """Each image's draw key: its sample's global index shifted by :data:`IMAGE_KEY_BITS`, or'ed with its image
    number (what :func:`fastio.pipelines.augment.random_resized_crop` hashes with the seed and the epoch)."""
    return (np.asarray(samples, np.int64) << IMAGE_KEY_BITS) | np.asarray(numbers, np.int64)


class SampleCosts:
    """One shard's samples as the packing's documents (a :class:`~fastio.tokens.packing.DocumentTable`): each
    sample's cost (tokens with its images expanded) and images, from ``samples.fxi``'s sizes."""

    def __init__(self, tokens: np.ndarray, images: np.ndarray, image_seq_len: int):
        self.images = np.asarray(images, np.int64)
        self.lengths = expanded_length(np.asarray(tokens, np.int64), self.images, image_seq_len)
        self._ends = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.documents = int(self.lengths.size)

    @property
    def tokens(self) -> int:
        return int(self._ends[-1])

    def starts(self, docs: np.ndarray) -> np.ndarray:
        return self._ends[np.asarray(docs, np.int64)]

    def weights(self, docs: np.ndarray) -> np.ndarray:
        """The images of samples ``docs`` (the packing's budget counts them)."""
        return self.images[np.asarray(docs, np.int64)]

    def samples(self, starts: np.ndarray) -> np.ndarray:
        """The shard-local sample whose cost begins at each of ``starts`` (a piece's offset)."""
        return np.searchsorted(self._ends, starts, "right") - 1


def _shard_costs(ds: Dataset, image_seq_len: int) -> tuple[list[SampleCosts], list[tuple[int, str]]]:
    """Each shard's :class:`SampleCosts` (from the sample table's sizes, no shard read), and any sample without
    token members (global index, what it lacks)."""
    fields = image_members(ds)
    tables, bad = [], []
    for shard in ds.shards:
        rows = ds.locate(np.arange(shard.first, shard.first + shard.samples, dtype=np.int64))
        size = rows.sizes[TOKENS_FIELD] if TOKENS_FIELD in rows.sizes else np.full(shard.samples, -1)
        lacking = np.flatnonzero(size < 0)
        bad.extend((shard.first + int(j), TOKENS_FIELD) for j in lacking[:1])
        images = sum(((rows.sizes[f] >= 0).astype(np.int64) for f in fields), np.zeros(shard.samples, np.int64))
        tables.append(SampleCosts(np.maximum(size, 0) // 4, images, image_seq_len))
    return tables, bad


def _refuse_unpackable(ds: Dataset, tables: list[SampleCosts], seq_len: int, image_seq_len: int,
                       max_images: int | None) -> None:
    """DatasetError naming the first sample that cannot be packed whole: longer than ``seq_len + 1`` with its
    images expanded, or with more than ``max_images`` images."""
    costs = np.concatenate([t.lengths for t in tables])
    images = np.concatenate([t.images for t in tables])
    long = np.flatnonzero(costs > seq_len + 1)
    if long.size:
        i = int(long[0])
        raise DatasetError(f"{ds.where(i)}: {count(int(costs[i]), 'token')} with its {count(int(images[i]), 'image')} "
                           f"expanded to image_seq_len {image_seq_len}, more than seq_len + 1 = {seq_len + 1}: a sample is "
                           f"never cut; raise seq_len to at least {int(costs.max()) - 1}, or convert again with "
                           f"--max-tokens {seq_len + 1} --image-seq-len {image_seq_len} --overlong drop")
    limit = (1 << IMAGE_KEY_BITS) if max_images is None else max_images
    many = np.flatnonzero(images > limit)
    if many.size:
        i = int(many[0])
        raise DatasetError(f"{ds.where(i)}: {count(int(images[i]), 'image')}, more than max_images = {limit} a "
                           f"sequence: a sample is never cut; raise max_images to at least {int(images.max())}")


def samples_per_sequence(ds: Dataset, seq_len: int, image_seq_len: int, window: int) -> int:
    """The most samples of ``ds`` one packed sequence can hold: as many of its cheapest sample as fit in
    ``seq_len + 1`` tokens, at most a block's ``window`` (best-fit packs each block on its own); at least 1."""
    costs = [t.lengths for t in _shard_costs(ds, image_seq_len)[0] if t.documents]
    least = int(min(c.min() for c in costs)) if costs else 1
    return max(1, min(window, (seq_len + 1) // least if least > 0 else window))


def image_text_packing(ds: Dataset, seq_len: int, image_seq_len: int, max_images: int | None, window: int,
                       spec: SamplerSpec) -> BestFitPacking:
    """The best-fit packing of ``ds``'s samples that ``spec``'s seed and shuffle draw (see the module docstring);
    DatasetError naming ``ds`` and the sample for one that cannot be packed whole."""
    image_token_id(ds)
    tables, bad = _shard_costs(ds, image_seq_len)
    if bad:
        raise DatasetError(f"{ds.where(bad[0][0])}: an image-text sample without {bad[0][1]}")
    _refuse_unpackable(ds, tables, seq_len, image_seq_len, max_images)
    fingerprint = f"{ds.fingerprint}:image-text:{image_seq_len}:{max_images}"
    try:
        return BestFitPacking(tables, seq_len, seed=spec.seed, shuffle=spec.shuffle, fingerprint=fingerprint,
                              block_docs=window, budget=max_images)
    except ValueError as err:
        raise DatasetError(f"{ds.root}: {err}") from None


@dataclass(frozen=True)
class ImageTextSource:
    """One image-text dataset as :class:`ImageTextReader` reads it: the dataset, its packing (whose tables are
    its shards' :class:`SampleCosts`) and the read set's stored-sample reader of it."""

    ds: Dataset
    packing: BestFitPacking
    reader: Any

    @property
    def image_token_id(self) -> int:
        return image_token_id(self.ds)


@dataclass
class ImageTextBatch:
    """One batch of packed image-text sequences: ``indices`` (the sequence ids), ``arrays`` (numpy, as
    :class:`~fastio.tokens.loading.TokenBatch`'s, and ``image_rows``, ``image_starts``), the batch's encoded
    ``images`` in the order of their runs with their ``sizes`` [M, 2] (w, h), ``keys`` (their draw keys),
    ``epochs`` (the epoch each one's sequence belongs to) and ``origins`` (each one's dataset, sample index there and
    field: :meth:`where`)."""

    indices: np.ndarray
    arrays: dict[str, np.ndarray]
    images: list[np.ndarray]
    sizes: np.ndarray
    keys: np.ndarray
    epochs: np.ndarray
    origins: list[tuple[Dataset, int, str]] = field(default_factory=list)

    @property
    def image_count(self) -> int:
        return len(self.images)

    def where(self) -> list[str]:
        """What names each image (``DEST: shard S key 'K': field 'F'``), in run order."""
        return [f"{ds.where(i)}: field {name!r}" for ds, i, name in self.origins]


@dataclass(frozen=True)
class _Laid:
    """Where a batch's samples go: each sample's row (``rows``), expanded length (``count``), global index."""

    rows: np.ndarray
    count: np.ndarray
    samples: np.ndarray
    epochs: np.ndarray


class ImageTextReader:
    """Reads batches of packed image-text sequences (``submit(ids) -> Future[ImageTextBatch]``); a unit id is
    ``epoch * sequences + sequence``, as :class:`~fastio.tokens.loading.TokenUnits` hands them out. ``transcode``
    turns each image's bytes into what the graph decodes (GIF to BMP); ``image_seq_len`` tokens stand for an
    image."""

    def __init__(self, source: ImageTextSource, image_seq_len: int, transcode: Callable[[np.ndarray], np.ndarray],
                 key_base: int = 0):
        self.source, self.image_seq_len, self.transcode = source, image_seq_len, transcode
        self.key_base = key_base  # added to the sample's index in its draw keys (a mixture's earlier samples)
        self.width = source.packing.seq_len + 1
        self.image_id = source.image_token_id
        self.fields = image_members(source.ds)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unit ids -> ``(epoch, sequence)``."""
        return np.divmod(np.asarray(ids, np.int64), self.source.packing.sequences)

    def place(self, ids: np.ndarray) -> _Laid:
        """The samples of the sequences ``ids`` names, in row order: their rows, costs and global indices."""
        epochs, seqs = self.split(ids)
        packing, rows, count, samples, ep = self.source.packing, [], [], [], []
        for e in np.unique(epochs).tolist():
            at = np.flatnonzero(epochs == e)
            spans = packing.spans(e, seqs[at])
            local = np.empty(spans.start.size, np.int64)
            for k in np.unique(spans.shard).tolist():
                here = spans.shard == k
                local[here] = packing.tables[k].samples(spans.start[here]) + self.source.ds.shards[k].first
            rows.append(at[spans.row])
            count.append(spans.count)
            samples.append(local)
            ep.append(np.full(local.size, e, np.int64))
        rows_, count_, samples_, ep_ = (np.concatenate(x) for x in (rows, count, samples, ep))
        order = np.argsort(rows_, kind="stable")  # each row's samples together, in its own order
        return _Laid(rows_[order], count_[order], samples_[order], ep_[order])

    def submit(self, ids: np.ndarray) -> Future:
        """Start reading a batch; the future's result is an :class:`ImageTextBatch` (laid out in the stored-sample
        reader's thread that read it)."""
        ids = np.asarray(ids, np.int64)
        laid = self.place(ids)
        return gathered([self.source.reader.submit(laid.samples)], lambda reads: self.lay_out(ids, laid, reads[0]))

    def lay_out(self, ids: np.ndarray, laid: _Laid, read: Any) -> ImageTextBatch:
        """The batch of sequences ``ids`` from the read samples (``read``: a ``ReadBatch`` of ``laid.samples``)."""
        width, size = self.width, ids.size * self.width
        tokens, mask, ntok = _decoded(read)
        image = tokens == self.image_id
        reps = np.where(image, self.image_seq_len, 1)
        which = np.repeat(np.arange(ntok.size), ntok)
        grown = np.bincount(which, reps, ntok.size).astype(np.int64)
        self._check_images(laid, image, which, grown)
        before = np.cumsum(laid.count) - laid.count
        heads = piece_starts(laid.rows, laid.count, width)
        to = np.repeat(heads - before, laid.count)
        to += np.arange(to.size)
        flat, loss = np.full(size, PAD_ID, np.int64), np.zeros(size, bool)
        flat[to] = np.repeat(tokens, reps)
        loss[to] = np.repeat(mask & ~image, reps)
        loss[heads] = False  # a conversation's first token is no target (fastio.tokens.loading)
        real = np.zeros(size, bool)
        real[to] = True
        first = to[np.cumsum(reps) - reps][image]  # each image run's first flat position
        arrays = self._boundaries(laid, ids.size, real)
        arrays.update(tokens=flat.reshape(ids.size, width), loss_mask=loss.reshape(ids.size, width),
                      image_rows=first // width, image_starts=first % width)
        numbers = ramp(np.bincount(which[image], minlength=ntok.size))
        owner = which[image]
        images, sizes, origins = self._images(read, laid, owner, numbers)
        return ImageTextBatch(ids % self.source.packing.sequences, arrays, images, sizes,
                              draw_keys(laid.samples[owner] + self.key_base, numbers), laid.epochs[owner], origins)

    def _boundaries(self, laid: _Laid, rows: int, real: np.ndarray) -> dict[str, np.ndarray]:
        """``position_ids``, ``segment_ids``, ``cu_seqlens`` and ``max_seqlen``: a segment per sample, padding one."""
        width = self.width
        lengths = np.bincount(laid.rows, laid.count, rows).astype(np.int64)
        starts = piece_bounds([piece_starts(laid.rows, laid.count, width)], lengths, width)
        cu = cu_from(starts, rows, width)
        shape = (rows, width)
        return {"position_ids": positions_from(starts, rows * width).reshape(shape), "cu_seqlens": cu,
                "segment_ids": segment_ids(starts, real.reshape(shape), False),
                "max_seqlen": np.asarray(int(np.diff(cu).max()))}

    def _check_images(self, laid: _Laid, image: np.ndarray, which: np.ndarray, grown: np.ndarray) -> None:
        """DatasetError naming the first sample whose image tokens are not its image members (its expanded
        length differs from the cost ``samples.fxi`` planned)."""
        bad = np.flatnonzero(grown != laid.count)
        if bad.size:
            j = int(bad[0])
            tokens = int(np.count_nonzero(which[image] == j))
            raise DatasetError(f"{self.source.ds.where(int(laid.samples[j]))}: {count(tokens, 'image token')} (id "
                               f"{self.image_id}) but a different number of image members: the sample does not "
                               "match its samples.fxi; run fastio verify")

    def _images(self, read: Any, laid: _Laid, owner: np.ndarray, numbers: np.ndarray
                ) -> tuple[list[np.ndarray], np.ndarray, list[tuple[Dataset, int, str]]]:
        """Each image run's encoded bytes (transcoded), (w, h) and origin, in run order: image ``numbers[m]`` of
        the read batch's sample ``owner[m]``."""
        by_number: dict[int, list[str]] = {}
        for f in self.fields:
            by_number.setdefault(image_number(f), []).append(f)
        images, sizes, origins = [], np.zeros((owner.size, 2), np.int64), []
        ds = self.source.ds
        for m, (j, k) in enumerate(zip(owner.tolist(), numbers.tolist())):
            name = next((f for f in by_number.get(k, ()) if read.present[f][j]), None)
            if name is None:
                raise DatasetError(f"{ds.where(int(laid.samples[j]))}: no image {k} for its image token; run "
                                   "fastio verify")
            try:
                data = self.transcode(read.fields[name][j])
                sizes[m] = image_size(data)
            except (ValueError, IndexError) as err:
                raise DatasetError(f"{ds.where(int(laid.samples[j]))}: field {name!r} failed to decode: "
                                   f"{err}") from None
            images.append(data)
            origins.append((ds, int(laid.samples[j]), name))
        return images, sizes, origins

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        """The stored-sample reader's read-ahead, told the samples of the coming sequences."""
        self.source.reader.read_ahead_shards(lambda: (self.place(ids).samples for ids in batches()))

    def close(self) -> None:
        """Nothing of its own to close: the stored-sample reader is the read set's."""


def _decoded(read: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every sample's ids end to end, their mask bits, each sample's token count) of a read batch's
    ``tokens.i32`` and ``mask.bits``, at once."""
    raw, bits = read.fields[TOKENS_FIELD], read.fields[MASK_FIELD]
    ntok = np.array([a.size // 4 for a in raw], np.int64)
    tokens = np.concatenate(raw).view("<i4").astype(np.int64) if raw else np.zeros(0, np.int64)
    nbytes = np.array([a.size for a in bits], np.int64)
    unpacked = np.unpackbits(np.concatenate(bits), bitorder="little") if bits else np.zeros(0, np.uint8)
    at = np.repeat((np.cumsum(nbytes) - nbytes) * 8, ntok) + ramp(ntok)
    return tokens, unpacked[at].astype(bool), ntok


class MixedReader:
    """Reads batches of a :class:`~fastio.Mixture` of image-text and token datasets (``submit(ids) ->
    Future[ImageTextBatch]``): a unit id is ``source_epoch * total + base[s] + sequence`` (as
    :class:`~fastio.tokens.loading.TokenMixSampler` hands them out); each image-text source's rows are read by its
    :class:`ImageTextReader`, the token sources' by one :class:`~fastio.tokens.loading.TokenReader`, in parallel,
    and merged back into the batch's order (:func:`merged`): a token row has no image."""

    def __init__(self, readers: dict[int, ImageTextReader], tokens: Any, sizes: list[int]):
        self.readers, self.tokens = readers, tokens
        self.sizes = np.asarray(sizes, np.int64)
        self.total = int(self.sizes.sum())
        self.base = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        token_sources = [s for s in range(len(sizes)) if s not in readers]
        self._token_of = np.full(len(sizes), -1, np.int64)
        self._token_of[token_sources] = np.arange(len(token_sources))

    def parts(self, ids: np.ndarray) -> list[tuple[np.ndarray, Any, np.ndarray]]:
        """(rows, reader, that reader's unit ids) of each reader the batch ``ids`` reads from."""
        epochs, local = np.divmod(np.asarray(ids, np.int64), self.total)
        src = np.searchsorted(self.base, local, "right") - 1
        seqs = local - self.base[src]
        out = []
        for s, reader in self.readers.items():
            rows = np.flatnonzero(src == s)
            if rows.size:
                out.append((rows, reader, epochs[rows] * self.sizes[s] + seqs[rows]))
        rows = np.flatnonzero(self._token_of[src] >= 0)
        if rows.size:
            t = self._token_of[src[rows]]
            out.append((rows, self.tokens, epochs[rows] * self.tokens.total + self.tokens.base[t] + seqs[rows]))
        return out

    def submit(self, ids: np.ndarray) -> Future:
        ids = np.asarray(ids, np.int64)
        parts = self.parts(ids)
        futures = [reader.submit(unit_ids) for _, reader, unit_ids in parts]
        indices = ids % self.total
        return gathered(futures, lambda batches: merged(indices, [(rows, b) for (rows, _, _), b in zip(parts, batches)]))

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        """Each reader told the coming units that are its own."""
        readers = [*self.readers.values(), *([self.tokens] if self.tokens is not None else [])]
        for reader in readers:
            reader.read_ahead_shards(lambda reader=reader: (u for ids in batches()
                                                            for _, r, u in self.parts(ids) if r is reader))

    def close(self) -> None:
        if self.tokens is not None:
            self.tokens.close()


def merged(indices: np.ndarray, parts: list[tuple[np.ndarray, Any]]) -> ImageTextBatch:
    """One batch of the sequences ``indices`` from its readers' batches (``rows``: the rows each fills; an
    :class:`ImageTextBatch` or a token reader's batch, which has no image): rows put back, the images in the order
    of their runs, ``cu_seqlens`` and ``max_seqlen`` over the whole batch."""
    first = parts[0][1].arrays["tokens"]
    n, width = indices.size, first.shape[1]
    arrays = {name: np.zeros((n, width), parts[0][1].arrays[name].dtype)
              for name in ("tokens", "loss_mask", "position_ids", "segment_ids")}
    runs, images = [], []
    for rows, batch in parts:
        for name, out in arrays.items():
            out[rows] = batch.arrays[name]
        if isinstance(batch, ImageTextBatch):
            runs.append((rows[batch.arrays["image_rows"]], batch.arrays["image_starts"], batch))
    row = np.concatenate([r for r, _, _ in runs] or [np.zeros(0, np.int64)])
    start = np.concatenate([s for _, s, _ in runs] or [np.zeros(0, np.int64)])
    order = np.lexsort((start, row))
    origins: list[tuple[Dataset, int, str]] = []
    for _, _, batch in runs:
        images += batch.images
        origins += batch.origins
    keys, sizes, epochs = (np.concatenate([getattr(b, a) for _, _, b in runs] or [np.zeros(shape, np.int64)])
                           for a, shape in (("keys", 0), ("sizes", (0, 2)), ("epochs", 0)))
    starts = np.flatnonzero(arrays["position_ids"].reshape(-1) == 0)  # each segment's (padding's too)
    cu = cu_from(starts, n, width)
    arrays.update(image_rows=row[order], image_starts=start[order], cu_seqlens=cu,
                  max_seqlen=np.asarray(int(np.diff(cu).max())))
    back = order.tolist()
    return ImageTextBatch(indices, arrays, [images[m] for m in back], sizes[order], keys[order], epochs[order],
                          [origins[m] for m in back])

"""``fastio.Mixture``: several datasets read as one, in weighted proportions, in one deterministic order.

A :class:`Mixture` names its sources (opened :class:`~fastio.dataset.dataset.Dataset`\\ s), their relative weights (or a
schedule of weights that change at positions of the stream) and the samples of a mixture epoch;
:class:`fastio.Loader` accepts it where it accepts a dataset. The order is :mod:`fastio.order.mixorder`'s.
:class:`MixReader` reads a batch of mixture ids with one :class:`~fastio.read.reader.Reader` per source and hands back
one :class:`~fastio.read.reader.ReadBatch`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from fastio.checks import integer, next_epoch_start, switch_option, two_differing
from fastio.dataset.dataset import Dataset
from fastio.errors import DatasetError, LoaderStateError, MixtureError
from fastio.formats.image_text import is_image_text
from fastio.futures import gathered
from fastio.order.mixorder import MixSampler, MixSchedule, check_positions, check_shares
from fastio.order.sampler import SamplerSpec
from fastio.read.reader import ReadBatch, Reader
from fastio.storage.url import is_remote
from fastio.words import count

_EMPTY = np.empty(0, np.uint8)
MAX_SAMPLES_PER_EPOCH = 2**62
"""The longest mixture epoch: its positions (and a padded last batch's past its end) are int64 arrays."""

__all__ = ["MixReader", "Mixture", "check_mixture_state", "mixture_state", "next_epoch_way",
           "renewed_mixture_state"]


class _Twice(ValueError):
    """A key given twice in one object of a mixture file (its ``args[0]``)."""


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of a mixture file, each key once (``json``'s ``object_pairs_hook``): _Twice naming a repeat."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Twice(key)
        out[key] = value
    return out


class Mixture:
    """Datasets mixed by weight: ``Mixture({"web": "s3://b/web", "coco": "/data/coco"}, weights={"web": 3,
    "coco": 1})``.

    Args:
        sources: name -> dataset directory, ``s3://`` URL or opened :class:`~fastio.Dataset`. The mapping's
            order numbers the sources (``batch["source"]``).
        weights: name -> relative weight (any positive numbers; only proportions matter). Default: each
            source's size, i.e. every sample about once per mixture epoch. Or a schedule: a list of
            ``(position, {name: weight})`` pairs, the first at position 0, positions strictly increasing; the
            weights of an entry apply from that position of the mixture stream (samples since training began,
            across epochs: position ``p`` of mixture epoch ``e`` is ``e * samples_per_epoch + p``) to the next.
        samples_per_epoch: samples of a mixture epoch (default: the sum of the sources' sizes); a schedule
            changes what an epoch holds, not its length.
        verify, cache_dir, cache_size, storage_options: how sources given as paths or URLs are opened
            (as for :class:`~fastio.Dataset`).

    One dataset under two names (the same place however spelled, or copies of its shards) is mixed as given, with a
    warning naming both (each of its samples comes twice an epoch; ``weights=`` sets how often a source's samples
    come). Refused when it is made, in one line naming two sources: token datasets beside datasets of samples
    (``DatasetError``), and token, chat or image-text datasets whose manifests record different tokenizer files
    (:class:`~fastio.errors.MixtureError`, also a ``ValueError``: an id would mean another token in each; a source
    without the record mixes, with a warning logged where its vocabulary size differs: :func:`_check_tokenizers`).
    """

    def __init__(self, sources: Mapping[str, str | Path | Dataset],
                 weights: Mapping[str, float] | Sequence[tuple[int, Mapping[str, float]]] | None = None,
                 samples_per_epoch: int | None = None, *, verify: bool = False, cache_dir: str | Path | None = None,
                 cache_size: int | str | None = None, storage_options: dict | None = None):
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError(f"sources must be a non-empty mapping of name -> dataset, got {sources!r}")
        for name in sources:
            if not isinstance(name, str) or not name:
                raise ValueError(f"source names must be non-empty strings, got {name!r}")
        self.names: tuple[str, ...] = tuple(sources)
        given = None if weights is None else _parse_weights(self.names, weights)
        if samples_per_epoch is not None and (isinstance(samples_per_epoch, bool) or not isinstance(
                samples_per_epoch, numbers.Integral) or samples_per_epoch < 1):
            raise ValueError(f"samples_per_epoch must be a positive integer, got {samples_per_epoch!r}")
        if samples_per_epoch is not None and samples_per_epoch > MAX_SAMPLES_PER_EPOCH:
            raise ValueError(f"samples_per_epoch must be a positive integer of at most 2**62 (a mixture's order "
                             f"counts positions in int64), got {samples_per_epoch!r}")
        opening = {"verify": switch_option("verify", verify), "cache_dir": cache_dir, "cache_size": cache_size,
                   "storage_options": storage_options}
        self.datasets: tuple[Dataset, ...] = tuple(
            d if isinstance(d, Dataset) else _open(name, d, opening) for name, d in sources.items())
        for name, ds in zip(self.names, self.datasets):
            if len(ds) < 1:
                raise DatasetError(f"mixture source {name!r} ({ds.root}) has no samples")
        _check_once(self.names, self.datasets)
        _check_kinds(self.names, self.datasets)
        _check_tokenizers(self.names, self.datasets)
        self._given, self._given_samples = given, samples_per_epoch
        self._units: tuple[tuple[int], ...] | None = None  # in_units: each source one run of that many units
        self._size([len(ds) for ds in self.datasets])

    def _size(self, sizes: Sequence[int]) -> None:
        """Sizes, phases, epoch length and bases from the sources' sizes ``sizes`` (their units)."""
        self.sizes: tuple[int, ...] = tuple(int(n) for n in sizes)
        given = self._given
        if given is None:
            raw = [float(n) for n in self.sizes]
            check_shares(self.names, raw, " (no weights= given: each source's size is its weight; give weights=)")
            given = ((0, tuple(raw)),)
        self.phases: tuple[tuple[int, tuple[float, ...]], ...] = tuple(
            (pos, _shares(raw)) for pos, raw in given)
        """The schedule: ``(position, shares)`` per phase, the first at 0 (one entry for plain weights); shares are
        the weights normalised to sum to 1, positions count samples of the mixture stream since training began."""
        self.weights: tuple[float, ...] = self.phases[0][1]
        """Each source's share (the weights normalised to sum to 1); with a schedule, its first phase's."""
        self.samples_per_epoch: int = (int(self._given_samples) if self._given_samples is not None
                                       else sum(self.sizes))
        self.base = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        """Mixture id of each source's first sample (source ``s``'s sample ``i`` is ``base[s] + i``)."""

    def in_units(self, sizes: Sequence[int]) -> Mixture:
        """This mixture over the same opened datasets, each source ``sizes[s]`` units long (a token mixture's
        packed sequences, :class:`fastio.Tokens`): weights not given are those sizes, a ``samples_per_epoch`` not
        given their sum; given weights, a schedule's positions and ``samples_per_epoch`` count these units."""
        if len(sizes) != len(self.names) or any(int(n) < 1 for n in sizes):
            raise ValueError(f"in_units needs a positive size per source ({', '.join(self.names)}), got {sizes!r}")
        resized = copy.copy(self)
        resized._size(sizes)
        resized._units = tuple((int(n),) for n in sizes)
        return resized

    @classmethod
    def from_file(cls, path: str | Path, **opening: Any) -> Mixture:
        """A mixture described by a JSON file ``{"sources": {name: path or URL}, "weights": {name: weight},
        "samples_per_epoch": N}`` (``weights`` and ``samples_per_epoch`` optional; ``weights`` may be a schedule,
        ``[[position, {name: weight}], ...]``; relative paths are relative to the file). ``opening``: as for the
        constructor. DatasetError names the file and the bad entry (a key given twice in one object too: JSON would
        keep the last silently)."""
        path = Path(path)
        try:
            spec = json.loads(path.read_text(), object_pairs_hook=_once)
        except OSError as err:
            raise DatasetError(f"{path}: cannot read the mixture file ({err.strerror or err})") from None
        except _Twice as err:
            raise DatasetError(f"{path}: key {err.args[0]!r} appears twice in one object (JSON would keep the last "
                               "and drop the other silently): name it once") from None
        except ValueError as err:
            raise DatasetError(f"{path}: not a JSON mixture file ({err})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("sources"), dict):
            raise DatasetError(f"{path}: a mixture file is an object with \"sources\": {{name: path or URL}}")
        unknown = sorted(set(spec) - {"sources", "weights", "samples_per_epoch"})
        if unknown:
            raise DatasetError(f"{path}: unknown keys {unknown} (known: sources, weights, samples_per_epoch)")
        sources = {}
        for name, where in spec["sources"].items():
            if not isinstance(where, str):
                raise DatasetError(f"{path}: sources[{name!r}] must be a path or URL string, got {where!r}")
            sources[name] = where if is_remote(where) or Path(where).is_absolute() else str(path.parent / where)
        try:
            return cls(sources, weights=spec.get("weights"), samples_per_epoch=spec.get("samples_per_epoch"),
                       **opening)
        except (ValueError, DatasetError) as err:
            raise DatasetError(f"{path}: {err}") from None

    def __repr__(self) -> str:
        def shares(weights: Sequence[float]) -> str:
            return ", ".join(f"{n}={w:.3g}" for n, w in zip(self.names, weights))
        if len(self.phases) == 1:
            return f"Mixture({shares(self.weights)}, samples_per_epoch={self.samples_per_epoch})"
        phases = "; ".join(f"from {pos}: {shares(w)}" for pos, w in self.phases)
        return f"Mixture({phases}, samples_per_epoch={self.samples_per_epoch})"

    def __len__(self) -> int:
        """Samples of a mixture epoch."""
        return self.samples_per_epoch

    @property
    def root(self) -> str:
        """How messages name the mixture."""
        return f"mixture({', '.join(self.names)})"

    @property
    def fingerprints(self) -> tuple[str, ...]:
        return tuple(ds.fingerprint for ds in self.datasets)

    @property
    def fingerprint(self) -> str:
        """Identifies the sources (names and datasets), not the weights."""
        return hashlib.sha256(repr((self.names, self.fingerprints)).encode()).hexdigest()[:16]

    def schedule(self, seed: int) -> MixSchedule:
        """The order of the sources' positions with ``seed`` (:class:`~fastio.order.mixorder.MixSchedule`)."""
        return MixSchedule(self.names, self.weights, self.fingerprints, self.samples_per_epoch, seed,
                           changes=self.phases[1:])

    def sampler(self, spec: SamplerSpec, world_size: int = 1, rank: int = 0) -> MixSampler:
        """The order and batches of rank ``rank`` of ``world_size`` (``spec``: the loader's sampling)."""
        shards = self._units or [[s.samples for s in ds.shards] for ds in self.datasets]
        return MixSampler.make(spec, self.schedule(spec.seed), shards, world_size, rank)

    def source_index(self, source: int | str) -> int:
        """A source's position in the mapping, from its position or name."""
        if isinstance(source, str):
            if source not in self.names:
                raise KeyError(f"mixture has no source {source!r} (sources: {', '.join(self.names)})")
            return self.names.index(source)
        s = int(source)
        if not 0 <= s < len(self.names):
            raise IndexError(f"source {s} out of range 0..{len(self.names) - 1}")
        return s

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mixture ids -> ``(source, index within that source)``, int64 arrays."""
        ids = np.asarray(ids, np.int64)
        src = np.searchsorted(self.base, ids, "right") - 1
        return src, ids - self.base[src]

    def key(self, source: int | str, index: int) -> str:
        """The ``__key__`` of sample ``index`` of source ``source`` (position or name)."""
        return self.datasets[self.source_index(source)].key(int(index))

    def describe(self, ids: int) -> str:
        """``"mixture source NAME: DEST: shard ... key ..."`` of one mixture id, for messages."""
        from fastio.read.reader import sample_where

        src, index = self.split(np.array([ids]))
        s = int(src[0])
        return f"mixture source {self.names[s]!r}: {sample_where(self.datasets[s], int(index[0]))}"


def mixture_state(mixture: Mixture) -> dict[str, Any]:
    """What identifies a mixture's order in a loader state: names, fingerprints, epoch length and ``weights``;
    with a schedule ``schedule`` (``[[position, shares], ...]``) instead of ``weights``, so that a fastio from
    before schedules refuses the state (it requires ``weights``) rather than ignoring the schedule. Plain
    weights' states are as they were."""
    state: dict[str, Any] = {"names": list(mixture.names), "fingerprints": list(mixture.fingerprints)}
    if len(mixture.phases) > 1:
        state["schedule"] = [[pos, list(shares)] for pos, shares in mixture.phases]
    else:
        state["weights"] = list(mixture.weights)
    state["samples_per_epoch"] = mixture.samples_per_epoch
    return state


def check_mixture_state(mixture: Mixture, saved: Any, epoch: int, consumed: int) -> None:
    """LoaderStateError unless a state saved at ``(epoch, consumed)`` can continue with ``mixture``: the same
    sources (names and datasets), and a schedule that keeps the past: the entries before the saved stream
    position ``epoch * samples_per_epoch + consumed`` as saved (later ones may differ), the same epoch length; at an
    epoch boundary (nothing of the epoch delivered) any schedule, as ``set_epoch`` would draw that epoch.
    Plain weights on both sides (states from before schedules): as before, they may change at an epoch
    boundary (the new weights then order the stream as if they had always applied)."""
    if saved is None:
        raise LoaderStateError(f"{mixture.root}: loader state is of one dataset (no 'mixture' entry), this Loader reads "
                               "a mixture (a source added since?): the saved position names samples of that dataset; "
                               f"start the next epoch in this mixture's order {next_epoch_way(epoch, consumed)}")
    if not _complete(saved):
        raise LoaderStateError(f"{mixture.root}: loader state is not a mixture's (no complete 'mixture' entry)")
    samples = _check_entry(mixture, saved)
    _check_sources(mixture, list(saved["names"]), list(saved["fingerprints"]), epoch, consumed)
    old = _saved_phases(mixture, saved)
    if samples == mixture.samples_per_epoch and _same_phases(old, mixture.phases):
        return
    if len(old) == 1 and len(mixture.phases) == 1:
        _check_weight_change(mixture, old[0][1], samples, epoch, consumed)
        return
    if consumed == 0 or consumed == samples == mixture.samples_per_epoch:  # at an epoch boundary: nothing of the
        return  # epoch it starts came, which the new schedule draws (a pure function of seed, epoch and schedule)
    if samples != mixture.samples_per_epoch:
        raise LoaderStateError(
            f"{mixture.root}: loader state has samples_per_epoch {samples}, this mixture "
            f"{mixture.samples_per_epoch}: a schedule's positions count samples across epochs of that length, "
            f"so it cannot change under a schedule; start the next epoch with it {next_epoch_way(epoch, consumed)}")
    _check_past(mixture, old, epoch * samples + consumed, epoch, consumed)


def _check_entry(mixture: Mixture, saved: dict) -> int:
    """The saved entry's ``samples_per_epoch``, once its names and fingerprints are lists of one string per source
    and it is a positive integer (a numpy or 0-d torch one too: a checkpoint round trip); else LoaderStateError
    naming the entry (a hand-edited state: ``list(5)`` or ``int("x")`` would fail without naming it, ``"ab"``
    would read as two names, ``50.5`` as 50)."""
    def refuse(key: str, what: str) -> LoaderStateError:
        return LoaderStateError(f"{mixture.root}: loader state's mixture entry has {key}={saved[key]!r}, not {what}")

    for key in ("names", "fingerprints"):  # names of other sources: _check_sources names both lists
        value = saved[key]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise refuse(key, "a list of strings")
    if len(saved["fingerprints"]) != len(saved["names"]):
        raise refuse("fingerprints", f"one per source of names={list(saved['names'])!r}")
    value = saved["samples_per_epoch"]
    samples = integer(value)
    if samples is None or samples < 1:
        raise refuse("samples_per_epoch", "a positive integer")
    return samples


def _check_sources(mixture: Mixture, names: list, fps: list, epoch: int, consumed: int) -> None:
    if names != list(mixture.names):
        raise LoaderStateError(f"{mixture.root}: loader state is for sources {names}, this mixture has "
                               f"{list(mixture.names)} (a source added, removed, renamed or moved): the saved "
                               f"position names samples of that mixture; start the next epoch in this mixture's order "
                               f"{next_epoch_way(epoch, consumed)}")
    for name, old, new in zip(names, fps, mixture.fingerprints):
        if old != new:
            raise LoaderStateError(f"{mixture.root}: source {name!r} is dataset fingerprint {new}, the loader "
                                   f"state was saved with {old} (another dataset, or this one converted again): "
                                   f"the saved position names samples of that one; start the next epoch "
                                   f"{next_epoch_way(epoch, consumed)}")


def _saved_phases(mixture: Mixture, saved: dict) -> list[tuple[int, tuple[float, ...]]]:
    """The saved schedule (``schedule``, else the plain ``weights`` from position 0); LoaderStateError naming the
    entry and the value where it is not one a mixture has: integer positions from 0 that increase, weights positive
    numbers (a float position or a numeric string is refused, not truncated or parsed)."""
    entries = saved["schedule"] if "schedule" in saved else [[0, saved["weights"]]]
    key = "schedule" if "schedule" in saved else "weights"
    try:
        raw = [(pos, list(shares)) for pos, shares in entries]
    except (TypeError, ValueError):
        raise LoaderStateError(f"{mixture.root}: loader state's mixture schedule is not [[position, weights], ...]: "
                               f"{entries!r}") from None
    if not raw or any(len(w) != len(mixture.names) for _, w in raw):
        raise LoaderStateError(f"{mixture.root}: loader state's mixture schedule does not give a weight per source: "
                               f"{entries!r}")
    phases = []
    for i, (pos, shares) in enumerate(raw):  # each value as it is: int() truncated 36.9, float() parsed "0.5"
        where = f"entry {i}: " if key == "schedule" else ""
        at = integer(pos)
        if at is None:
            raise LoaderStateError(f"{mixture.root}: loader state's mixture entry has {key}={saved[key]!r}: {where}"
                                   f"position {pos!r} is not an integer")
        weights = [_state_real(w) for w in shares]
        if None in weights:
            bad = shares[weights.index(None)]
            raise LoaderStateError(f"{mixture.root}: loader state's mixture entry has {key}={saved[key]!r}: {where}"
                                   f"weight {bad!r} is not a number")
        phases.append((at, tuple(weights)))
    try:
        check_positions([pos for pos, _ in phases], key)
    except ValueError as err:
        raise LoaderStateError(f"{mixture.root}: loader state's mixture entry has {key}={saved[key]!r}: {err}") from None
    for pos, weights in phases:
        bad = next((w for w in weights if not (math.isfinite(w) and w > 0)), None)
        if bad is not None:
            raise LoaderStateError(f"{mixture.root}: loader state's mixture entry has {key}={saved[key]!r}, not "
                                   f"positive weights: {bad!r} (at position {pos})")
    return phases


def _state_real(value: Any) -> float | None:
    """A saved weight as a float: a real number (a numpy or 0-d torch one too), else None (a numeric string, a
    bool)."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _same_entry(a: tuple[int, Sequence[float]], b: tuple[int, Sequence[float]]) -> bool:
    return a[0] == b[0] and all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(a[1], b[1]))


def _same_phases(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(_same_entry(x, y) for x, y in zip(a, b))


def _describe_entry(names: Sequence[str], entry: tuple[int, Sequence[float]] | None) -> str:
    if entry is None:
        return "no entry"
    return f"({entry[0]}, {{{', '.join(f'{n}: {w:.4g}' for n, w in zip(names, entry[1]))}}})"


def _check_past(mixture: Mixture, old: Sequence, position: int, epoch: int, consumed: int) -> None:
    """LoaderStateError naming the first entry before stream position ``position`` that ``mixture``'s schedule
    added, dropped or changed against the saved one ``old``."""
    was = [e for e in old if e[0] < position]
    now = [e for e in mixture.phases if e[0] < position]
    for i in range(max(len(was), len(now))):
        a, b = (was[i] if i < len(was) else None), (now[i] if i < len(now) else None)
        if a is None or b is None or not _same_entry(a, b):
            raise LoaderStateError(
                f"{mixture.root}: loader state is at stream position {position} (mixture epoch {epoch}, "
                f"{count(consumed, 'sample')} in), and this mixture's schedule changes what came before it: entry {i} was "
                f"{_describe_entry(mixture.names, a)} and is {_describe_entry(mixture.names, b)}; entries before "
                f"position {position} must stay as saved (entries from {position} on may change); or start the next "
                f"epoch with this schedule {next_epoch_way(epoch, consumed)}")


def _check_weight_change(mixture: Mixture, weights: Sequence[float], samples: int, epoch: int, consumed: int) -> None:
    """Plain weights (or epoch length) changed: allowed at an epoch boundary only, as before schedules."""
    if consumed == 0 or consumed >= samples:
        return
    old = ", ".join(f"{n}={w:.4g}" for n, w in zip(mixture.names, weights))
    new = ", ".join(f"{n}={w:.4g}" for n, w in zip(mixture.names, mixture.weights))
    position = epoch * samples + consumed

    def mapping(shares: Sequence[float]) -> str:
        return "{" + ", ".join(f"{n!r}: {w:.4g}" for n, w in zip(mixture.names, shares)) + "}"
    schedule = (f", or from stream position {position} with a schedule that keeps the saved weights before it: "
                f"weights=[(0, {mapping(weights)}), ({position}, {mapping(mixture.weights)})]"
                if samples == mixture.samples_per_epoch else "")
    raise LoaderStateError(
        f"{mixture.root}: loader state is {count(consumed, 'sample')} into mixture epoch {epoch} with weights {old} and "
        f"samples_per_epoch {samples}; this mixture has weights {new} and samples_per_epoch "
        f"{mixture.samples_per_epoch}, which order that epoch differently: weights can change only from the next "
        f"epoch: continue from the start of epoch {next_epoch_start(epoch, consumed)} "
        f"{next_epoch_way(epoch, consumed)}{schedule}")


def next_epoch_way(epoch: int, consumed: int | None = None) -> str:
    """How a loader state saved at ``(epoch, consumed)`` is left for the start of an epoch, for the messages of a
    state that cannot continue its position: the epoch :func:`~fastio.checks.next_epoch_start` names (``epoch``
    itself where nothing of it was delivered, else the next); ``consumed`` left out: some of it was (a refusal
    only a mid-epoch state meets)."""
    start = next_epoch_start(epoch, 1 if consumed is None else consumed)
    return (f"(a Checkpointer: restore_latest(..., loader_policy='next-epoch'); a Loader alone: "
            f"loader.set_epoch({start}) instead of load_state_dict)")


def renewed_mixture_state(mixture: Mixture, saved: Any) -> Any:
    """``saved`` (a loader state's mixture entry) for a state moved to the start of an epoch, whose order is drawn
    from the mixture as it is: ``mixture``'s own entry, since the next epoch's order is this mixture's, a pure
    function of the seed, the epoch and its schedule (as ``set_epoch`` on a new Loader draws it), whatever the
    saved entry names: a source converted again since, other sources (one added, removed, renamed or moved: a
    data-schedule change between runs), other weights or a schedule whose past changed (a user who edits the
    schedule between runs). A damaged entry is kept as it is, for :func:`check_mixture_state` to refuse naming
    it."""
    if not _complete(saved):
        return saved
    try:
        _check_entry(mixture, saved)
        if list(saved["names"]) == list(mixture.names):  # other sources: their saved weights may not fit these
            _saved_phases(mixture, saved)
    except LoaderStateError:
        return saved
    return mixture_state(mixture)


def _complete(saved: Any) -> bool:
    """Whether ``saved`` has the keys of a loader state's mixture entry."""
    return isinstance(saved, dict) and {"names", "fingerprints", "samples_per_epoch"} <= saved.keys() \
        and bool({"weights", "schedule"} & saved.keys())


def _location(ds: Dataset) -> str:
    """Where ``ds`` is, one spelling per place: a local directory resolved (links, ``..``), a URL without a trailing
    slash."""
    return str(Path(ds.root).resolve()) if isinstance(ds.root, Path) else str(ds.root).rstrip("/")


def _check_once(names: Sequence[str], datasets: Sequence[Dataset]) -> None:
    """A warning (the ``fastio`` logger's) naming two sources that are one dataset (the same place, however spelled)
    or copies of it (the same shards: one fingerprint): each of its samples comes once from each name, so twice a
    mixture epoch, and a source's promise (no sample repeats before all of its samples have come) does not hold for
    the dataset. Mixed as given, not refused: a local copy beside its bucket's, or a source named twice to weigh it,
    may be meant."""
    warn = logging.getLogger("fastio").warning
    places: dict[str, str] = {}
    copies: dict[str, str] = {}
    for name, ds in zip(names, datasets):
        other = places.setdefault(_location(ds), name)
        if other != name:
            warn("mixture sources %r and %r are the same dataset (%s): each of its samples comes twice a mixture epoch, "
                 "once from each; name it once and let weights= say how often its samples come", other, name,
                 datasets[names.index(other)].root)
            continue
        other = copies.setdefault(ds.fingerprint, name)
        if other != name:
            warn("mixture sources %r (%s) and %r (%s) hold the same shards (fingerprint %s): each sample comes once from "
                 "each, twice a mixture epoch", other, datasets[names.index(other)].root, name, ds.root, ds.fingerprint)


def _check_kinds(names: Sequence[str], datasets: Sequence[Dataset]) -> None:
    """DatasetError naming a token source and a source of stored samples when the mixture holds both (a batch
    holds packed sequences or stored samples, not both); an image-text dataset's samples are packed into sequences
    (``fastio.ImageText``), so it mixes with token datasets."""
    tokens = [(n, ds) for n, ds in zip(names, datasets) if ds.manifest.tokens is not None]
    samples = [(n, ds) for n, ds in zip(names, datasets)
               if ds.manifest.tokens is None and not is_image_text(ds.manifest.convert_options)]
    if tokens and samples:
        (t, tds), (o, ods) = tokens[0], samples[0]
        raise DatasetError(f"mixture sources {t!r} ({tds.root}) and {o!r} ({ods.root}): {t!r} is a token dataset and "
                           f"{o!r} holds stored samples (kind {ods.manifest.kind!r}); a mixture mixes one kind: "
                           "token datasets (read with fastio.Tokens; with image-text datasets, fastio.ImageText) or "
                           "datasets of samples")


def _check_tokenizers(names: Sequence[str], datasets: Sequence[Dataset]) -> None:
    """MixtureError naming two sources (and their tokenizers' checksums) whose manifests record different tokenizer
    files (``tokens.tokenizer_sha256``, ``image_text.tokenizer_sha256``): an id would mean another token in each. A
    source without the record (``fastio index``, an older conversion) is not refused: nothing says its tokenizer is
    another (a vocabulary size alone does not: an image-text tokenizer may be a text one and its added image
    token); where recorded vocabulary sizes differ too, a warning (the ``fastio`` logger's) names them."""
    root = {n: ds.root for n, ds in zip(names, datasets)}
    differing = two_differing({n: ds.manifest.tokenizer_sha256 for n, ds in zip(names, datasets)
                               if ds.manifest.tokenizer_sha256 is not None})
    if differing is not None:
        (a, x), (b, y) = differing
        raise MixtureError(f"mixture sources {a!r} ({root[a]}, tokenizer sha256 {x[:12]}...) and {b!r} ({root[b]}, "
                           f"tokenizer sha256 {y[:12]}...) were tokenized with different tokenizers: an id means "
                           "another token in each; convert them with one tokenizer file")
    differing = two_differing({n: ds.manifest.vocab_size for n, ds in zip(names, datasets)
                               if ds.manifest.vocab_size is not None})
    if differing is not None:
        (a, x), (b, y) = differing
        logging.getLogger("fastio").warning(
            f"fastio: mixture sources {a!r} ({root[a]}, a vocabulary of {x} ids) and {b!r} ({root[b]}, {y} ids) record "
            "different vocabulary sizes, and not both the checksum of their tokenizer file (a dataset converted "
            "before fastio recorded it): mixed as given; if they were tokenized with different tokenizers an id "
            "means another token in each (convert them again to have it checked)")


def _parse_weights(names: tuple[str, ...], weights: Any) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """``weights`` (a mapping, or a schedule of ``(position, mapping)`` pairs) as ``(position, weights)`` per
    phase, checked: ValueError naming the offending entry, source or value."""
    if isinstance(weights, Mapping):
        return ((0, _entry_weights(names, weights, "weights")),)
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or not weights:
        raise ValueError(f"weights must be a mapping of source name -> weight, or a schedule: a list of (position, "
                         f"{{name: weight}}) pairs, got {weights!r}")
    for i, entry in enumerate(weights):
        if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2 \
                or not isinstance(entry[1], Mapping):
            raise ValueError(f"weights[{i}] must be a (position, {{name: weight}}) pair, got {entry!r}")
    check_positions([pos for pos, _ in weights])
    return tuple((int(pos), _entry_weights(names, w, f"weights[{i}]", f" (weights[{i}], from position {pos})"))
                 for i, (pos, w) in enumerate(weights))


def _entry_weights(names: tuple[str, ...], weights: Mapping, what: str, note: str = "") -> tuple[float, ...]:
    """One mapping of weights as a tuple in source order, checked (``what`` names it in messages)."""
    known = set(names)  # sets: a thousand sources were a million comparisons
    unknown = [k for k in weights if k not in known]
    missing = [k for k in names if k not in weights]
    if unknown or missing:
        raise ValueError(f"{what} must name every source once: unknown {unknown}, missing {missing}")
    for k, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not _positive_float(w):
            too_large = " (too large for a float)" if isinstance(w, numbers.Integral) and w > 0 else ""
            raise ValueError(f"{what}[{k!r}] must be a positive number, got {w!r}{too_large}")
    raw = tuple(float(weights[k]) for k in names)
    if not math.isfinite(sum(raw)):  # each weight finite, their sum not: the same proportions, scaled down
        top = max(raw)
        raw = tuple(w / top for w in raw)
    check_shares(names, raw, note)
    return raw


def _shares(raw: Sequence[float]) -> tuple[float, ...]:
    """Weights ``raw`` normalised to sum to 1 (their sum taken once: it was taken again for each source)."""
    total = sum(raw)
    return tuple(w / total for w in raw)


def _positive_float(w: numbers.Real) -> bool:
    """Whether ``w`` is a positive finite float (an integer past a float's range is not: OverflowError)."""
    try:
        w = float(w)
    except OverflowError:
        return False
    return math.isfinite(w) and w > 0


def _open(name: str, where: Any, opening: dict) -> Dataset:
    if not isinstance(where, (str, Path)):
        raise ValueError(f"source {name!r} must be a path, an s3:// URL or a fastio.Dataset, got {where!r}")
    try:
        return Dataset(where, **opening)
    except DatasetError as err:
        raise DatasetError(f"mixture source {name!r}: {err}") from None


class MixReader:
    """Reads batches of mixture ids: each source's samples with that source's :class:`Reader` (they run in
    parallel, in the readers' own threads), merged back into the batch's order. Each source's fields keep
    their names: a field only some sources read is absent (empty, ``present`` False) in the others' rows."""

    def __init__(self, mixture: Mixture, readers: Sequence[Reader]):
        self.mixture, self.readers = mixture, list(readers)

    def submit(self, ids: np.ndarray) -> Future:
        """Start reading a batch; the future's result is a :class:`ReadBatch` whose ``indices`` are ``ids``."""
        ids = np.asarray(ids, np.int64)
        src, local = self.mixture.split(ids)
        parts = [(np.flatnonzero(src == s), s) for s in np.unique(src).tolist()]
        futures = [self.readers[s].submit(local[sel]) for sel, s in parts]
        return gathered(futures, lambda batches: _merge(ids, [(sel, b) for (sel, _), b in zip(parts, batches)]))

    def read_batch(self, ids: np.ndarray) -> ReadBatch:
        return self.submit(ids).result()

    def read_ahead_shards(self, batches: Callable[[], Iterable[np.ndarray]]) -> None:
        """Each source's shards in the order the coming batches (``batches()``: mixture ids) want them."""
        for s, reader in enumerate(self.readers):
            reader.read_ahead_shards(lambda s=s: _of_source(self.mixture, s, batches()))

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def _of_source(mixture: Mixture, s: int, batches: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    for ids in batches:
        src, local = mixture.split(ids)
        yield local[src == s]


def _merge(ids: np.ndarray, parts: list[tuple[np.ndarray, ReadBatch]]) -> ReadBatch:
    """One batch of ``ids`` from the sources' batches (``sel``: the rows each fills), every field of any."""
    n = len(ids)
    first = parts[0][1]
    names = list(dict.fromkeys(f for _, batch in parts for f in batch.fields))
    fields = {f: [_EMPTY] * n for f in names}
    present = {f: np.zeros(n, bool) for f in names}
    image = [None] * n if first.image is not None else None
    image_field = [None] * n if first.image_field is not None else None
    # (0, 0) for the samples of a source that parsed no sizes (a pipeline reading images of some sources only)
    sizes = np.zeros((n, 2), np.int64) if any(b.sizes is not None for _, b in parts) else None
    for sel, batch in parts:
        rows = sel.tolist()
        for f, values in batch.fields.items():
            column = fields[f]
            for j, v in zip(rows, values):
                column[j] = v
            present[f][sel] = batch.present[f]
        if image is not None:
            for j, v, name in zip(rows, batch.image, batch.image_field):
                image[j], image_field[j] = v, name
        if sizes is not None and batch.sizes is not None:
            sizes[sel] = batch.sizes
    return ReadBatch(ids, fields, sizes, image, image_field, present)

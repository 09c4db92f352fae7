"""What every pipeline object is: the interface between the Loader and one kind of data, six hooks.

A pipeline object (:class:`fastio.ImageTrain`, :class:`fastio.Raw`, :class:`fastio.Tokens`, ...) is a frozen,
validated set of options. To the Loader it answers these questions, and nothing else of a kind's is known to it:

- what it reads: its ``fields`` (else its ``default_fields``: the label, every shared field, or nothing; the read set
  makes the :class:`FieldChoice`) and, per dataset, :meth:`Pipeline.read_fields` (a :class:`ReadFields`, or None for
  a kind that reads no stored sample);
- its source (:meth:`Pipeline.source`): the order of its units on a rank and the reader of those units, returned
  together as a :class:`~fastio.read.protocol.Source` (the read set's samples, unless the unit is something else);
- its graph (:meth:`Pipeline.graph`): a :class:`GraphDef` (the inputs fed per batch with their dtypes, the DALI
  body, its outputs, what names an undecodable sample), or None for no graph;
- its batch (:meth:`Pipeline.assemble`), from the graph's outputs and the read fields;
- what it adds to the Loader's state (:meth:`Pipeline.state_dict`, :meth:`Pipeline.check_state`).

Nothing of a kind of data lives here: the image kinds' defaults (an image field, PIL naming an undecodable one)
are :class:`fastio.pipelines.image.ImageKind`'s. The typed messages between a kind and the read set (field
choice, read fields, delivery, source, placement) are :mod:`fastio.read.protocol`'s: pipelines import ``read/``,
never the reverse. ``docs/adding-a-kind.md`` walks through adding a kind.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fastio.errors import DatasetError, LoaderArgumentError, LoaderStateError, dali_out_of_memory, dali_reason
from fastio.read.protocol import DEFAULT_FIELDS, Delivery, FieldChoice, Placement, ReadFields, ReadSet, Source

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    from fastio.dataset.dataset import Dataset
    from fastio.order.sampler import SamplerSpec
    from fastio.read.reader import ReadBatch

__all__ = ["BuiltPipeline", "Delivery", "FieldChoice", "GraphDef", "Pipeline", "Placement", "ReadFields", "Source",
           "build_graph", "check_fields", "checked_batch", "checked_graph", "checked_source", "checked_state_entries",
           "dali_inputs", "dali_out_of_memory", "dali_reason", "evaluation_of", "field_value", "refuse_tokens",
           "same_entry"]


DALI_WORKER = "[DALI][TP"
"""How DALI names its thread pool's worker threads (``[DALI][TP<i>]<name>``, set by each thread as it starts)."""


def _thread_ids() -> frozenset[int]:
    """The ids of this process's threads (Linux; empty where ``/proc`` has none)."""
    try:
        return frozenset(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return frozenset()


def _thread_name(tid: int) -> bytes:
    """What thread ``tid`` named itself (bytes: a thread may set any), or b"" once it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/comm", "rb") as f:
            return f.read().strip()
    except OSError:  # the thread ended meanwhile
        return b""


_BUILDING = threading.Lock()
"""Held while :func:`build_graph` builds a pipeline."""
_WORKER_NUMBER = re.compile(re.escape(DALI_WORKER.encode()) + rb"(\d+)\]")
_EXECUTOR_POOL = b"Exec"
"""The name DALI gives its executor's thread pool (a worker: ``[DALI][TP<k>]Exec``, cut to 15 bytes by Linux)."""


def _executor_worker(name: bytes) -> int | None:
    """DALI's number for the executor's worker thread named ``name``, or None for any other thread (another of
    DALI's pools, as the cuda image decoder's ``[DALI][TP<k>]MixedDecoder``, which DALI places itself)."""
    number = _WORKER_NUMBER.match(name)
    if number is None or name != (number.group(0) + _EXECUTOR_POOL)[:15]:
        return None
    return int(number.group(1))


@dataclass(frozen=True)
class BuiltPipeline:
    """A built DALI pipeline and the names of its outputs, in the order ``pipe.run()`` returns them."""

    pipe: Any  # nvidia.dali.Pipeline
    outputs: tuple[str, ...]
    threads_started: frozenset[int] = frozenset()
    """The ids of the threads its build started (its workers among them): a pipeline built later, or a thread
    started later, is not this one's."""

    def workers(self) -> dict[int, int]:
        """The executor's worker threads this pipeline started, each with DALI's number for it (``TP0``, ``TP1``,
        ...): those that have named themselves so far (each does as it starts; all of them once a batch has come
        out). The pool the cuda image decoder starts is not among them: DALI places it (``affine``)."""
        found = {}
        for tid in self.threads_started:
            number = _executor_worker(_thread_name(tid))
            if number is not None:
                found[tid] = number
        return found

    def pin_workers(self, cpus: Sequence[int], skip: Collection[int] = ()) -> list[int]:
        """Pin worker ``k`` to ``cpus[k % len(cpus)]``, each found but the thread ids in ``skip``; the ids of those
        pinned (none with fewer than two CPUs, or where the platform cannot pin)."""
        if len(cpus) < 2 or not hasattr(os, "sched_setaffinity"):
            return []
        pinned = []
        for tid, number in sorted(self.workers().items()):
            if tid in skip:
                continue
            try:
                os.sched_setaffinity(tid, {cpus[number % len(cpus)]})
            except OSError:  # the thread ended meanwhile, or a cpuset forbids it: leave it to the scheduler
                continue
            pinned.append(tid)
        return pinned

    @property
    def owned_outputs(self) -> bool:
        """Whether outputs own their memory (DALI's dynamic executor): a later ``run()`` does not reuse it,
        so they can be handed to torch without a copy (``torch.from_dlpack``), as DALI's own PyTorch
        iterator does. Otherwise a buffer is valid only until the next ``run()`` and must be copied."""
        return bool(getattr(self.pipe, "exec_dynamic", False))


DTYPES = ("uint8", "int32", "int64", "float32", "bool")
"""The dtypes a graph's input may declare (:attr:`GraphDef.inputs`)."""


@dataclass(frozen=True)
class GraphDef:
    """A kind's DALI graph, declared: what one batch feeds it, how it decodes, what comes out.

    The Loader builds it once per stream (:func:`build_graph`) and feeds it through one batch-mode external source
    in fastio's order; ``feed`` runs for every batch, in the feeder's thread."""

    inputs: tuple[tuple[str, str], ...]
    """``(name, dtype)`` of each array ``feed`` returns, in order (a dtype of :data:`DTYPES`): the kind's own."""
    feed: Callable[..., tuple]
    """``feed(read_batch, *, seed, epoch)``: the inputs of one read batch, in :attr:`inputs` order (the encoded
    bytes as a list of arrays, one per sample; the rest whole-batch arrays)."""
    body: Callable[[dict[str, Any], str], Any]
    """``body(inputs, decoder_device)`` (``"mixed"`` on cuda, else ``"cpu"``): the graph's output nodes, in
    :attr:`outputs` order (or a dict of named nodes where :attr:`outputs` is None); ``"index"`` among them: the fed
    indices, which the Loader checks."""
    outputs: tuple[str, ...] | None
    """The output names, in order; None: ``body`` returns them as a dict (a user's graph names its own)."""
    problem: Callable[[ReadBatch, int], str | None] | None
    """Why sample ``j`` of a read batch cannot be decoded, or None: asked after the graph failed, to name it (None:
    no sample is named; the batch's keys and what DALI said are)."""
    conditionals: bool = False
    """Whether ``body`` branches per sample with ``if`` on a boolean input (DALI's ``enable_conditionals``)."""
    per_unit: int = 1
    """The most graph samples one unit feeds (the graph is built for ``batch_size * per_unit``; a batch may feed
    any number from 1 up to that: :class:`fastio.ImageText` feeds each sequence's images)."""
    where: Callable[[Any], list[str]] | None = None
    """``where(read_batch)``: what names each graph sample a read batch fed (``DEST: shard S key 'K': field
    'F'``), for a decode error; None: the read set names the batch's units and their image fields."""
    fed_index: Callable[[Any], np.ndarray] | None = None
    """``fed_index(read_batch)``: the ``"index"`` values ``feed`` gave the graph for a read batch, which the Loader
    checks its output against; None: the batch's ``indices`` (one graph sample a unit)."""
    traced: bool = True
    """Whether DALI records each operator's Python stack while the graph is built, for an error to name the line of
    the graph's definition (a graph a user writes); False for a graph of fastio's own, whose failures the Loader
    names itself in one line: its build costs ~1.6 ms less Python on the way to the first batch
    (:mod:`fastio.pipelines.untraced`)."""

    @property
    def names(self) -> tuple[str, ...]:
        """The input names, in order."""
        return tuple(name for name, _ in self.inputs)


def declared(names: Sequence[str], dtypes: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """``(name, dtype)`` of each input name by its kind's table ``dtypes`` (a numbered name, ``start0`` or
    ``encoded1``, by its stem); None for a name the table lacks (:func:`checked_graph` names it)."""
    return tuple((n, dtypes.get(n.rstrip("0123456789"))) for n in names)


def checked_source(source: Any, pipeline: Pipeline) -> Source:
    """``source`` (``pipeline.source(...)``) once it is a :class:`Source` whose pipeline is a pipeline object;
    else LoaderArgumentError naming the kind."""
    name = f"{type(pipeline).__name__}.source"
    if not isinstance(source, Source):
        raise LoaderArgumentError(f"{name} returned a {type(source).__name__}, not a "
                                  "fastio.pipelines.Source(plan, reader, pipeline)")
    if not isinstance(source.pipeline, Pipeline):
        raise LoaderArgumentError(f"{name} returned a Source whose pipeline is {source.pipeline!r:.80}, not a "
                                  "pipeline object (the object itself, or the one settled for the device)")
    return source


def checked_state_entries(entries: Any, pipeline: Pipeline, taken: Collection[str]) -> dict[str, Any]:
    """``entries`` (``pipeline.state_dict()``) once it is a dict none of whose entries is named as one of ``taken``
    (the Loader's and the read set's own state entries, which it would replace); else LoaderArgumentError naming
    the kind and the entry."""
    name = f"{type(pipeline).__name__}.state_dict"
    if not isinstance(entries, dict):
        raise LoaderArgumentError(f"{name} returned a {type(entries).__name__}, not a dict of the kind's entries")
    clash = next((k for k in entries if k in taken), None)
    if clash is not None:
        raise LoaderArgumentError(f"{name} gives {clash!r}, an entry of the Loader's own state "
                                  f"({', '.join(sorted(taken))}): name it otherwise")
    return entries


def checked_graph(graph: GraphDef | None, pipeline: Pipeline) -> GraphDef | None:
    """``graph`` (``pipeline.graph()``) with its declared inputs checked (LoaderArgumentError naming the kind and an
    input without a dtype of :data:`DTYPES`), its ``feed`` checking each batch's inputs against them
    (:func:`_checked_feed`)."""
    if graph is None:
        return None
    name = type(pipeline).__name__
    for input_name, dtype in graph.inputs:
        if dtype is None:
            raise LoaderArgumentError(f"{name}'s graph input {input_name!r} has no dtype: declare it in its "
                                      "input_dtypes (docs/adding-a-kind.md)")
        if dtype not in DTYPES:
            raise LoaderArgumentError(f"{name}'s graph input {input_name!r} is declared {dtype!r}: a graph input's "
                                      f"dtype is one of {', '.join(DTYPES)}")
    return dataclasses.replace(graph, feed=_checked_feed(graph, name), body=_checked_body(graph, name),
                               problem=graph.problem or _no_problem)


def _no_problem(batch: Any, j: int) -> None:
    """The ``problem`` of a graph declared without one: no sample is named, the batch and DALI's words are."""
    return None


LOADER_ENTRIES = ("index", "source", "padded")
"""The entries the Loader adds to a kind's batch (:meth:`Pipeline.assemble` leaves them out)."""
READ_SET_ENTRIES = ("label", "source", "padded")
"""The batch entries a graph output may not be named: the read set's labels and the Loader's entries (``index``, the
fed indices passed through, is the one the Loader checks and takes out)."""


class _Inputs(dict):
    """A graph body's inputs by name: one it asks for that is not declared is a LoaderArgumentError naming the kind
    and the inputs, not a bare KeyError from the graph's build."""

    def __init__(self, kind: str, inputs: dict[str, Any]):
        super().__init__(inputs)
        self.kind = kind

    def __missing__(self, key: Any) -> Any:
        raise LoaderArgumentError(f"{self.kind}'s graph body asked for input {key!r}: its inputs are "
                                  f"{', '.join(self)}")


def _checked_body(graph: GraphDef, name: str) -> Callable[[dict[str, Any], str], Any]:
    """``graph.body``, refusing (LoaderArgumentError naming the kind ``name``) outputs that are not its declared ones:
    another number of nodes than :attr:`GraphDef.outputs` names, no ``index`` among them, or one named as an entry
    the batch has from the read set or the Loader (which would replace it without a word)."""
    body, declared_names = graph.body, graph.outputs

    def checked(inputs: dict[str, Any], decoder_device: str) -> Any:
        out = body(_Inputs(name, inputs), decoder_device)
        if declared_names is None:
            names = tuple(out) if isinstance(out, dict) else ()
        else:
            nodes = len(out) if isinstance(out, (tuple, list)) else 1
            if nodes != len(declared_names):
                raise LoaderArgumentError(f"{name}'s graph gave {nodes} outputs, its output names are "
                                          f"{len(declared_names)} ({', '.join(declared_names)})")
            names = declared_names
        if "index" not in names:
            raise LoaderArgumentError(f"{name}'s graph outputs ({', '.join(map(repr, names))}) lack 'index': return "
                                      "the fed inp['index'] as one (the Loader checks it against what it fed)")
        clash = next((n for n in names if n in READ_SET_ENTRIES), None)
        if clash is not None:
            raise LoaderArgumentError(f"{name}'s graph output {clash!r} is an entry the Loader adds to the batch "
                                      f"({', '.join(READ_SET_ENTRIES)}): name it otherwise")
        return out

    return checked


def checked_batch(pipeline: Pipeline, batch: Any, rows: int) -> dict[str, Any]:
    """``batch`` as ``pipeline.assemble`` returned it for a read batch of ``rows`` units, once it is a dict of the
    batch's entries by name, none of them an entry the Loader adds (:data:`LOADER_ENTRIES`), none a numpy array,
    each tensor or list ``rows`` long but those of the kind's :attr:`Pipeline.whole_batch`; else
    LoaderArgumentError naming the kind and the entry. A few checks a batch, per entry."""
    name = f"{type(pipeline).__name__}.assemble"
    if not isinstance(batch, dict):
        raise LoaderArgumentError(f"{name} returned a {type(batch).__name__}, not a dict of the batch's entries by "
                                  "name")
    for key, value in batch.items():
        if not isinstance(key, str):
            raise LoaderArgumentError(f"{name} returned a batch entry named {key!r}, not by a string")
        if key in LOADER_ENTRIES:
            raise LoaderArgumentError(f"{name} returned batch[{key!r}], an entry the Loader adds "
                                      f"({', '.join(LOADER_ENTRIES)}): name it otherwise")
        if isinstance(value, np.ndarray):
            raise LoaderArgumentError(f"{name} returned batch[{key!r}] as a numpy array: give a torch tensor "
                                      "(torch.from_numpy)")
        length = len(value) if isinstance(value, list) else value.shape[0] if getattr(value, "ndim", 0) else None
        if length is not None and length != rows and key not in pipeline.whole_batch:
            raise LoaderArgumentError(f"{name} returned batch[{key!r}] of {length} rows for a batch of {rows}: one "
                                      "row per unit, or name the entry in the kind's whole_batch")
    return batch


def _checked_feed(graph: GraphDef, name: str) -> Callable[..., tuple]:
    """``graph.feed``, refusing a batch's inputs (LoaderArgumentError naming the kind ``name`` and the input) that
    are not the declared ones: another count, dtype, or number of samples than the first input's. Whole-batch
    checks (a list of per-sample arrays: its first array's dtype)."""
    feed, names = graph.feed, graph.names
    wanted = [np.dtype(dtype) for _, dtype in graph.inputs]

    def fed(*args: Any, **kwargs: Any) -> tuple:
        values = feed(*args, **kwargs)
        if not isinstance(values, (tuple, list)) or len(values) != len(names):
            gave = f"{len(values)} inputs" if isinstance(values, (tuple, list)) else type(values).__name__
            raise LoaderArgumentError(f"{name}'s graph feed gave {gave}, its graph declares {len(names)} "
                                      f"({', '.join(names)})")
        lengths = []
        for input_name, want, value in zip(names, wanted, values):
            first = value[0] if isinstance(value, (list, tuple)) and len(value) else value
            dtype = getattr(first, "dtype", None)
            if isinstance(value, (list, tuple)) and not len(value):
                dtype = want
            shape = getattr(value, "shape", None)
            if dtype != want or (shape is not None and not shape):
                gave = "as a scalar" if dtype == want else f"as {dtype}" if dtype is not None else \
                    f"as a {type(value).__name__} of {type(first).__name__}" if first is not value else \
                    f"as a {type(value).__name__}"
                raise LoaderArgumentError(f"{name}'s graph feed gave input {input_name!r} {gave}, declared {want} "
                                          "(a numpy array of one value per sample, or a list of per-sample arrays)")
            lengths.append(len(value))
        if len(set(lengths)) > 1:
            bad = next(i for i, n in enumerate(lengths) if n != lengths[0])
            raise LoaderArgumentError(f"{name}'s graph feed gave input {names[bad]!r} for {lengths[bad]} samples, "
                                      f"input {names[0]!r} for {lengths[0]}")
        return values

    return fed


def check_fields(fields: Any) -> tuple[str, ...] | None:
    """``fields`` as a tuple of field names (None stays None); ValueError naming a bad value."""
    if fields is None:
        return None
    if isinstance(fields, str) or not all(isinstance(f, str) and f for f in fields):
        raise ValueError(f"fields must be a sequence of field names, got {fields!r}")
    return tuple(fields)


K_TOKENS = "tokens"
"""The Loader state's entry of a :class:`fastio.Tokens` pipeline."""
K_IMAGE_TEXT = "image_text"
"""The Loader state's entry of a :class:`fastio.ImageText` pipeline."""
PACKED_UNIT = "packed sequence"
"""What the Loader's messages call a unit of the packed kinds (their :class:`Source`'s ``unit``)."""
PACKED_ENTRIES = {K_TOKENS: "Tokens", K_IMAGE_TEXT: "ImageText"}
"""The state entries of the kinds whose units are packed sequences (their ``consumed`` counts sequences): a state
holding one does not continue a kind of samples."""


def refuse_tokens(ds: Dataset, kind: str) -> None:
    """DatasetError naming ``ds`` and the kind ``kind`` (which reads stored samples) when ``ds`` is a token dataset
    (its shards hold no samples)."""
    if ds.manifest.tokens is not None:
        raise DatasetError(f"{ds.root}: a token dataset (Megatron .bin/.idx shards), and pipeline {kind!r} "
                           "reads stored samples: read it with fastio.Tokens(seq_len=...) (docs/tokens.md)")


_OLD_HOOKS = {
    "build": "declare the graph with graph() -> GraphDef(inputs, feed, body, outputs, problem)",
    "unit_plan": "return the plan and the reader together from source(read_set, sampling, place) -> Source",
    "reader": "return the plan and the reader together from source(read_set, sampling, place) -> Source",
    "choose_fields": "set fields, or the class's default_fields ('label', 'shared' or 'none')",
}
"""Hooks of the earlier, wider interface, with what replaces each: a kind defining one is refused when its class
is made (it would be ignored)."""


HOOK_ARGUMENTS = {"read_fields": ("ds", "fields"), "source": ("read_set", "sampling", "place"), "graph": (),
                  "assemble": ("outputs", "delivery"), "state_dict": (), "check_state": ("state",)}
"""The six hooks of the pipeline protocol (all the Loader calls of a pipeline object), each with what it is called
with besides ``self``."""
HOOKS = tuple(HOOK_ARGUMENTS)


def _hook_taking_other_arguments(cls: type) -> str | None:
    """How the first hook ``cls`` defines that cannot be called as the Loader calls it is defined
    (``assemble(self, outputs)``), else None."""
    import inspect

    for hook, arguments in HOOK_ARGUMENTS.items():
        fn = vars(cls).get(hook)
        if not inspect.isfunction(fn):  # a staticmethod, a property ...: left to the call
            continue
        signature = inspect.signature(fn)
        try:
            signature.bind(None, *arguments)
        except TypeError:
            return f"{hook}{signature}"
    return None


def _misspelt_hook(cls: type) -> tuple[str, str] | None:
    """``(name, hook)`` where ``cls`` defines a public method ``name`` that is not a hook but nearly spells one
    (``assembel``, ``stat_dict``), else None."""
    import difflib

    for name, value in vars(cls).items():
        if callable(value) and not name.startswith("_") and name not in HOOKS:
            close = difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.85)
            if close:
                return name, close[0]
    return None


class Pipeline:
    """The base of pipeline objects (see the module docstring): six hooks. Subclasses are frozen dataclasses whose
    fields are their options; each checks them when made (``ValueError`` naming the value)."""

    kind: ClassVar[str] = "pipeline"
    """How messages name the kind (``image-train``, ``raw``, ...); a class that sets none (nor a class it derives
    from, but those named so) is named by its class name."""
    default_fields: ClassVar[str] = "label"
    """What is delivered when ``fields`` is None (:data:`fastio.read.protocol.DEFAULT_FIELDS`)."""
    fields: tuple[str, ...] | None = None
    shuffles: ClassVar[tuple[str, ...]] = ("global", "block", "none")
    """The ``shuffle`` modes the kind reads (a packed kind: ``global`` and ``none``); a cache refusal suggests no
    other."""
    unit: ClassVar[str] = "sample"
    """What ``batch_size`` counts, in messages (a packed kind's: :data:`PACKED_UNIT`; a cache refusal names its
    batch so)."""
    whole_batch: ClassVar[tuple[str, ...]] = ()
    """Entries of :meth:`assemble`'s batch that are not one row per unit (a packed batch's ``cu_seqlens``): the
    Loader checks every other tensor and list is as long as the batch."""

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        old = sorted(set(vars(cls)) & set(_OLD_HOOKS))
        if old:
            raise TypeError(f"{cls.__name__}.{old[0]}: the pipeline protocol has no {old[0]!r} hook now; "
                            f"{_OLD_HOOKS[old[0]]} (docs/adding-a-kind.md)")
        if "kind" not in vars(cls):
            named_by = next(c for c in cls.__mro__[1:] if "kind" in vars(c))
            if named_by is Pipeline or vars(named_by).get("_kind_from_name", False):
                cls.kind, cls._kind_from_name = cls.__name__, True
        other = _hook_taking_other_arguments(cls)
        if other:
            hook = other.split("(")[0]
            raise TypeError(f"{cls.__name__}.{other}: the Loader calls it as "
                            f"{hook}({', '.join(('self', *HOOK_ARGUMENTS[hook]))}) (docs/adding-a-kind.md)")
        misspelt = _misspelt_hook(cls)
        if misspelt:  # a warning, not a refusal: a helper of that name may be meant
            import warnings

            warnings.warn(f"{cls.__name__}.{misspelt[0]}: not a hook of the pipeline protocol; did you mean "
                          f"{misspelt[1]}? (the base's {misspelt[1]} runs instead; a helper of your own: name it "
                          f"_{misspelt[0]} to silence this)", UserWarning, stacklevel=2)
        if cls.default_fields not in DEFAULT_FIELDS:
            raise TypeError(f"{cls.__name__}.default_fields must be one of {', '.join(DEFAULT_FIELDS)}, got "
                            f"{cls.default_fields!r}")

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> ReadFields | None:
        """What to read of ``ds`` to deliver ``fields`` (DatasetError naming what it lacks); None for a kind
        that reads no stored sample (its :meth:`source` reads the shards)."""
        raise TypeError(f"{type(self).__name__} does not say what it reads: define read_fields(ds, fields), or "
                        "subclass fastio.pipelines.ImageKind for the image kinds' (docs/adding-a-kind.md)")

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """The order of this kind's units on ``place``'s rank and what reads them (DatasetError, asked when the
        Loader is made, for a dataset that cannot be read there): the read set's order and reader of stored
        samples. A kind whose unit is not a stored sample (a packed token sequence) makes both here, together."""
        if any(s.reader is None for s in read_set.sources):
            raise LoaderArgumentError(f"{type(self).__name__}.read_fields returned None (it reads no stored sample), "
                                      "and its source is the default one, which reads stored samples: define "
                                      "source(read_set, sampling, place) returning the plan and reader of its own "
                                      "units (docs/adding-a-kind.md)")
        return Source(read_set.sampler(sampling, place.world_size, place.rank), read_set.reader, self, self.unit)

    def graph(self) -> GraphDef | None:
        """The kind's DALI graph, or None for none (the read batch goes to :meth:`assemble` as it is)."""
        return None

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        """The batch (without ``index``, ``source`` and ``padded``, which the Loader adds) from the graph's
        outputs as torch values (``index`` taken out) and the read fields: numeric text fields become int64
        or float64 tensors, others stay lists of bytes; the label column is ``batch["label"]``."""
        batch = dict(outputs)
        for f in delivery.columns:
            if f == delivery.label_column:
                batch["label"] = delivery.labels()
            else:
                batch[f] = field_value([b.tobytes() for b in delivery.read.fields[f]])
        if delivery.labels is not None and delivery.label_column is None:
            batch["label"] = delivery.labels()
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Entries this kind adds to the Loader's ``state_dict()`` (none for most built-in kinds)."""
        return {}

    def check_state(self, state: dict[str, Any]) -> None:
        """LoaderStateError when ``state`` (a whole Loader state) cannot continue with this pipeline: by default, one
        whose position counts the packed sequences of :data:`PACKED_ENTRIES`' kinds, not samples, or whose entries
        of this kind's :meth:`state_dict` differ from this object's (its options), or lack one."""
        for entry, name in PACKED_ENTRIES.items():
            if entry in state:
                raise LoaderStateError(f"loader state has a {entry!r} entry: it is a position among the packed "
                                       f"sequences of fastio.{name}, and pipeline {self.kind!r} counts samples")
        for entry, mine in self.state_dict().items():
            if entry not in state:
                raise LoaderStateError(f"loader state has no {entry!r} entry, this {type(self).__name__} gives "
                                       f"{mine!r:.200} (a state of another kind)")
            if not same_entry(state[entry], mine):
                raise LoaderStateError(f"loader state has {entry}={state[entry]!r:.200}, this {type(self).__name__} "
                                       f"gives {mine!r:.200}: a state saved with other options of the kind")


def same_entry(saved: Any, mine: Any) -> bool:
    """Whether a state entry as saved equals this object's, a checkpoint's round trip aside (a tuple saved comes
    back a list; a number a numpy or 0-d torch one)."""
    if isinstance(mine, dict):
        return isinstance(saved, dict) and saved.keys() == mine.keys() and all(same_entry(saved[k], mine[k])
                                                                               for k in mine)
    if isinstance(mine, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(mine) and all(map(same_entry, saved, mine))
    try:
        return bool(saved == mine)
    except (TypeError, ValueError, RuntimeError):  # an array of several values: not one option's value
        return False


def evaluation_of(pipeline: Pipeline) -> Pipeline:
    """The pipeline that evaluates what ``pipeline`` trains on (``FastioDataModule``'s validation Loader): its
    ``evaluation()`` where the kind has random augmentation to leave out (``ImageTrain``, ``VideoClips``), else
    the object itself."""
    evaluation = getattr(pipeline, "evaluation", None)
    return evaluation() if evaluation is not None else pipeline


def _sources_kept(conditionals: bool) -> AbstractContextManager:
    """Where DALI's conditionals write their converted sources during a build: a directory of the build's own,
    emptied after it (:mod:`fastio.pipelines.autograph`); nothing to do without conditionals."""
    if not conditionals:
        return nullcontext()
    from fastio.pipelines.autograph import generated_sources_kept_private

    return generated_sources_kept_private()


def _untraced(traced: bool) -> AbstractContextManager:
    """Where a graph is not :attr:`GraphDef.traced`: its build without DALI's record of each operator's Python
    stack (:mod:`fastio.pipelines.untraced`)."""
    if traced:
        return nullcontext()
    from fastio.pipelines.untraced import untraced

    return untraced()


def dali_seed(seed: int) -> int:
    """The seed of a DALI pipeline for the Loader's ``seed``: DALI takes 0..2**63-1 and draws a random seed for a
    negative one (another draw of a graph's random operators in every run), and refuses a larger one with a bare
    TypeError. Seeds in its range are passed as they are."""
    return int(seed) % 2**63


def build_graph(graph: GraphDef, source: Callable, *, batch_size: int, num_threads: int, device: str,
                device_id: int | None, prefetch: int, seed: int = 0) -> BuiltPipeline:
    """``graph`` built as a DALI pipeline: its inputs from ``source`` (returning ``graph.feed``'s arrays; called
    across epochs for as long as the pipeline runs, keeping what it returned alive until that batch's outputs come
    back) through one batch-mode external source (fastio's order, not DALI's), each with its declared dtype, then
    ``graph.body``. ``seed`` (any integer: the Loader's) seeds DALI's random operators as :func:`dali_seed`."""
    from nvidia.dali import fn, pipeline_def, types

    dtypes = {"uint8": types.UINT8, "int32": types.INT32, "int64": types.INT64, "float32": types.FLOAT,
              "bool": types.BOOL}
    decoder_device = "mixed" if device == "cuda" else "cpu"
    names = graph.names
    outputs: list[str] = list(graph.outputs or ())

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id,
                  prefetch_queue_depth=prefetch, seed=dali_seed(seed), enable_conditionals=graph.conditionals)
    def dali_graph():
        # no_copy: DALI reads the arrays the source returns in place; the source keeps them until the
        # batch's outputs are returned (fastio.read.feeder.Feeder does), which is what DALI requires. Given as
        # DALI's own tensors (dali_inputs), DALI's threads never take the interpreter lock to let go of them.
        nodes = fn.external_source(source=source, num_outputs=len(names), batch=True, no_copy=True,
                                   dtype=[dtypes[d] for _, d in graph.inputs])
        out = graph.body(dict(zip(names, nodes)), decoder_device)
        if graph.outputs is None:  # named by the body
            outputs.extend(out)
            out = tuple(out.values())
        return out

    with _BUILDING, _sources_kept(graph.conditionals), _untraced(graph.traced):  # one build at a time: the threads
        before = _thread_ids()  # started meanwhile are this build's
        pipe = dali_graph()
        pipe.build()  # starts DALI's threads (each names itself as it starts, maybe later)
        started = _thread_ids() - before
    return BuiltPipeline(pipe, tuple(outputs), started)


def dali_inputs(feed: Callable[..., tuple]) -> Callable[..., tuple]:
    """``feed`` (a :attr:`GraphDef.feed`) giving its arrays as DALI tensors that share their memory: a whole-batch
    array as one ``TensorListCPU``, a list of per-sample arrays as a list of ``TensorCPU``.

    What the graph is fed with ``no_copy`` must stay alive until the batch's outputs come back; DALI's own wrapper of
    a numpy array lets go of it under the interpreter lock, in whichever of DALI's threads drops the last reference.
    Where DALI made the wrapper (a numpy array fed as it is), that is one of its threads, which then waits for the
    lock while the training loop or a reader thread runs Python (issue 45: DALI's workers idle). Fed these wrappers,
    kept by the :class:`~fastio.read.feeder.Feeder` until the batch's outputs come back, the last reference is the
    feeder's, dropped in the Loader's thread; DALI's threads never take the lock. DALI's per-sample checks of a
    list of arrays are skipped too (a list of its own tensors passes as it is)."""
    from nvidia.dali.tensors import TensorCPU, TensorListCPU

    def tensor_list(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [TensorCPU(np.ascontiguousarray(a)) for a in value]
        return TensorListCPU(np.ascontiguousarray(value))

    def fed(*args: Any, **kwargs: Any) -> tuple:
        return tuple(tensor_list(value) for value in feed(*args, **kwargs))

    return fed


def field_value(values: list[bytes]):
    """Numeric text fields become an int64 or float64 tensor; anything else stays a list of bytes."""
    import torch

    try:
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    except ValueError:
        pass
    try:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)
    except ValueError:
        return values

""":class:`Tokens`: packed sequences of a token dataset (``fastio convert --tokenizer``, ``fastio index --eos-id``),
no DALI graph. Its unit is a packed sequence, not a stored sample: its source is its own, the unit plan and the
reader made together from one packing per dataset (:mod:`fastio.tokens.loading`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from fastio.checks import integer
from fastio.errors import DatasetError, LoaderStateError
from fastio.pipelines.base import K_TOKENS, PACKED_UNIT, Delivery, Pipeline, Placement, Source, same_entry
from fastio.pipelines.image import refuse_image_text
from fastio.read.mixture import next_epoch_way
from fastio.tokens.packing import PACKING_VERSION, PACKINGS

if TYPE_CHECKING:
    from fastio.dataset.dataset import Dataset
    from fastio.order.sampler import SamplerSpec
    from fastio.read.protocol import ReadSet, UnitPlan
    from fastio.tokens.packing import BestFitPacking, ConcatPacking

__all__ = ["Tokens", "check_entry"]



@dataclass(frozen=True)
class Tokens(Pipeline):
    """Packed sequences of ``seq_len + 1`` tokens: ``batch["tokens"]`` int64 [B, seq_len + 1] (inputs
    ``tokens[:, :-1]``, targets ``tokens[:, 1:]``), ``batch["position_ids"]`` int64 [B, seq_len + 1] (0 at each
    sequence start and right after every end-of-document token), ``batch["cu_seqlens"]`` int32 [n + 1] (document
    boundaries in the flattened inputs ``tokens[:, :-1]``, for variable-length attention; padding is one segment),
    ``batch["max_seqlen"]`` (an int: the longest of them, for varlen kernels), ``batch["segment_ids"]`` int32
    [B, seq_len + 1] (1, 2, ... for each row's documents, 0 on padding: Grain's convention, for a block-causal
    FlexAttention mask); with ``packing="best-fit"`` also ``batch["loss_mask"]`` bool [B, seq_len + 1] (False on
    padding: a target ``tokens[:, 1:]`` counts where ``loss_mask[:, 1:]``). ``batch["index"]`` holds the sequence
    ids. Tensors stay on the CPU.

    A chat dataset (``fastio convert --chat-template``) packs whole conversations (``packing="best-fit"``; a
    ``seq_len + 1`` below its longest conversation is refused): ``loss_mask`` is True exactly on the trained
    tokens (the template's ``{% generation %}`` blocks) but a conversation's first token (a target only of the
    conversation packed before it: transformers never trains it), ``position_ids`` restart and ``cu_seqlens`` cut at each
    conversation. In a mixture of chat and plain token datasets a plain document trains every token.

    ``fastio.Loader(DEST, pipeline=fastio.Tokens(seq_len=2048), batch_size=8)``, or a ``fastio.Mixture`` of token
    datasets in place of DEST (its units are packed sequences: weights, ``samples_per_epoch`` and a schedule count
    sequences; ``batch["source"]`` names the source, ``batch["index"]`` the sequence in it); ``shuffle`` is ``global`` or
    ``none``; the order is a pure function of (seed, epoch, the corpus, the options below), so ranks, drop_last,
    remainder and exact or elastic resume work as for stored samples (docs/tokens.md).
    """

    kind: ClassVar[str] = "tokens"
    default_fields: ClassVar[str] = "none"
    shuffles: ClassVar[tuple[str, ...]] = ("global", "none")
    unit: ClassVar[str] = PACKED_UNIT
    whole_batch: ClassVar[tuple[str, ...]] = ("cu_seqlens",)
    seq_len: int = 2048
    """Tokens of input per sequence (each sequence holds ``seq_len + 1``: one of overlap with the next)."""
    packing: str = "concat"
    """``concat`` (documents in a drawn order concatenated and cut, as Megatron does: every token once per
    epoch but the tail) or ``best-fit`` (whole documents fill sequences by best-fit decreasing, padding marked in
    ``loss_mask``; documents longer than ``seq_len + 1`` tokens are split)."""
    window: int = 4096
    """Documents per block: the order shuffles blocks of this many consecutive documents of a shard, and the
    documents within each; best-fit packs each block on its own."""

    def __post_init__(self):
        for name in ("seq_len", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")

    def read_fields(self, ds: Dataset, fields: Sequence[str]) -> None:
        """None: no stored sample is read (the read set opens only the shard source); refuses a dataset of
        stored samples."""
        if ds.manifest.tokens is None:
            refuse_image_text(ds, self.kind)
            raise DatasetError(f"{ds.root}: a dataset of stored samples (kind {ds.manifest.kind!r}), and "
                               f"fastio.Tokens reads token datasets (fastio convert --tokenizer, fastio index "
                               "--eos-id); read it with fastio.ImageTrain, fastio.Raw, ...")
        return None

    def source(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement) -> Source[Pipeline]:
        """Each dataset packed (:meth:`_packed`), the order of the sequences on ``place``'s rank and a
        :class:`~fastio.tokens.loading.TokenReader` of those packings: made together."""
        from fastio.tokens.loading import TokenReader, TokenSource

        plan, packings = self._packed(read_set, sampling, place)
        sources = [TokenSource(s.dataset, packing, s.files) for s, packing in zip(read_set.sources, packings)]
        return Source(plan, TokenReader(sources, read_set.reader_threads), self, self.unit)

    def _packed(self, read_set: ReadSet, sampling: SamplerSpec, place: Placement
                ) -> tuple[UnitPlan, list[ConcatPacking | BestFitPacking]]:
        """The unit plan of packed sequences on ``place``'s rank and each dataset's packing (a mixture's sources
        sized in sequences, the mixture's order over them)."""
        from fastio.tokens.loading import TokenUnits, mixture_units, open_tables, packing_of

        if read_set.mixture is not None:
            return mixture_units(read_set, self.seq_len, self.packing, self.window, sampling, place.world_size,
                                 place.rank)
        ds = read_set.target
        packing = packing_of(ds, open_tables(ds), self.seq_len, self.packing, self.window, sampling)
        return TokenUnits.of(packing, sampling, place.world_size, place.rank), [packing]

    def assemble(self, outputs: dict[str, Any], delivery: Delivery) -> dict[str, Any]:
        import torch

        arrays = delivery.read.arrays
        names = ("tokens", "position_ids", "cu_seqlens", "segment_ids") + (("loss_mask",) if self.packing == "best-fit"
                                                                           else ())
        return {**{name: torch.from_numpy(arrays[name]) for name in names}, "max_seqlen": int(arrays["max_seqlen"])}

    def state_dict(self) -> dict[str, Any]:
        return {K_TOKENS: {"seq_len": self.seq_len, "packing": self.packing, "window": self.window,
                           K_PACKING_VERSION: PACKING_VERSION}}

    def check_state(self, state: dict[str, Any]) -> None:
        check_entry(state, K_TOKENS, self.state_dict()[K_TOKENS], "packed token sequences", "Tokens")


K_PACKING_VERSION = "packing_version"
"""The entry's key recording :data:`fastio.tokens.packing.PACKING_VERSION`: which rules packed the sequences."""


def check_entry(state: dict[str, Any], entry: str, mine: dict[str, Any], what: str, name: str) -> None:
    """LoaderStateError unless ``state`` (a whole Loader state) has an entry ``entry`` equal to ``mine`` (the options
    of a ``fastio.NAME`` pipeline whose units are ``what``), naming the first option that differs; first its
    ``packing_version``: one of another is refused naming both and the next epoch, unless the state is at the
    start of an epoch (``consumed`` 0: nothing of it delivered, so this fastio packs it anew, as
    :meth:`fastio.Loader.next_epoch_state` moves a state there); none: saved before the field, taken as today's
    (see :data:`~fastio.tokens.packing.PACKING_VERSION`)."""
    saved = state.get(entry)
    if saved is None:
        raise LoaderStateError(f"loader state is not of {what} (no {entry!r} entry), this Loader reads fastio.{name}")
    if not isinstance(saved, dict):
        raise LoaderStateError(f"loader state's {entry!r} entry is {type(saved).__name__}, not the options of "
                               f"fastio.{name} (a damaged state)")
    saved = {K_PACKING_VERSION: PACKING_VERSION, **saved}  # saved before the field: today's packing (PACKING_VERSION)
    version = saved[K_PACKING_VERSION]
    if integer(version) is None:
        raise LoaderStateError(f"loader state's {entry} entry has packing_version={version!r:.80}, not an integer (a "
                               "damaged or hand-edited state)")
    if not same_entry(saved[K_PACKING_VERSION], PACKING_VERSION) and state.get("consumed") != 0:
        raise LoaderStateError(f"loader state's {entry} entry was packed by packing version "
                               f"{saved[K_PACKING_VERSION]!r}, this fastio packs by version {PACKING_VERSION} (the "
                               f"saved position would name other sequences): start the next epoch "
                               f"{next_epoch_way(_epoch(state))}, which this fastio packs anew")
    for key, value in mine.items():
        if key != K_PACKING_VERSION and not same_entry(saved.get(key), value):
            raise LoaderStateError(f"loader state has {entry} {key}={saved.get(key)!r}, this Loader's "
                                   f"fastio.{name} {key}={value!r} (the sequences would differ)")


def _epoch(state: dict[str, Any]) -> int:
    """The state's epoch for the way forward's ``set_epoch(epoch + 1)`` (checked an integer by then)."""
    epoch = state.get("epoch")
    return epoch if isinstance(epoch, int) else 0

"""What decides a token dataset's loss masks, as a Loader state records it (its ``loss_mask`` entry), so that a
resume on other masks is refused.

A dataset's fingerprint names its shards' tokens (names, counts, the ``.bin`` checksums), not its loss masks: the
same conversations converted with another ``--train-on`` or another chat template's ``{% generation %}`` blocks,
or the same ``.bin``/``.idx`` pairs indexed as plain documents (``fastio index``: every token trained), have the
same fingerprint and so the same order, but train on other targets. The fingerprint stays as it is (it draws the
order: changing it would move every chat run's order); the state records the masks beside it:

- a plain token dataset: ``{"train_on": "plain"}`` (every token trained);
- a chat dataset: ``{"train_on": "generation" | "all", "template_sha256": ..., "masks": ...}`` (``masks``: the
  manifest's :attr:`~fastio.dataset.manifest.Manifest.masks_fingerprint`, the masks themselves, computed once);
- a dataset of stored samples: nothing (an image-text sample's ``mask.bits`` is a member of its tar, whose sha256
  the fingerprint covers already).

A Loader's state holds the entry of its dataset, or ``{source name: entry}`` of a mixture's token sources. A state
without the entry (saved by a fastio before it recorded masks) is taken as it is: nothing to compare with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastio.dataset.dataset import Dataset
from fastio.errors import LoaderStateError

__all__ = ["K_LOSS_MASK", "check_dataset_masks", "check_mixture_masks", "dataset_masks", "mixture_masks"]

K_LOSS_MASK = "loss_mask"

_WHY = {"train_on": "converted with another --train-on (TokenConvertConfig(train_on=...)), or 'plain': plain "
                    "documents, every token trained",
        "template_sha256": "converted with another --chat-template",
        "masks": "other .mask files: converted again with other mask settings"}


def masks_of(ds: Dataset) -> dict[str, str] | None:
    """What decides ``ds``'s loss masks (see the module docstring); None for a dataset of stored samples."""
    tokens = ds.manifest.tokens
    if tokens is None:
        return None
    chat = tokens.chat
    if chat is None:
        return {"train_on": "plain"}
    return {"train_on": chat.train_on, "template_sha256": chat.template_sha256, "masks": ds.manifest.masks_fingerprint}


def dataset_masks(ds: Dataset) -> dict[str, Any]:
    """The Loader state's entry of one dataset (none for a dataset of stored samples)."""
    mine = masks_of(ds)
    return {} if mine is None else {K_LOSS_MASK: mine}


def mixture_masks(names: Sequence[str], datasets: Sequence[Dataset]) -> dict[str, Any]:
    """The Loader state's entry of a mixture: each token source's masks by its name (none without one)."""
    mine = {name: m for name, ds in zip(names, datasets) if (m := masks_of(ds)) is not None}
    return {K_LOSS_MASK: mine} if mine else {}


def check_dataset_masks(ds: Dataset, state: dict[str, Any], next_epoch: str) -> None:
    """LoaderStateError naming ``ds``, the option and both values unless ``state``'s entry (if any) is ``ds``'s
    (``next_epoch``: the way to start the next epoch on these masks). Only where the state is of ``ds``'s tokens
    (its ``fingerprint``): a state of other tokens is the fingerprint's refusal (another dataset), not the masks'."""
    saved, mine = state.get(K_LOSS_MASK), masks_of(ds)
    if saved is not None and state.get("fingerprint") == ds.fingerprint:
        _compare(saved, mine, f"{ds.root}", next_epoch)


def check_mixture_masks(root: Any, names: Sequence[str], datasets: Sequence[Dataset], state: dict[str, Any],
                        next_epoch: str) -> None:
    """As :func:`check_dataset_masks`, per token source of a mixture (the refusal names the source; asked after the
    mixture's entry, whose check refuses a source of other tokens first)."""
    saved = state.get(K_LOSS_MASK)
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise LoaderStateError(f"{root}: loader state's {K_LOSS_MASK!r} entry is {type(saved).__name__}, not each "
                               "source's loss masks (a damaged state)")
    for name, ds in zip(names, datasets):
        if name in saved or masks_of(ds) is not None:
            _compare(saved.get(name), masks_of(ds), f"{root}: source {name!r}", next_epoch)


def _compare(saved: Any, mine: dict[str, str] | None, where: str, next_epoch: str) -> None:
    if not isinstance(saved, dict):
        saved = {"train_on": saved}  # None: a source the state saw without masks (not a token dataset)
    mine = mine or {"train_on": None}
    for key in ("train_on", "template_sha256", "masks"):
        if key in saved or key in mine:
            old, new = saved.get(key), mine.get(key)
            if old is not None and not isinstance(old, str):  # an array: numpy's ambiguous truth value below
                raise LoaderStateError(f"{where}: loader state's loss masks have {key}={old!r:.80}, not a string (a "
                                       "damaged or hand-edited state)")
            if old != new:
                raise LoaderStateError(f"{where}: loader state was saved on loss masks {key}={old!r}, this dataset's "
                                       f"are {key}={new!r} ({_WHY[key]}): the saved position would train on other "
                                       f"targets; start the next epoch {next_epoch}")

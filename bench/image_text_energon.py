"""The image-text section's second peer: Megatron-Energon 7.4 (``make bench`` installs it ``--no-deps``, with the
packages it imports; its own requirements would replace the dev extra's botocore) reading the same shards.

Energon reads a WebDataset folder that ``energon prepare`` described (``.nv-meta/``: the split, its sample index);
:func:`prepared` makes one beside the fastio dataset, its shards symlinks to fastio's (so nothing is written into
the fastio dataset), as a ``CrudeWebdataset``: each sample a dict of its members' bytes, cooked into a
:class:`Members` sample. :class:`Encoder` (a ``TaskEncoder``) packs with Energon's packing stage: each buffer of
samples (``packing_buffer_size``: a shard's samples, as fastio's blocks) split into rows by
:func:`bench.image_text_peer.best_fit` (``select_samples_to_pack``), each row laid out and its images decoded by PIL as
the DataLoader peer does (``pack_selected_samples``: ``bench.image_text_peer.Assemble``), batched into the same dict
(``batch``: ``bench.image_text_peer.collate``). One epoch: ``get_train_dataset(..., repeat=False)`` through Energon's
``get_loader`` with ``WorkerConfig(num_workers=2)``.

Imports Energon at import time: ``bench.image_text`` imports this module only when it runs this peer.
"""

from __future__ import annotations

from pathlib import Path

from megatron.energon import (
    Cooker,
    Sample,
    TaskEncoder,
    WorkerConfig,
    basic_sample_keys,
    cooker,
    edataclass,
    get_loader,
    get_train_dataset,
    stateless,
)
from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

from bench.image_text_peer import Assemble, Packing, best_fit, collate, image_fields, image_token_id
from fastio.formats.image_text import TOKENS_FIELD

__all__ = ["energon_loader", "prepared"]

DATASET_YAML = "__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors: {}\n"


@edataclass
class Members(Sample):
    """An image-text sample's members (field -> bytes) as Energon hands them over."""

    members: dict


@stateless
@cooker
def cook(crude: dict) -> Members:
    return Members(**basic_sample_keys(crude), members={k: v for k, v in crude.items() if not k.startswith("__")})


class Encoder(TaskEncoder):
    """Samples packed by :func:`best_fit`, rows as ``Assemble`` lays them out, batches as ``collate`` makes them."""

    cookers = [Cooker(cook)]
    decoder = None  # the members stay bytes: PIL decodes the images of each packed row

    def __init__(self, packing: Packing, image_id: int):
        super().__init__()
        self.packing, self.assemble = packing, Assemble(packing, image_id)

    def select_samples_to_pack(self, samples: list[Members]) -> list[list[Members]]:
        p = self.packing
        images = [len(image_fields(s.members)) for s in samples]
        lengths = [len(s.members[TOKENS_FIELD]) // 4 + k * (p.image_seq_len - 1) for s, k in zip(samples, images)]
        return [[samples[i] for i in row] for row in best_fit(lengths, images, p.seq_len + 1, p.max_images)]

    @stateless
    def pack_selected_samples(self, samples: list[Members]) -> dict:
        return {**self.assemble([s.members for s in samples]), "index": 0}  # Energon numbers no rows

    def batch(self, rows: list[dict]) -> dict:
        return collate(rows, self.packing.size)


def prepared(dest: Path) -> Path:
    """The Energon dataset of fastio dataset ``dest``'s shards (``DEST-energon/``, made once): symlinks to them,
    ``energon prepare``'s metadata, a ``CrudeWebdataset`` ``dataset.yaml``."""
    from fastio.dataset.manifest import load_manifest

    root = dest.with_name(dest.name + "-energon")
    if (root / ".nv-meta" / "dataset.yaml").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    names = [s.name for s in load_manifest(dest).shards]
    for name in names:
        (root / name).unlink(missing_ok=True)
        (root / name).symlink_to((dest / "shards" / name).resolve())
    WebdatasetPreparator.prepare_dataset(root, names, split_parts_ratio=[("train", 1.0)], shuffle_seed=None,
                                         workers=2)
    (root / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)
    return root


def energon_loader(dest: Path, packing: Packing, workers: int, window: int):
    """One epoch of ``dest`` through Energon, ``workers`` worker processes, packing buffers of ``window``
    samples."""
    ds = get_train_dataset(prepared(dest), worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
                           batch_size=packing.batch_size, packing_buffer_size=window, shuffle_buffer_size=None,
                           max_samples_per_sequence=None, task_encoder=Encoder(packing, image_token_id(dest)),
                           repeat=False)
    return get_loader(ds)

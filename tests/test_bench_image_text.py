"""bench/image_text.py's peers (DataLoader + WebDataset + PIL + best-fit in Python; Megatron-Energon with the same
best-fit) deliver what fastio.ImageText delivers over the same shards: the same batch entries (dtype and shape), the
same samples (each one's tokens with its images expanded, loss mask and positions; the DataLoader peer also packs
the same samples together) and, with ImageEval, the same images at the same places."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("webdataset", reason="the peer reads the shards with webdataset (make install)")

from bench.image_text import SHARDS, check_structure, fastio_loader, make_dataset, samples_in  # noqa: E402
from bench.image_text_peer import Packing, best_fit, peer_loader  # noqa: E402

PACKING = Packing(seq_len=2048, image_seq_len=24, max_images=3, batch_size=4, size=32, train=False)
N = 40


@pytest.fixture(scope="module")
def dest(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("bench-image-text"), N)


def _rows(batch) -> list[tuple]:
    """Each real row of a batch as its samples (each: tokens, mask, positions, its images' starts within it and
    their per-channel means), sorted: what must match between the two sides, whatever the row order."""
    t, m, pos, seg = (batch[k].numpy() for k in ("tokens", "loss_mask", "position_ids", "segment_ids"))
    rows_of, starts = batch["image_rows"].numpy(), batch["image_starts"].numpy()
    means = batch["images"].float().mean(dim=(2, 3)).numpy()
    out = []
    for r in np.flatnonzero(~batch["padded"].numpy()):
        samples = []
        for s in range(1, int(seg[r].max()) + 1):
            at = np.flatnonzero(seg[r] == s)
            mine = np.flatnonzero((rows_of == r) & (starts >= at[0]) & (starts <= at[-1]))
            samples.append((tuple(t[r][at]), tuple(m[r][at]), tuple(pos[r][at]), tuple(starts[mine] - at[0]),
                            means[mine]))
        out.append(samples)
    return out


def _key(sample: tuple) -> tuple:
    return sample[:4]


def _epoch(loader) -> list[list[tuple]]:
    return [row for batch in loader for row in _rows(batch)]


def test_best_fit_fills_the_fullest_row_and_keeps_the_image_budget():
    rows = best_fit([6, 5, 4, 3, 2, 1], [0, 1, 1, 1, 0, 0], cap=10, max_images=2)
    assert rows == [[0, 2], [1, 3, 4], [5]]  # 4 beside 6 (the fullest); 2 (no image) beside 5+3, whose images are spent
    assert best_fit([5, 5], [1, 1], cap=10, max_images=1) == [[0], [1]]  # the budget binds
    assert best_fit([3, 3, 3], [0, 0, 0], cap=9, max_images=1) == [[0, 1, 2]]


def _peer(name: str, dest):
    """Peer ``name``'s loader of one epoch (Energon: where make bench installed it)."""
    if name == "dataloader":
        return peer_loader(dest, PACKING, workers=2)
    pytest.importorskip("megatron.energon", reason="make bench installs Megatron-Energon --no-deps")
    from bench.image_text_energon import energon_loader

    return energon_loader(dest, PACKING, 2, window=N // SHARDS)


@pytest.mark.parametrize("peer", ["dataloader", "energon"])
def test_the_peer_delivers_fastio_s_batches_rows_and_images(dest, peer):
    shape = check_structure(dest, PACKING, {peer: lambda: _peer(peer, dest)})
    assert shape["images"] == ("torch.float32", ("M", 3, 32, 32)) and shape["tokens"][1] == (4, 2049)
    with fastio_loader(dest, PACKING) as ld:
        ours = _epoch(ld)
    theirs = _epoch(_peer(peer, dest))
    assert Counter(_key(s) for r in ours for s in r) == Counter(_key(s) for r in theirs for s in r)
    assert len({_key(s) for r in ours for s in r}) == sum(len(r) for r in ours) == N  # each sample its own
    if peer == "dataloader":  # the same windows (a shard's samples) packed by the same rule: the same rows
        assert Counter(tuple(map(_key, r)) for r in ours) == Counter(tuple(map(_key, r)) for r in theirs)
    else:  # Energon's packing buffers hold what its reader streams: other windows, rows as full
        assert abs(len(ours) - len(theirs)) <= len(ours) // 4
    means = {_key(s): s[4] for r in theirs for s in r}
    images = [(s[4], means[_key(s)]) for r in ours for s in r if len(s[3])]
    assert len(images) > 10
    for fastio_means, peer_means in images:  # the same picture (DALI's and PIL's resize differ a little)
        assert np.abs(fastio_means - peer_means).max() < 0.1


def test_samples_in_counts_each_conversation_once(dest):
    with fastio_loader(dest, PACKING) as ld:
        assert sum(samples_in(b) for b in ld) == N
    assert sum(samples_in(b) for b in peer_loader(dest, PACKING, workers=0)) == N

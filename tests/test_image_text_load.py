"""fastio.ImageText in the Loader (issue 43, the load side): image-text conversations converted by
``convert_image_text`` (the tests' own tokenizer, template and colour-coded images: each image a flat colour naming
its sample and image number), packed whole by best-fit on their expanded cost, each packed segment's tokens, mask
and images checked against the stored sample; max_images; a batch without images; crops a pure function of (seed,
epoch, sample, image number); exact and elastic resume; two gloo ranks, Lightning and Accelerate; an s3:// dataset
through the cache; a mixture with chat and plain token datasets; refusals in one line."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port, start_ranks
from PIL import Image
from resume import check_resume, run_ranks, same_batch
from tokens_helpers import (
    CHATML,
    chat_config,
    chat_dataset,
    conversations,
    image_colour,
    image_text_source,
    stored_conversations,
    stored_image_text,
    word_corpus,
    write_chats,
)
from trainer_runs import accelerate_run, lightning_runs

import fastio
from fastio.convert.image_text import ImageTextOptions, convert_image_text
from fastio.convert.run import ConvertConfig
from fastio.dataset.manifest import MANIFEST_NAME
from fastio.errors import DatasetError, LoaderStateError
from fastio.formats.image_text import MASK_FIELD, TOKENS_FIELD, decode_sample
from fastio.storage import open_storage

SEQ, IMAGE_SEQ, SIZE = 191, 12, 8
N = 36


def _convert(src: dict, dest: Path, source: Path | None = None) -> Path:
    options = ImageTextOptions(src["tokenizer"], src["config"])
    convert_image_text(ConvertConfig(source or src["source"], dest, workers=1, max_samples_per_shard=7), options)
    return dest


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """36 conversations with 0..3 flat-colour images each (:func:`image_text_source`), converted; and a dataset of
    the same tokenizer whose conversations hold no image."""
    root = tmp_path_factory.mktemp("vlm-load")
    src = image_text_source(root, n=N)
    write_chats(root / "text.jsonl", [[{"role": "user", "content": "hi"}, *c] for c in conversations(12, 4)])
    (root / "text.jsonl").write_text("".join(json.dumps({"images": [], "messages": json.loads(line)["messages"]})
                                             + "\n" for line in (root / "text.jsonl").read_text().splitlines()))
    return {"src": src, "ds": _convert(src, root / "ds"), "text": _convert(src, root / "text", root / "text.jsonl"),
            "image_id": json.loads((root / "ds" / "manifest.json").read_text())[
                "convert_options"]["image_text"]["image_token_id"]}


def _eval_image():
    return fastio.ImageEval(size=SIZE, dtype="uint8", crop_ratio=1.0)


def _loader(dest, image=None, **options):
    pipe = {"seq_len": SEQ, "image_seq_len": IMAGE_SEQ, "window": 16, **{k: options.pop(k) for k in
                                                                         ("seq_len", "max_images") if k in options}}
    options = {"batch_size": 2, "device": "cpu", "seed": 3, "reader_threads": 2, "num_threads": 1, **options}
    return fastio.Loader(dest, pipeline=fastio.ImageText(image=image or _eval_image(), **pipe), **options)


def _reference(dest: Path, image_id: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each stored sample's (ids with every image token repeated IMAGE_SEQ times, mask False on them, where each
    image's run starts): transformers-free, from the converted members."""
    out = []
    for sample in stored_image_text(dest):
        ids, mask = decode_sample(sample[TOKENS_FIELD], sample[MASK_FIELD])
        image = ids == image_id
        reps = np.where(image, IMAGE_SEQ, 1)
        runs = (np.cumsum(reps) - reps)[image]
        out.append((np.repeat(ids.astype(np.int64), reps), np.repeat(mask & ~image, reps), runs))
    return out


def _segments(batch: dict) -> list[tuple[int, int, int]]:
    """(row, start, end) of each packed segment (not padding) of a batch, by its segment_ids."""
    seg = batch["segment_ids"].numpy()
    out = []
    for r, row in enumerate(seg):
        for s in np.unique(row[row > 0]).tolist():
            at = np.flatnonzero(row == s)
            assert np.array_equal(at, np.arange(at[0], at[-1] + 1))
            out.append((r, int(at[0]), int(at[-1]) + 1))
    return out


def _nearest(colour: np.ndarray, n: int) -> tuple[int, int]:
    """The (sample, image number) whose :func:`image_colour` is nearest to ``colour``."""
    pairs = [(i, k) for i in range(n) for k in range(4)]
    return min(pairs, key=lambda p: np.abs(np.array(image_colour(*p)) - colour).sum())


def _check_batch(batch: dict, ref: list, by_tokens: dict, image_id: int, only: np.ndarray | None = None
                 ) -> list[tuple[int, int]]:
    """Every segment of ``batch`` (in rows ``only``, None: all) against the stored sample it holds (found by its
    tokens): tokens, mask, position ids, image runs and each image's colour; (row, sample) of each segment."""
    tokens, mask, pos = batch["tokens"].numpy(), batch["loss_mask"].numpy(), batch["position_ids"].numpy()
    rows, starts, images = batch["image_rows"].numpy(), batch["image_starts"].numpy(), batch["images"].numpy()
    assert images.shape == (len(rows), 3, SIZE, SIZE) and images.dtype == np.uint8
    assert not mask[batch["segment_ids"].numpy() == 0].any() and not mask[tokens == image_id].any()
    found, m = [], 0
    for r, a, b in _segments(batch):
        if only is not None and r not in only:
            continue
        sample = by_tokens[tokens[r, a:b].tobytes()].pop()
        ids, want_mask, runs = ref[sample]
        assert np.array_equal(mask[r, a:b], want_mask) and np.array_equal(pos[r, a:b], np.arange(b - a))
        for k, run in enumerate(runs.tolist()):
            assert (int(rows[m]), int(starts[m])) == (r, a + run)
            assert (tokens[r, a + run:a + run + IMAGE_SEQ] == image_id).all()
            colour = images[m].reshape(3, -1).mean(axis=1)
            assert np.abs(colour - image_colour(sample, k)).max() <= 8 and _nearest(colour, len(ref)) == (sample, k)
            m += 1
        found.append((r, sample))
    assert m == len(rows)
    cu, starts = batch["cu_seqlens"].numpy(), [r * (SEQ + 1) + a for r, a, _ in _segments(batch)]
    assert set(cu[:-1].tolist()) >= {r * SEQ + a for r, a, _ in _segments(batch) if a < SEQ} and len(starts)
    assert cu[-1] == tokens.shape[0] * SEQ and batch["max_seqlen"] == int(np.diff(cu).max())
    return found


def _by_tokens(ref: list) -> dict[bytes, list[int]]:
    out: dict[bytes, list[int]] = {}
    for i, (ids, _, _) in enumerate(ref):
        out.setdefault(ids.tobytes(), []).append(i)
    return out


def test_every_segment_holds_its_samples_tokens_mask_and_images_each_sample_once_an_epoch(vlm):
    ref = _reference(vlm["ds"], vlm["image_id"])
    with _loader(vlm["ds"], batch_size=3) as ld:
        for epoch in range(2):
            seen, empty = [], 0
            for batch in ld:
                assert batch["tokens"].shape == (3, SEQ + 1) and batch["tokens"].dtype == torch.int64
                padded = batch["padded"].numpy()
                found = _check_batch(batch, ref, _by_tokens(ref), vlm["image_id"])
                seen += [sample for r, sample in found if not padded[r]]  # a padded row repeats a sequence
                empty += (batch["segment_ids"].numpy() == 0).any()
            assert ld.epoch == epoch + 1
            assert sorted(seen) == list(range(N))  # every sample once an epoch
            assert empty  # best-fit leaves padding somewhere
    assert sum(len(r[2]) for r in ref) > N  # the samples hold images


def test_max_images_bounds_every_sequence_and_the_batch(vlm):
    def images_per_row(**options):
        with _loader(vlm["ds"], seq_len=511, batch_size=2, **options) as ld:
            return [np.bincount(b["image_rows"].numpy(), minlength=2)[~b["padded"].numpy()] for b in ld]
    free = np.concatenate(images_per_row())
    capped = np.concatenate(images_per_row(max_images=3))
    assert free.max() > 3 and capped.max() <= 3  # the budget binds, and the packer keeps it
    assert capped.sum() == free.sum()  # every image still delivered (padded rows repeat a sequence: not counted)
    with pytest.raises(DatasetError, match=r"ds: shard \S+ key '00000003': 3 images, more than max_images = 2 a "
                                           r"sequence: a sample is never cut"):
        _loader(vlm["ds"], max_images=2)


def test_the_graph_is_built_for_the_most_images_a_batch_can_hold():
    def per_unit(**options):
        return fastio.ImageText(seq_len=SEQ, image_seq_len=IMAGE_SEQ, **options).graph().per_unit
    assert per_unit() == (SEQ + 1) // IMAGE_SEQ == 16  # an image costs IMAGE_SEQ tokens at least
    assert per_unit(max_images=3) == 3 and per_unit(max_images=100) == 16
    train = fastio.ImageText(image=fastio.ImageTrain(size=SIZE, dtype="float16"), max_images=3)
    assert train.evaluation() == fastio.ImageText(image=fastio.ImageEval(size=SIZE, dtype="float16"), max_images=3)


def test_a_batch_without_images_has_images_of_shape_0(vlm):
    with _loader(vlm["text"], image=fastio.ImageTrain(size=SIZE)) as ld:
        got = list(ld)
    assert got and all(b["images"].shape == (0, 3, SIZE, SIZE) and b["images"].dtype == torch.float32 for b in got)
    assert all(b["image_rows"].shape == (0,) and b["loss_mask"].any() for b in got)
    assert all(b[k].view(torch.uint8).numel() == 0 for b in got for k in ("image_rows", "image_starts"))


@pytest.fixture(scope="module")
def striped(tmp_path_factory):
    """12 conversations whose images are not flat (stripes in a colour of their own): a crop shows."""
    root = tmp_path_factory.mktemp("vlm-striped")
    src = image_text_source(root, n=12, size=(32, 24))
    for path in (root / "img").iterdir():
        img = np.array(Image.open(path).convert("RGB"))
        img[:, :, 1] = np.arange(img.shape[1])[None, :] * 7 % 256
        img[:, :, 2] = np.arange(img.shape[0])[:, None] * 10 % 256
        Image.fromarray(img).save(path.with_suffix(".png"))
        path.unlink() if path.suffix != ".png" else None
    text = (root / "vlm.jsonl").read_text().replace(".jpg", ".png")
    (root / "vlm.jsonl").write_text(text)
    return _convert(src, root / "ds")


def _crops(dest, seed=3, epochs=1, **options) -> dict[tuple[int, int, int], bytes]:
    """(epoch, sample's first token run bytes hash, image number) -> the image's bytes, over ``epochs`` epochs."""
    out = {}
    with _loader(dest, image=fastio.ImageTrain(size=SIZE, dtype="uint8"), seed=seed, **options) as ld:
        for epoch in range(epochs):
            for b in ld:
                keys = b["index"].numpy()
                for m, (r, s) in enumerate(zip(b["image_rows"].tolist(), b["image_starts"].tolist())):
                    out[(epoch, int(keys[r]), s)] = b["images"][m].numpy().tobytes()
    return out


def test_train_crops_are_a_pure_function_of_seed_epoch_sample_and_image_number(striped):
    a = _crops(striped, epochs=2, batch_size=2)
    b = _crops(striped, epochs=1, batch_size=3, reader_threads=1)
    assert len(a) > 10 and all(a[key] == b[key] for key in b)  # the batch and the threads do not matter
    c = _crops(striped, seed=4)
    assert sum(a[key] != c.get(key, a[key]) for key in a) > 0  # the seed does
    images = Counter(a.values())
    assert max(images.values()) < len(a) / 2  # crops differ between images and epochs


def test_exact_resume_is_bitwise_with_train_crops(vlm):
    state = check_resume(lambda: _loader(vlm["ds"], image=fastio.ImageTrain(size=SIZE)), n=3, k=4)
    assert state["image_text"] == {"version": 1, "seq_len": SEQ, "image_seq_len": IMAGE_SEQ, "packing": "best-fit",
                                   "max_images": None, "window": 16, "packing_version": 2}
    assert len(json.dumps(state)) < 500


def _ids(steps):
    return [i for step in steps for b in step for i, p in zip(b["index"].tolist(), b["padded"].tolist()) if not p]


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
def test_elastic_resume_delivers_each_remaining_sequence_once(vlm, old, new):
    make = lambda world, rank: _loader(vlm["ds"], batch_size=1, world_size=world, rank=rank)  # noqa: E731
    before, states = run_ranks([make(old, r) for r in range(old)], n=2)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1
    after, _ = run_ranks([make(new, r) for r in range(new)], state=states[0])
    whole, _ = run_ranks([make(1, 0)])
    assert Counter(_ids(before) + _ids(after)) == Counter(_ids(whole))
    assert len(set(_ids(whole))) == len(_ids(whole)) > 6


def _ddp_rank(rank: int, world: int, port: int, dest: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        with _loader(dest, batch_size=1) as ld:
            got = []
            for batch in ld:
                dist.all_reduce(torch.ones(1))  # a DDP step: hangs if one rank ran out of batches
                got.append((batch["index"].tolist(), batch["padded"].tolist(), batch["images"].shape[0]))
            torch.save({"got": got, "rank": ld.rank, "world": ld.world_size}, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_read_each_sequence_once(vlm, tmp_path):
    start_ranks(_ddp_rank, (2, free_port(), str(vlm["ds"]), str(tmp_path)), 2)
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [(r["rank"], r["world"]) for r in runs] == [(0, 2), (1, 2)]
    ids = [i for r in runs for idx, pad, _ in r["got"] for i, p in zip(idx, pad) if not p]
    with _loader(vlm["ds"], batch_size=1) as ld:
        whole = [int(b["index"][0]) for b in ld]
    assert sorted(ids) == sorted(whole) == list(range(len(whole)))
    assert len(runs[0]["got"]) == len(runs[1]["got"]) and sum(m for r in runs for *_, m in r["got"]) > 0


def test_bad_options_are_refused_naming_the_value():
    for options, said in [({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
                          ({"image_seq_len": -1}, "image_seq_len must be a positive integer, got -1"),
                          ({"packing": "concat"}, "packing must be 'best-fit' .*, got 'concat'"),
                          ({"max_images": 0}, "max_images must be a positive integer, got 0"),
                          ({"max_images": 1.5}, "max_images must be a positive integer, got 1.5"),
                          ({"window": True}, "window must be a positive integer, got True"),
                          ({"image": fastio.Raw()}, "image must be a fastio.ImageTrain or fastio.ImageEval, got Raw")]:
        with pytest.raises(ValueError, match=said):
            fastio.ImageText(**options)


def test_other_datasets_and_unpackable_samples_are_refused_in_one_line(vlm, image_dataset, tmp_path):
    (tmp_path / "w").mkdir()
    for dest, what in [(image_dataset, "a dataset of kind 'samples'"), (word_corpus(tmp_path / "w"), "a token dataset")]:
        with pytest.raises(DatasetError, match=rf"^\S+: {what}, not an image-text dataset .* fastio.ImageText reads "
                                               r"datasets of fastio convert --image-field \(docs/image-text.md\)$"):
            _loader(dest)
    with pytest.raises(DatasetError, match=r"^\S+/ds: shard \S+ key '\d+': \d+ tokens with its \d images expanded to "
                                           r"image_seq_len 12, more than seq_len \+ 1 = 65: a sample is never cut; "
                                           r"raise seq_len to at least \d+, or convert again with --max-tokens 65 "
                                           r"--image-seq-len 12 --overlong drop$"):
        _loader(vlm["ds"], seq_len=64)


def test_a_state_of_other_options_or_another_kind_is_refused(vlm):
    with _loader(vlm["ds"]) as ld:
        list(islice(iter(ld), 2))
        state = ld.state_dict()
    with _loader(vlm["ds"], max_images=3) as other, pytest.raises(
            LoaderStateError, match=r"image_text max_images=None, this Loader's fastio.ImageText max_images=3"):
        other.load_state_dict(state)
    with _loader(vlm["ds"]) as ld, pytest.raises(LoaderStateError, match="version=2, this Loader's .* version=1"):
        ld.load_state_dict({**state, "image_text": {**state["image_text"], "version": 2}})


@pytest.mark.parametrize("max_images", [None, 3])
def test_a_state_of_another_packing_version_is_refused_naming_both_and_the_next_epoch(vlm, max_images):
    """a242d84 changed max_images' packing without a word in the state: a state saved before resumed onto other
    sequences silently. The entry now records PACKING_VERSION; another is refused naming both and the next epoch,
    which next_epoch_state packs anew; a state saved before the field is taken as today's packing (all but the
    first hour of ImageText's states were made by it: fastio/tokens/packing.py's PACKING_VERSION)."""
    from fastio.tokens.packing import PACKING_VERSION

    with _loader(vlm["ds"], max_images=max_images) as ld:
        stream = iter(ld)
        list(islice(stream, 2))
        state = ld.state_dict()
        want = next(stream)
    entry = state["image_text"]
    assert entry["packing_version"] == PACKING_VERSION
    other = {**state, "image_text": {**entry, "packing_version": PACKING_VERSION - 1}}
    with _loader(vlm["ds"], max_images=max_images) as ld:
        with pytest.raises(LoaderStateError, match=rf"^loader state's image_text entry was packed by packing version "
                                                   rf"{PACKING_VERSION - 1}, this fastio packs by version "
                                                   rf"{PACKING_VERSION} .*loader_policy='next-epoch'"):
            ld.load_state_dict(other)
        moved = ld.next_epoch_state(other)
        assert (moved["epoch"], moved["consumed"]) == (1, 0)
        ld.load_state_dict(moved)  # nothing of that epoch delivered: packed anew
        assert ld.state_dict()["image_text"]["packing_version"] == PACKING_VERSION
    before = {**state, "image_text": {k: v for k, v in entry.items() if k != "packing_version"}}
    with _loader(vlm["ds"], max_images=max_images) as ld:
        ld.load_state_dict(before)
        assert torch.equal(next(iter(ld))["tokens"], want["tokens"])
    tokens = fastio.Loader(vlm["ds"], pipeline=fastio.Raw(), batch_size=2, device="cpu", seed=3)
    raw_state = tokens.state_dict()
    tokens.close()
    with _loader(vlm["ds"]) as ld, pytest.raises(LoaderStateError, match="not of packed image-text sequences"):
        ld.load_state_dict(raw_state)


# -- a mixture with chat and plain token datasets ---------------------------------------------------------------

@pytest.fixture(scope="module")
def mixed(vlm, tmp_path_factory):
    """The image-text dataset, a chat token dataset (30 conversations) and a plain token dataset (120 documents),
    all three of the image-text source's tokenizer file (a mixture of other tokenizers is refused:
    tests/test_mixture_tokenizers.py)."""
    root = tmp_path_factory.mktemp("vlm-mix")
    (root / "plain").mkdir()
    (root / "c").mkdir()
    shutil.copy(vlm["src"]["tokenizer"], root / "c" / "tokenizer.json")
    return {"vlm": vlm["ds"], "chat": chat_dataset(root / "c", n=30),
            "plain": word_corpus(root / "plain", vlm["src"]["tokenizer"])}


def _mix_loader(mixed, image=None, **options):
    return _loader(fastio.Mixture(mixed, weights={"vlm": 2, "chat": 1, "plain": 1}), image=image, **options)


def test_a_mixture_packs_image_text_chat_and_plain_sources_each_row_as_its_source_wants(vlm, mixed):
    ref = _reference(vlm["ds"], vlm["image_id"])
    chats = {np.asarray(ids, np.int64).tobytes(): np.asarray(mask, bool) for ids, mask in
             stored_conversations(mixed["chat"])}
    rows_of = Counter()
    with _mix_loader(mixed, batch_size=4) as ld:
        for batch in ld:
            source = batch["source"].numpy()
            rows_of.update(source.tolist())
            assert set(batch["image_rows"].tolist()) <= set(np.flatnonzero(source == 0).tolist())
            _check_batch(batch, ref, _by_tokens(ref), vlm["image_id"], only=np.flatnonzero(source == 0))
            tokens, mask = batch["tokens"].numpy(), batch["loss_mask"].numpy()
            for r, a, b in _segments(batch):
                if source[r] == 1:  # a whole conversation, its stored mask
                    assert np.array_equal(mask[r, a:b], chats[tokens[r, a:b].tobytes()])
                elif source[r] == 2:  # a plain document trains every token
                    assert mask[r, a:b].all()
            assert not mask[batch["segment_ids"].numpy() == 0].any()
    assert rows_of[0] > rows_of[1] > 0 and rows_of[2] > 0


def test_a_mixture_resumes_exactly_and_on_another_number_of_ranks(mixed):
    check_resume(lambda: _mix_loader(mixed, image=fastio.ImageTrain(size=SIZE)), n=3, k=3)

    def ids(steps):
        return [(int(s), int(i)) for step in steps for b in step
                for s, i, p in zip(b["source"], b["index"], b["padded"]) if not p]
    make = lambda world, rank: _mix_loader(mixed, world_size=world, rank=rank)  # noqa: E731
    before, states = run_ranks([make(2, r) for r in range(2)], n=2)
    after, _ = run_ranks([make(3, r) for r in range(3)], state=states[0])
    whole, _ = run_ranks([make(1, 0)])
    assert Counter(ids(before) + ids(after)) == Counter(ids(whole))


def test_a_mixture_of_other_kinds_is_refused_naming_the_source(mixed, image_dataset):
    with pytest.raises(DatasetError, match=r"mixture source 'vlm': \S+: an image-text dataset .*read it with "
                                           r"fastio\.ImageText"):
        fastio.Loader(fastio.Mixture(mixed), pipeline=fastio.Tokens(seq_len=SEQ, packing="best-fit"), batch_size=2,
                      device="cpu")
    with pytest.raises(DatasetError, match=r"mixture source 'img': \S+: a dataset of kind 'samples', not an "
                                           "image-text dataset"):
        _loader(fastio.Mixture({"vlm": mixed["vlm"], "img": image_dataset}))


class _TinyVLM(torch.nn.Module):
    """A vision encoder (one linear map of each image) whose output replaces its run's token embeddings, and a
    bigram head trained on the loss mask: enough to train on the batches and compare weights."""

    def __init__(self):
        super().__init__()
        self.vision, self.emb, self.out = torch.nn.Linear(3 * SIZE * SIZE, 8), torch.nn.Embedding(400, 8), \
            torch.nn.Linear(8, 400)

    def loss(self, batch):
        x = self.emb(batch["tokens"])
        feats = self.vision(batch["images"].flatten(1))
        for m, (r, s) in enumerate(zip(batch["image_rows"].tolist(), batch["image_starts"].tolist())):
            x[r, s:s + IMAGE_SEQ] = feats[m]
        logits = self.out(x[:, :-1]).flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, batch["tokens"][:, 1:].flatten(), reduction="none")
        mask = batch["loss_mask"][:, 1:].flatten()
        return (loss * mask).sum() / mask.sum().clamp(min=1)


def test_lightning_resumes_an_image_text_run_mid_epoch(vlm, tmp_path):
    full, resumed, state = lightning_runs(  # 7 batches an epoch: 9 steps run into epoch 1
        tmp_path, lambda: _loader(vlm["ds"], image=fastio.ImageTrain(size=SIZE), batch_size=3), _TinyVLM, 9, 4)
    assert (state["epoch"], state["consumed"]) == (0, 12) and state["image_text"]["image_seq_len"] == IMAGE_SEQ
    assert resumed.seen == full.seen[4:] and len(resumed.seen) == 5
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), full.state_dict().values()))


def test_accelerate_save_state_then_load_state_continues_the_sequences(vlm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make = lambda: _loader(vlm["ds"], image=fastio.ImageTrain(size=SIZE), batch_size=3)  # noqa: E731
    seen, want = accelerate_run(make, _TinyVLM, 10, save_at=5)  # 7 batches an epoch: into epoch 1
    again, got = accelerate_run(make, _TinyVLM, 5, resume="state")
    assert again == seen[5:]
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_an_s3_dataset_through_the_cache_gives_the_local_batches(vlm, moto_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/vlm"
    open_storage(url, moto_server.options()).publish_dir(vlm["ds"], keys_last=(MANIFEST_NAME,))
    remote = _loader(url, image=fastio.ImageTrain(size=SIZE), cache_dir=str(tmp_path / "cache"), cache_size="1GB",
                     storage_options=moto_server.options())
    local = _loader(vlm["ds"], image=fastio.ImageTrain(size=SIZE))
    with remote, local:
        got = list(zip(remote, local, strict=True))
        stats = remote.stats()["storage"]
    assert got and all(same_batch(a, b) for a, b in got)
    assert stats["bytes_downloaded"] == sum(p.stat().st_size for p in (vlm["ds"] / "shards").glob("*.tar"))


def test_each_images_crop_is_drawn_from_its_own_sequences_epoch_and_its_draw_key():
    from fastio.pipelines.augment import random_resized_crop
    from fastio.tokens.image_text import ImageTextBatch, draw_keys

    png = np.frombuffer(_png((30, 20)), np.uint8)
    keys = draw_keys(np.array([7, 7, 3, 9, 3]), np.array([0, 1, 0, 0, 1]))
    assert len(set(keys.tolist())) == 5 and keys[1] == (7 << 16) | 1
    sizes, epochs = np.array([[30, 20]] * 5), np.array([2, 5, 2, 5, 2])  # a mixture's batch: two source epochs
    batch = ImageTextBatch(np.arange(2), {}, [png] * 5, sizes, keys, epochs)
    pipe = fastio.ImageText(image=fastio.ImageTrain(size=SIZE))
    encoded, index, anchor, shape, flip = pipe.graph().feed(batch, seed=11, epoch=0)
    assert len(encoded) == 5 and index.tolist() == keys.tolist()
    for m in range(5):
        want = random_resized_crop(11, int(epochs[m]), keys[m:m + 1], sizes[m:m + 1, 0], sizes[m:m + 1, 1])
        assert np.array_equal(anchor[m], want.anchor[0]) and np.array_equal(shape[m], want.shape[0])
        assert flip[m] == want.flip[0]


def _png(size: tuple[int, int]) -> bytes:
    import io

    buf = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def _handmade(dest: Path, samples: list[dict]) -> Path:
    """A dataset of ``samples`` written by the shard writer, its manifest saying image-text (image token id 5)."""
    from fastio.dataset.shards import ShardWriter

    with ShardWriter(dest) as writer:
        for sample in samples:
            writer.write(sample)
        writer.close()
    manifest = json.loads((dest / MANIFEST_NAME).read_text())
    manifest["convert_options"] = {"image_text": {"image_token_id": 5}}
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
    return dest


def test_a_sample_whose_image_tokens_are_not_its_images_or_without_tokens_is_named(tmp_path):
    png = _png((4, 4))
    ids = np.array([1, 5, 5, 2], np.int32).tobytes()  # two image tokens
    bad = _handmade(tmp_path / "bad", [{"__key__": "a", "0.png": png, TOKENS_FIELD: ids, MASK_FIELD: b"\x0f"}])
    with _loader(bad, batch_size=1) as ld, pytest.raises(
            DatasetError, match=r"bad: shard \S+ key 'a': 2 image tokens \(id 5\) but a different number of image "
                                "members"):
        next(iter(ld))
    lacking = _handmade(tmp_path / "lacking", [{"__key__": "a", "0.png": png, TOKENS_FIELD: ids, MASK_FIELD: b"\0"},
                                               {"__key__": "b", "0.png": png, MASK_FIELD: b"\0"}])
    with pytest.raises(DatasetError, match=r"lacking: shard \S+ key 'b': an image-text sample without tokens.i32"):
        _loader(lacking, batch_size=1)


def test_an_image_dali_cannot_decode_is_named_by_its_sample_and_field(tmp_path):
    good, broken = _png((6, 5)), _png((6, 5))[:45]  # the header is whole (its size reads), the pixels are not
    ids = np.array([1, 5, 2], np.int32).tobytes()
    bad = _handmade(tmp_path / "bad", [{"__key__": k, "0.png": png, TOKENS_FIELD: ids, MASK_FIELD: b"\x01"}
                                       for k, png in (("a", good), ("b", broken), ("c", good))])
    with _loader(bad, batch_size=1) as ld, pytest.raises(  # one sequence holds the three
            DatasetError, match=r"^\S+/bad: shard \S+ key 'b': field '0.png' failed to decode \(\w+: .*\)$"):
        next(iter(ld))


def test_drop_last_and_partial_remainder_on_three_ranks(vlm):
    n = len(_ids(run_ranks([_loader(vlm["ds"], batch_size=1)])[0]))  # the sequences of an epoch
    steps, _ = run_ranks([_loader(vlm["ds"], batch_size=2, world_size=3, rank=r, drop_last=True) for r in range(3)])
    assert len(steps) == n // 6 and len(_ids(steps)) == len(steps) * 6
    steps, _ = run_ranks([_loader(vlm["ds"], batch_size=2, world_size=3, rank=r, remainder="partial")
                          for r in range(3)])
    assert sorted(_ids(steps)) == list(range(n))


TRAIN_ALL = CHATML.replace("{% if message['role'] == 'assistant' %}", "{% if true %}")
"""ChatML with every turn (the user's, with its image tokens, too) inside a generation span."""


def test_image_tokens_are_never_trained_even_where_the_template_trains_the_turn_holding_them(vlm, tmp_path):
    src = {**vlm["src"], "config": chat_config(tmp_path / "tokenizer_config.json", TRAIN_ALL)}
    dest = _convert(src, tmp_path / "all")
    stored = [decode_sample(s[TOKENS_FIELD], s[MASK_FIELD]) for s in stored_image_text(dest)]
    assert any(m[ids == vlm["image_id"]].any() for ids, m in stored)  # the stored mask covers image tokens
    ref = _reference(dest, vlm["image_id"])  # the stored mask, False on image tokens
    with _loader(dest) as ld:
        for batch in islice(ld, 6):
            _check_batch(batch, ref, _by_tokens(ref), vlm["image_id"])
            image = batch["tokens"].numpy() == vlm["image_id"]
            assert image.any() and not batch["loss_mask"].numpy()[image].any()


ASSISTANT_FIRST = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                   "{% endgeneration %}{% else %}{{ '\\n[' + m.role + '] ' + m.content + '\\n' }}{% endif %}{% endfor %}")
"""A template that renders an assistant's message first as its bare text, a generation block from character 0."""


def test_no_conversations_first_token_is_a_target(vlm, tmp_path):
    """A conversation whose first token is trained (it opens with the assistant's words): packed after another,
    that token's target slot would be predicted from the other's last token, a target transformers never trains;
    its loss_mask is False wherever it lands, every other trained token True (as fastio.Tokens does)."""
    (tmp_path / "t.jinja").write_text(ASSISTANT_FIRST)
    line = {"images": [], "messages": [{"role": "assistant", "content": "alpha beta"},
                                       {"role": "user", "content": "gamma"}, {"role": "assistant", "content": "delta"}]}
    (tmp_path / "c.jsonl").write_text((json.dumps(line) + "\n") * 6)
    convert_image_text(ConvertConfig(tmp_path / "c.jsonl", tmp_path / "ds", workers=1),
                       ImageTextOptions(vlm["src"]["tokenizer"], tmp_path / "t.jinja"))
    (ids, stored, _), = set((tuple(i), tuple(m), ()) for i, m, _ in _reference(tmp_path / "ds", vlm["image_id"]))
    assert stored[0] and sum(stored) > 1  # the first token is one the template trains
    later = 0
    with _loader(tmp_path / "ds", seq_len=3 * len(ids) - 1) as ld:
        for b in ld:
            tokens, mask = b["tokens"].numpy(), b["loss_mask"].numpy()
            for r, a, e in _segments(b):
                assert tuple(tokens[r, a:e]) == ids and tuple(mask[r, a:e]) == (False, *stored[1:])
                later += a > 0
    assert later > 0

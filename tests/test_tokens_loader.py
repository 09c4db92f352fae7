"""fastio.Tokens in the Loader: packed sequences as batches, ranks, drop_last/remainder, exact and elastic resume,
refusals naming the dataset and the pipeline."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch
from resume import check_resume, run_ranks, same_batch
from tokens_helpers import word_corpus
from trainer_runs import accelerate_run, lightning_runs

import fastio
from bench.token_dataset import TokenDataset
from fastio import Raw
from fastio.errors import DatasetError, LoaderStateError

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return word_corpus(tmp_path_factory.mktemp("tokens-loader"))


def _loader(corpus, packing="concat", **options):
    options = {"batch_size": 4, "device": "cpu", "seed": 3, "reader_threads": 2, **options}
    return fastio.Loader(corpus, pipeline=fastio.Tokens(seq_len=SEQ, packing=packing, window=8), **options)


def _ids(steps):
    return [i for step in steps for b in step for i, p in zip(b["index"].tolist(), b["padded"].tolist()) if not p]


def test_concat_batches_cover_the_corpus_once_on_two_ranks(corpus):
    ds = TokenDataset(corpus)
    steps, _ = run_ranks([_loader(corpus, world_size=2, rank=r) for r in range(2)])
    ids = _ids(steps)
    p = ds.packing(SEQ, seed=3, block_docs=8)
    assert sorted(ids) == list(range(p.sequences))  # every sequence once (remainder="pad": repeats flagged)
    stream = []
    for step in steps:
        for b in step:
            assert set(b) == {"tokens", "position_ids", "cu_seqlens", "segment_ids", "max_seqlen", "index", "padded"}
            t, pos, cu = b["tokens"].numpy(), b["position_ids"].numpy(), b["cu_seqlens"].numpy()
            assert t.dtype == np.int64 and t.shape == (4, SEQ + 1) and pos.dtype == np.int64 and cu.dtype == np.int32
            for row, s in zip(t, b["index"].tolist()):
                assert np.array_equal(row, ds.read(p.pieces(0, s)))  # the packing's own sequence
            after_eos = np.flatnonzero(t[:, :-1].reshape(-1) == ds.eos_id) + 1
            starts = np.union1d(np.arange(0, t[:, :-1].size, SEQ), after_eos[after_eos < t[:, :-1].size])
            assert np.array_equal(cu, np.r_[starts, t[:, :-1].size])
            assert (pos[:, 0] == 0).all() and (pos[:, 1:][t[:, :-1] == ds.eos_id] == 0).all()
            stream += [row[:-1] for row, p_ in zip(t, b["padded"].tolist()) if not p_]
    counts = np.bincount(np.concatenate(stream), minlength=300)
    docs = np.concatenate([s.document(j) for s in ds.shards for j in range(s.documents)]).astype(np.int64)
    left = np.bincount(docs, minlength=300) - counts
    assert left.min() >= 0 and left.sum() < SEQ + 1  # no token twice, at most one sequence's tail left out


def test_best_fit_marks_padding_and_cuts_no_short_document(corpus):
    ds = TokenDataset(corpus)
    with _loader(corpus, packing="best-fit", batch_size=8) as ld:
        real = 0
        for b in ld:
            t, mask = b["tokens"].numpy(), b["loss_mask"].numpy()
            assert mask.dtype == bool and mask.shape == t.shape
            real += int(mask[~b["padded"].numpy()].sum())
            assert (t[~mask] == ds.eos_id).all()
    longest = max(s.document(j).size for s in ds.shards for j in range(s.documents))
    assert longest > SEQ + 1  # some documents are split; every token is still delivered once
    assert real == ds.info.total_tokens


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_exact_resume_is_bitwise(corpus, packing):
    state = check_resume(lambda: _loader(corpus, packing), n=5, k=6)
    assert state["tokens"] == {"seq_len": SEQ, "packing": packing, "window": 8, "packing_version": 2}
    assert len(json.dumps(state)) < 400  # a position, not a packing buffer


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_elastic_resume_delivers_each_remaining_sequence_once(corpus, packing, old, new):
    before, states = run_ranks([_loader(corpus, packing, world_size=old, rank=r) for r in range(old)], n=3)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1
    after, _ = run_ranks([_loader(corpus, packing, world_size=new, rank=r) for r in range(new)], state=states[0])
    whole, _ = run_ranks([_loader(corpus, packing)])
    assert Counter(_ids(before) + _ids(after)) == Counter(_ids(whole))
    assert len(set(_ids(whole))) == len(_ids(whole))


def test_drop_last_and_partial_remainder(corpus):
    n = TokenDataset(corpus).packing(SEQ, seed=3, block_docs=8).sequences
    steps, _ = run_ranks([_loader(corpus, world_size=3, rank=r, drop_last=True) for r in range(3)])
    assert len(steps) == n // 12 and len(_ids(steps)) == len(steps) * 12
    steps, _ = run_ranks([_loader(corpus, world_size=3, rank=r, remainder="partial") for r in range(3)])
    assert sorted(_ids(steps)) == list(range(n))
    # a batch larger than the epoch's sequences: one step of all of them, split over the ranks
    steps, _ = run_ranks([_loader(corpus, world_size=3, rank=r, remainder="partial", batch_size=n + 5)
                          for r in range(3)])
    assert len(steps) == 1 and sorted(_ids(steps)) == list(range(n))
    assert [len(b["index"]) for b in steps[0]] == [n // 3 + (r < n % 3) for r in range(3)]


def test_refusals_name_the_dataset_and_the_pipeline(corpus, image_dataset):
    with pytest.raises(DatasetError, match=r"ds: a dataset of stored samples .*fastio\.Tokens reads token datasets"):
        fastio.Loader(image_dataset, pipeline=fastio.Tokens(seq_len=8), batch_size=2, device="cpu")
    for pipeline in (fastio.Raw(), fastio.ImageTrain(), fastio.ImageEval()):
        with pytest.raises(DatasetError, match=r"ds: a token dataset .*pipeline '(raw|image-train|image-eval)' reads "
                                               r"stored samples: read it with fastio\.Tokens"):
            fastio.Loader(corpus, pipeline=pipeline, batch_size=2, device="cpu")
    with pytest.raises(DatasetError, match=r"mixture sources 'a' .* and 'b' .*: 'a' is a token dataset and 'b' holds "
                                           r"stored samples"):
        fastio.Mixture({"a": corpus, "b": image_dataset})
    with pytest.raises(DatasetError, match=r"ds: seq_len 100000 needs more than 100000 tokens"):
        fastio.Loader(corpus, pipeline=fastio.Tokens(seq_len=100_000), batch_size=2, device="cpu")
    with pytest.raises(ValueError, match="packing must be one of concat, best-fit, got 'bfd'"):
        fastio.Tokens(packing="bfd")
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        fastio.Tokens(seq_len=0)


def test_a_state_packed_otherwise_is_refused(corpus, image_dataset):
    with _loader(corpus) as ld:
        list(islice(iter(ld), 2))
        state = ld.state_dict()
    other = fastio.Loader(corpus, pipeline=fastio.Tokens(seq_len=SEQ + 1, window=8), batch_size=4, device="cpu",
                          seed=3)
    with pytest.raises(LoaderStateError, match=r"tokens seq_len=16, this Loader's fastio\.Tokens seq_len=17"):
        other.load_state_dict(state)
    other.close()
    with fastio.Loader(image_dataset, pipeline=Raw(), batch_size=4, device="cpu", seed=3) as images:
        image_state = images.state_dict()
    with _loader(corpus) as ld, pytest.raises(LoaderStateError, match="not of packed token sequences"):
        ld.load_state_dict(image_state)


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_a_state_of_another_packing_version_is_refused_naming_both_and_the_next_epoch(corpus, packing):
    """The Tokens entry did not record which packing made the sequences: a change of the packing (as a242d84 made
    to ImageText's) would have resumed onto other sequences silently. Now it records PACKING_VERSION; a state of
    another version is refused naming both and the way forward (the next epoch, packed by this fastio), and a
    state saved before the field continues (the packing is the same since the first Tokens state, c651ae8)."""
    from fastio.tokens.packing import PACKING_VERSION

    with _loader(corpus, packing) as ld:
        stream = iter(ld)
        list(islice(stream, 2))
        state = ld.state_dict()
        want = next(stream)
    assert state["tokens"]["packing_version"] == PACKING_VERSION
    other = {**state, "tokens": {**state["tokens"], "packing_version": PACKING_VERSION - 1}}
    with _loader(corpus, packing) as ld:
        with pytest.raises(LoaderStateError, match=rf"^loader state's tokens entry was packed by packing version "
                                                   rf"{PACKING_VERSION - 1}, this fastio packs by version "
                                                   rf"{PACKING_VERSION} .*start the next epoch .*loader_policy="
                                                   r"'next-epoch'.*set_epoch\(1\)"):
            ld.load_state_dict(other)
        moved = ld.next_epoch_state(other)
        assert (moved["epoch"], moved["consumed"]) == (1, 0)  # nothing of it delivered: packed anew
        ld.load_state_dict(moved)
        got = next(iter(ld))
    with _loader(corpus, packing) as fresh:
        fresh.set_epoch(1)
        assert torch.equal(got["tokens"], next(iter(fresh))["tokens"])
    with _loader(corpus, packing) as ld, pytest.raises(LoaderStateError, match=r"packing_version='2', not an integer"):
        ld.load_state_dict({**moved, "tokens": {**state["tokens"], "packing_version": "2"}})
    before = {**state, "tokens": {k: v for k, v in state["tokens"].items() if k != "packing_version"}}
    with _loader(corpus, packing) as ld:
        ld.load_state_dict(before)  # saved before the field: today's packing made it
        assert torch.equal(next(iter(ld))["tokens"], want["tokens"])


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_an_epoch_past_the_sequence_ids_reach_is_refused_not_an_overflow(corpus, packing):
    """A hand-edited state (or set_epoch) of an epoch whose sequence ids, ``epoch * sequences + sequence``, leave
    int64: refused naming the epoch where the state is checked, not a raw OverflowError on the first batch."""
    with _loader(corpus, packing) as ld:
        next(iter(ld))
        state = ld.state_dict()
        far = 2**63 // ld._sampler.samples
        with pytest.raises(ValueError, match=rf"epoch {far}"):
            ld.set_epoch(far)
    with _loader(corpus, packing) as ld:
        with pytest.raises(LoaderStateError, match=rf"epoch={far}: .*int64"):
            ld.load_state_dict({**state, "epoch": far})
        ld.load_state_dict({**state, "epoch": far - 1})  # the last epoch the ids reach
        assert len(next(iter(ld))["tokens"]) == 4


class _TinyLM(torch.nn.Module):
    """A bigram model: enough to train on the token batches and compare weights."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(300, 8)
        self.out = torch.nn.Linear(8, 300)

    def loss(self, batch):
        x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
        return torch.nn.functional.cross_entropy(self.out(self.emb(x)).flatten(0, 1), y.flatten())


def test_lightning_resumes_a_token_run_mid_epoch(corpus, tmp_path):
    full, resumed, state = lightning_runs(  # 139 sequences: 9 batches an epoch; 12 steps run into epoch 1
        tmp_path, lambda: _loader(corpus, batch_size=16), _TinyLM, 12, 4)
    assert (state["epoch"], state["consumed"]) == (0, 64) and state["tokens"]["seq_len"] == SEQ
    assert resumed.seen == full.seen[4:]
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), full.state_dict().values()))


def test_accelerate_save_state_then_load_state_continues_the_sequences(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen, want = accelerate_run(lambda: _loader(corpus, batch_size=8), _TinyLM, 12, save_at=5)
    again, got = accelerate_run(lambda: _loader(corpus, batch_size=8), _TinyLM, 7, resume="state")
    assert again == seen[5:]
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_an_s3_token_dataset_reads_through_the_cache(corpus, moto_server, s3_bucket, tmp_path):
    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.errors import StorageError
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/corpus"
    open_storage(url, moto_server.options()).publish_dir(corpus, keys_last=(MANIFEST_NAME,))
    opening = dict(cache_dir=str(tmp_path / "cache"), storage_options=moto_server.options())
    remote, local = _loader(url, cache_size="1GB", **opening), _loader(corpus)
    for _ in range(2):  # two epochs: the second from the warm cache
        for x, y in zip(remote, local, strict=True):
            assert same_batch(x, y)
    storage = remote.stats()["storage"]
    assert storage["waited_fills"] + storage["ahead_fills"] == 5 and storage["hits"] > 0
    state = remote.state_dict()
    remote.close()
    local.close()
    assert state["fingerprint"] == TokenDataset(corpus).fingerprint
    shard_bytes = sum(s.stat().st_size for s in (corpus / "shards").glob("*.bin"))
    with pytest.raises(StorageError, match=r"cache_size"):  # shuffle="global" needs every shard in the cache
        _loader(url, cache_size=shard_bytes // 2, **{**opening, "cache_dir": str(tmp_path / "small")})


def test_verify_checks_each_shard_before_its_first_use(corpus, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(corpus, bad)
    shard = bad / "shards" / "shard-000003.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1  # same size, other tokens: only a checksum sees it
    shard.write_bytes(bytes(data))
    with _loader(bad) as ld:
        assert len(list(ld)) == len(ld)  # verify=False: read as it is
    with _loader(bad, verify=True) as ld:
        with pytest.raises(DatasetError, match=r"bad: shard shard-000003\.bin: sha256 mismatch"):
            list(ld)
    index = bad / "shards" / "shard-000001.idx"
    shutil.copy(corpus / "shards" / "shard-000003.bin", shard)
    data = bytearray(index.read_bytes())
    data[-1] ^= 1  # the last document index: the same size
    index.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"bad: shard shard-000001\.idx: sha256 mismatch"):
        _loader(bad, verify=True)


def test_gpt_example_resumes_exactly_after_sigkill(corpus, tmp_path, warm_one_thread):
    """examples/gpt_train.py killed with SIGKILL mid-run: the same command continues from its last committed
    step with the same sequences and bit-identical losses."""
    import sys
    from pathlib import Path

    from resume import killed_and_resumed

    example = Path(__file__).resolve().parent.parent / "examples" / "gpt_train.py"
    command = [sys.executable, str(example), str(corpus), str(tmp_path / "ckpt"), "--seq-len", "32",
               "--batch-size", "4"]
    before, after, start = killed_and_resumed(warm_one_thread, command, tmp_path / "ckpt")
    assert start in (5, 10) and sorted(after) == list(range(start + 1, 19))
    overlap = [s for s in after if s in before]
    assert len(overlap) >= 3 and all(after[s] == before[s] for s in overlap)


def test_inspect_order_reports_the_packing(corpus, capsys):
    from helpers import run_cli

    code, out, err = run_cli(["inspect", str(corpus), "--order", "--seq-len", str(SEQ), "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)["packing"]
    ds = TokenDataset(corpus)
    concat = ds.packing(SEQ, block_docs=4096)
    assert report["concat"] == {"sequences": concat.sequences,
                                "tail_tokens": ds.info.total_tokens - concat.sequences * SEQ}
    for fit in ("best", "first"):
        p = ds.packing(SEQ, packing="best-fit", fit=fit, block_docs=4096)
        assert report[f"{fit}-fit"] == {"sequences": p.sequences, "padding_fraction": round(p.padding_fraction, 6)}
    code, out, _ = run_cli(["inspect", str(corpus), "--order", "--seq-len", str(SEQ)], capsys)
    assert code == 0 and f"packing:  seq_len {SEQ}, window 4096 documents: concat {concat.sequences} sequences" in out
    code, _, err = run_cli(["inspect", str(corpus), "--order", "--seq-len", "100000"], capsys)
    assert code == 2 and err.strip().startswith("fastio: error: --seq-len 100000 needs more than 100000 tokens")
    assert "packing" not in json.loads(run_cli(["inspect", str(corpus), "--json"], capsys)[1])


NO_KEYS = r"ds: a token dataset .*, not as samples: it has no sample keys$"


def test_key_of_a_token_loader_says_sequences_have_no_key_instead_of_calling_the_idx_damaged(token_ds, corpus):
    """``loader.key(i)`` of a Tokens Loader parsed Megatron's .idx as DALI's and said 'part-000.idx: not an index
    (non-ASCII byte ...)': a healthy dataset called damaged."""
    pipe = fastio.Tokens(seq_len=8)
    with fastio.Loader(token_ds, pipeline=pipe, batch_size=2, device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(fastio.DatasetError, match=NO_KEYS) as err:
            loader.key(0)
    assert "not an index" not in str(err.value) and "\n" not in str(err.value)
    mix = fastio.Mixture({"a": corpus, "b": token_ds})  # one dataset twice is refused
    with fastio.Loader(mix, pipeline=pipe, batch_size=2, device="cpu", world_size=1, rank=0) as loader:
        with pytest.raises(fastio.DatasetError, match=NO_KEYS):
            loader.key("b", 0)


def test_clip_pipelines_refuse_a_token_dataset_as_one(token_ds):
    """docs/tokens.md: a token dataset given to a pipeline of stored samples is refused in one line saying so; the
    clip kinds said 'dataset has no video field (its fields: )'."""
    for pipe in (fastio.VideoClips(frames=2, size=8), fastio.AudioClips()):
        with pytest.raises(fastio.DatasetError, match=rf"ds: a token dataset .*pipeline '{pipe.kind}' reads stored "
                                                      r"samples: read it with fastio.Tokens"):
            fastio.Loader(token_ds, pipeline=pipe, batch_size=2, device="cpu", world_size=1, rank=0)

"""A fastio.Mixture of token datasets read with fastio.Tokens: packed sequences mixed by weight (each source's
size in sequences), every batch holding each source's share of sequences, no sequence twice per source epoch,
exact and elastic resume, a schedule counted in sequences, refusals naming both sources."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from resume import batches, check_resume, run_ranks
from tokens_helpers import word_corpus

import fastio
from bench.token_dataset import TokenDataset
from fastio.errors import DatasetError, LoaderStateError
from fastio.order.mixorder import source_seed

SEQ, WINDOW, SEED = 16, 8, 3


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two token datasets of different documents (the second: every document of the first but the first 40)."""
    root = tmp_path_factory.mktemp("tokens-mixture")
    (root / "web").mkdir()
    web = word_corpus(root / "web")
    code = root / "code"
    shutil.copytree(web.parent, code)
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    lines = (code / "c.jsonl").read_text().splitlines(keepends=True)[40:]
    (code / "c.jsonl").write_text("".join(lines))
    convert_tokens(TokenConvertConfig(code / "c.jsonl", code / "ds", code / "tokenizer.json", workers=1,
                                      max_samples_per_shard=25, overwrite=True))
    return {"web": web, "code": code / "ds"}


def _loader(corpora, weights=None, packing="concat", **options):
    options = {"batch_size": 8, "device": "cpu", "seed": SEED, "reader_threads": 2, **options}
    return fastio.Loader(fastio.Mixture(corpora, weights=weights), pipeline=fastio.Tokens(seq_len=SEQ, packing=packing,
                         window=WINDOW), **options)


def _packings(corpora, packing="concat"):
    return {name: TokenDataset(dest).packing(SEQ, packing=packing, seed=source_seed(SEED, name), block_docs=WINDOW)
            for name, dest in corpora.items()}


def _delivered(steps):
    """(source, index) of every sequence delivered (padding repeats left out), in order."""
    return [(s, i) for step in steps for b in step
            for s, i, p in zip(b["source"].tolist(), b["index"].tolist(), b["padded"].tolist()) if not p]


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_each_batch_holds_the_shares_of_sequences_and_the_sources_own_sequences(corpora, packing):
    packings = _packings(corpora, packing)
    names = list(corpora)
    datasets = {name: TokenDataset(dest) for name, dest in corpora.items()}
    with _loader(corpora, {"web": 3, "code": 1}, packing) as ld:
        assert len(ld.mixture) == sum(p.sequences for p in packings.values())  # an epoch in sequences
        assert ld.mixture.sizes == tuple(p.sequences for p in packings.values()) and ld.dataset is ld.mixture
        seen = Counter()
        for _, b in zip(range(12), ld):
            source = b["source"].tolist()
            assert source.count(0) == 6 and source.count(1) == 2  # 3:1 of 8 sequences, in every batch
            assert b["tokens"].shape == (8, SEQ + 1)
            for row, s, i in zip(b["tokens"].numpy(), source, b["index"].tolist()):
                name = names[s]
                epoch = seen[name] // packings[name].sequences  # the source's own epoch: its document order
                seen[name] += 1
                want = datasets[name].read(packings[name].pieces(epoch, i))
                assert np.array_equal(row[:want.size], want)
        stats = ld.stats()["sources"]
    assert stats["web"]["samples"] == 72 and stats["code"]["samples"] == 24 and stats["web"]["share"] == 0.75


def test_no_sequence_twice_in_a_source_epoch(corpora):
    packings = _packings(corpora)
    # the small source weighs as much as the large one: it cycles, each of its epochs a new order
    with _loader(corpora, {"web": 1, "code": 1}, remainder="partial") as ld:
        steps = [[b] for b in ld]
    got = _delivered(steps)
    for s, name in enumerate(corpora):
        mine = [i for src, i in got if src == s]
        size = packings[name].sequences
        for k in range(0, len(mine), size):
            part = mine[k:k + size]
            assert len(set(part)) == len(part) and set(part) <= set(range(size))
    assert len(got) == sum(p.sequences for p in packings.values())  # an epoch's length: the sum of sequences


@pytest.mark.parametrize("shuffle", ["global", "none"])
def test_default_weights_deliver_every_sequence_of_every_source_once_per_epoch(corpora, shuffle):
    packings = _packings(corpora)
    steps, _ = run_ranks([_loader(corpora, world_size=2, rank=r, shuffle=shuffle) for r in range(2)])
    got = _delivered(steps)
    for s, name in enumerate(corpora):
        mine = [i for src, i in got if src == s]
        assert sorted(mine) == list(range(packings[name].sequences))
        if shuffle == "none":  # each source's sequences in their stored order
            assert mine == sorted(mine)


@pytest.mark.parametrize("packing", ["concat", "best-fit"])
def test_exact_resume_is_bitwise(corpora, packing):
    state = check_resume(lambda: _loader(corpora, {"web": 3, "code": 1}, packing), n=5, k=6)
    assert state["mixture"]["samples_per_epoch"] == sum(p.sequences for p in _packings(corpora, packing).values())
    assert len(json.dumps(state)) < 700  # a position, not a packing buffer


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2)])
def test_elastic_resume_delivers_each_remaining_sequence_once(corpora, old, new):
    weights = {"web": 2, "code": 1}
    before, states = run_ranks([_loader(corpora, weights, world_size=old, rank=r) for r in range(old)], n=3)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1
    after, _ = run_ranks([_loader(corpora, weights, world_size=new, rank=r) for r in range(new)], state=states[0])
    whole, _ = run_ranks([_loader(corpora, weights)])
    assert Counter(_delivered(before) + _delivered(after)) == Counter(_delivered(whole))


SCHEDULE = [(0, {"web": 3, "code": 1}), (40, {"web": 1, "code": 1})]


def test_a_schedule_counts_sequences_and_resumes_across_its_change(corpora):
    with _loader(corpora, SCHEDULE) as ld:
        shares = [b["source"].tolist().count(1) for _, b in zip(range(8), ld)]
    assert shares == [2] * 5 + [4] * 3  # the change at sequence 40: after 5 batches of 8
    for n in (3, 6):  # saved before the change, and after it
        check_resume(lambda: _loader(corpora, SCHEDULE), n=n, k=4)


def test_a_schedule_may_change_its_future_but_not_its_past(corpora):
    with _loader(corpora, SCHEDULE) as ld:
        stream = batches(ld)
        [next(stream) for _ in range(3)]
        state = ld.state_dict()  # 24 sequences delivered
    later = [(0, {"web": 3, "code": 1}), (32, {"web": 1, "code": 3})]
    with _loader(corpora, later) as ld:
        ld.load_state_dict(state)
        assert next(iter(ld))["source"].tolist().count(1) == 2  # still 3:1 up to 32
    with _loader(corpora, [(0, {"web": 1, "code": 1})]) as ld, pytest.raises(LoaderStateError, match="position"):
        ld.load_state_dict(state)


def test_refusals_name_both_sources(corpora, image_dataset, tmp_path):
    with pytest.raises(DatasetError, match=r"mixture sources 'web' \(.*\) and 'img' \(.*\): 'web' is a token dataset "
                                           r"and 'img' holds stored samples"):
        fastio.Mixture({"web": corpora["web"], "img": image_dataset})
    other = tmp_path / "other"
    shutil.copytree(corpora["code"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokens"]["eos_id"] = 7
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=r"sources 'web' \(end-of-document id \d+\) and 'other' \(7\)"):
        _loader({"web": corpora["web"], "other": other})


def test_inspect_reports_a_token_mixture_in_sequences(corpora, tmp_path, capsys):
    from helpers import run_cli

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {k: str(v) for k, v in corpora.items()},
                                "weights": [[0, {"web": 3, "code": 1}], [40, {"web": 1, "code": 1}]]}))
    code, out, err = run_cli(["inspect", str(path), "--seq-len", str(SEQ), "--batch-size", "8", "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    sizes = [TokenDataset(dest).packing(SEQ).sequences for dest in corpora.values()]
    assert (info["unit"], info["unit_singular"]) == ("sequences", "sequence")
    assert info["samples_per_epoch"] == sum(sizes) != 200  # not documents
    assert [s["samples"] for s in info["sources"]] == sizes
    assert info["phases"][0]["per_batch"]["code"] == {"expected": 2, "min": 2, "max": 2, "max_deviation": 0}
    assert info["phases"][1]["per_batch"]["code"]["expected"] == 4
    # the Loader's order is the one reported (window 4096 in both)
    with fastio.Loader(fastio.Mixture(corpora, weights=[(0, {"web": 3, "code": 1}), (40, {"web": 1, "code": 1})]),
                       pipeline=fastio.Tokens(seq_len=SEQ), batch_size=8, device="cpu", seed=0) as ld:
        assert [s["samples"] for s in info["sources"]] == list(ld.read_set.target.sizes)
    code, out, _ = run_cli(["inspect", str(path), "--seq-len", str(SEQ)], capsys)
    assert code == 0 and f"{sum(sizes)} sequences per epoch" in out


def test_an_s3_source_reads_through_the_cache_as_a_local_one(corpora, moto_server, s3_bucket, tmp_path):
    from resume import same_batch

    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.storage import open_storage

    url = f"s3://{s3_bucket}/code"
    open_storage(url, moto_server.options()).publish_dir(corpora["code"], keys_last=(MANIFEST_NAME,))
    remote = fastio.Mixture({"web": corpora["web"], "code": url}, weights={"web": 1, "code": 1},
                            cache_dir=str(tmp_path / "cache"), cache_size="1GB",
                            storage_options=moto_server.options())
    with fastio.Loader(remote, pipeline=fastio.Tokens(seq_len=SEQ, window=WINDOW), batch_size=8, device="cpu",
                       seed=SEED) as ld, _loader(corpora, {"web": 1, "code": 1}) as local:
        for x, y in zip(ld, local, strict=True):
            assert same_batch(x, y)
        assert ld.stats()["storage_by_source"]["code"]["waited_fills"] + \
            ld.stats()["storage_by_source"]["code"]["ahead_fills"] == 4  # code's 4 shards, each filled once


def test_a_state_of_another_seq_len_is_refused_naming_it(corpora):
    with _loader(corpora) as ld:
        next(iter(ld))
        state = ld.state_dict()
    other = fastio.Loader(fastio.Mixture(corpora), pipeline=fastio.Tokens(seq_len=SEQ + 1, window=WINDOW), batch_size=8,
                          device="cpu", seed=SEED)
    with pytest.raises(LoaderStateError, match=r"tokens seq_len=16, this Loader's fastio\.Tokens seq_len=17"):
        other.load_state_dict(state)  # not the mixture's sizes, which follow from it
    other.close()


def test_an_epoch_whose_source_epochs_leave_the_ids_reach_is_refused_not_wrapped(corpora):
    """A hand-edited epoch near the end of the mixture's stream: a source drawn more often than its size's share is
    in an own epoch whose sequence ids (``source_epoch * total + base + sequence``) leave int64. Refused naming the
    epoch, where its ids wrapped silently (other sources' sequences, or none of them, delivered as its)."""
    weights = {"web": 0.95, "code": 0.05}
    with _loader(corpora, weights) as ld:
        next(iter(ld))
        state = ld.state_dict()
        n = ld._sampler.schedule.samples_per_epoch
    far = (2**63 // n) * 9 // 10  # a stream position the schedule still counts
    with _loader(corpora, weights) as ld:
        with pytest.raises(LoaderStateError, match=rf"epoch={far}: .*int64"):
            ld.load_state_dict({**state, "epoch": far})
    with _loader(corpora, weights) as ld:  # an epoch the ids reach: the sources the schedule says
        ld.load_state_dict({**state, "epoch": 1000})
        batch = next(iter(ld))
        want, _ = ld._sampler.schedule.sources(1000, np.arange(state["consumed"], state["consumed"] + 8))
        assert batch["source"].tolist() == want.tolist()

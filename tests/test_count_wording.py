"""Messages that count things say one of them in the singular ("1 sample's", "1 of 2 samples has", "1 uint16
token", "1 byte"): each goes through :func:`fastio.words.count` (or :func:`fastio.words.agree` for the word or
verb alone), the one home of the plural rule, which every floor may import. Each test makes the count 1 for real
(a dataset of that shape, a summary of that run) and reads the message a user sees."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli
from test_media import write_wds_tar

import fastio
from fastio.convert.wds_index import IndexConfig, index_shards


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()


def _loader(root: Path, pipeline) -> fastio.Loader:
    return fastio.Loader(root, pipeline=pipeline, batch_size=2, device="cpu", shuffle="none", num_threads=1,
                         world_size=1, rank=0)


def test_one_unprobed_sample_says_one_samples_field(tmp_path):
    from fastio.convert import synthetic

    flac = synthetic.make_audio(tmp_path / "a.flac", seconds=0.5).read_bytes()
    mp3 = synthetic.make_audio(tmp_path / "b.mp3", seconds=0.5).read_bytes()
    write_wds_tar(tmp_path / "wds" / "a-000000.tar", {"k0.flac": flac, "k0.cls": b"0", "k1.mp3": mp3, "k1.cls": b"1"})
    index_shards(IndexConfig(source=tmp_path / "wds"))
    with pytest.raises(fastio.DatasetError, match=r": 1 sample's mp3 could not be probed when indexed \(the first: "
                                                  r"shard a-000000.tar key 'k1'"):
        _loader(tmp_path / "wds", fastio.AudioClips(sample_rate=16000, seconds=0.25))


def test_one_sample_without_a_video_field_has_none(tmp_path):
    from fastio.convert import synthetic

    webm = synthetic.make_video(tmp_path / "v.webm", frames=6, fps=12).read_bytes()
    write_wds_tar(tmp_path / "wds" / "s-000000.tar", {"k0.webm": webm, "k0.cls": b"0", "k1.png": _png(), "k1.cls": b"1"})
    index_shards(IndexConfig(tmp_path / "wds"))
    with pytest.raises(fastio.DatasetError, match=r": 1 of 2 samples has no video field \(the first: shard "
                                                  r"s-000000.tar key 'k1'"):
        _loader(tmp_path / "wds", fastio.VideoClips(frames=2, size=8, dtype="uint8", crop="center"))


def test_one_sample_without_the_label_field_lacks_it(tmp_path):
    write_wds_tar(tmp_path / "wds" / "s-000000.tar", {"k0.png": _png(), "k0.cls": b"0", "k1.png": _png()})
    with pytest.raises(fastio.DatasetError, match=r"^label_field: 1 of 2 samples lacks field 'cls' \(the first: shard "
                                                  r"s-000000.tar key 'k1'\)$"):
        index_shards(IndexConfig(tmp_path / "wds", label_field="cls"))


@pytest.mark.parametrize("fractions, said", [({"val": 0.1}, "split fraction 0.1 for 'val' of 1 sample leaves it empty"),
                                             ({"val": 0.6}, "split fractions 0.6 of 1 sample leave train empty")])
def test_a_split_of_one_sample_says_one_sample(tmp_path, fractions, said):
    from fastio.convert.split import assign_splits

    with pytest.raises(ValueError) as err:
        assign_splits(1, fractions, seed=0)
    assert str(err.value) == said


@pytest.fixture
def one_token(tmp_path) -> Path:
    """A token dataset of one document of one token (its end-of-document id), indexed in place."""
    from fastio.formats.megatron import MegatronWriter

    dest = tmp_path / "ds"
    dest.mkdir()
    writer = MegatronWriter(str(dest / "part-000.bin"), "uint16")
    writer.add(np.array([0]))
    writer.close()
    return dest


def test_token_index_summary_of_one_token_says_one_token(one_token):
    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    summary = index_tokens(TokenIndexConfig(one_token, eos_id=0)).summary()
    assert ": indexed 1 shard, 1 document, 1 uint16 token (largest id 0) in " in summary


def test_inspect_of_one_token_says_one_token(one_token, capsys):
    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    index_tokens(TokenIndexConfig(one_token, eos_id=0))
    code, out, err = run_cli(["inspect", str(one_token)], capsys)
    assert code == 0, err
    assert "tokens:   1 document, 1 uint16 token (end of document: id 0;" in out


def test_token_convert_summary_of_one_token_says_one_token():
    from fastio.convert.token_convert import TokenConvertResult

    result = TokenConvertResult(dest="ds", shards=1, documents=1, tokens=1, empty=0, bytes=2, seconds=1.0,
                                dtype="uint16", eos_id=0, trained=1)
    summary = result.summary()
    assert summary.startswith("ds: 1 document, 1 uint16 token (2 B) in 1 shard; 0 empty documents skipped; "
                              "1 token trained (100.0%);"), summary


@pytest.fixture
def one_sample(tmp_path, capsys) -> Path:
    """An image dataset of one sample, indexed in place."""
    from helpers import indexed_tar

    return indexed_tar(tmp_path / "one", {"k0": {"png": _png(), "cls": b"0"}}, capsys)


def test_a_state_past_a_one_sample_dataset_says_one_sample(one_sample):
    loader = fastio.Loader(one_sample, pipeline=fastio.Raw(), batch_size=1, device="cpu", world_size=1, rank=0)
    state = {**loader.state_dict(), "consumed": 5}
    with pytest.raises(fastio.LoaderStateError, match=r"consumed=5 \(dataset has 1 sample\)$"):
        loader.load_state_dict(state)


def test_a_part_past_one_part_says_one_part():
    from fastio.convert.parts import parse_part

    with pytest.raises(ValueError, match=r"^part: K must be in 0\.\.0 for 1 part, got 1$"):
        parse_part("1/1")


def test_verify_of_a_shard_cut_to_one_sample_says_one_sample(tmp_path, capsys):
    from helpers import indexed_tar

    ds = indexed_tar(tmp_path / "two", {"k0": {"png": _png(), "cls": b"0"}, "k1": {"png": _png(), "cls": b"1"}},
                     capsys)
    write_wds_tar(ds / "0.tar", {"k0.png": _png(), "k0.cls": b"0"})
    code, out, err = run_cli(["verify", str(ds)], capsys)
    assert code != 0 and "0.tar: holds 1 sample, manifest says 2" in out + err, out + err


def test_inspect_packing_of_one_sequence_says_one_sequence_and_one_token(tmp_path, capsys):
    from fastio.convert.token_index import TokenIndexConfig, index_tokens
    from fastio.formats.megatron import MegatronWriter

    (tmp_path / "ds").mkdir()
    writer = MegatronWriter(str(tmp_path / "ds" / "part-000.bin"), "uint16")
    writer.add(np.array([1, 2, 0]))  # 3 tokens: one sequence of seq_len 2 (+1 shared), 1 token of tail
    writer.close()
    index_tokens(TokenIndexConfig(tmp_path / "ds", eos_id=0))
    code, out, err = run_cli(["inspect", str(tmp_path / "ds"), "--order", "--seq-len", "2"], capsys)
    assert code == 0, err
    assert "packing:  seq_len 2, window 4096 documents: concat 1 sequence (1 token of tail left out); best-fit 1 " \
           in out, out


def test_a_bin_cut_to_one_byte_says_one_byte_and_one_token(one_token):
    import os

    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    os.truncate(one_token / "part-000.bin", 1)
    with pytest.raises(fastio.DatasetError, match=r"part-000\.bin: 1 byte, but part-000\.idx indexes 2 \(1 uint16 "
                                                  r"token\): truncated"):
        index_tokens(TokenIndexConfig(one_token, eos_id=0))


def test_verify_of_one_problem_says_one_problem(image_dataset, capsys):
    (image_dataset / "shards" / "shard-000099.tar").write_bytes(b"")
    code, out, err = run_cli(["verify", str(image_dataset)], capsys)
    assert code == 1 and out == "shards/shard-000099.tar: file is not listed in the manifest\n", out
    assert err == f"fastio: verify: 1 problem in {image_dataset}\n"


def test_ckpt_verify_of_one_checkpoint_says_one_checkpoint(tmp_path, capsys):
    import torch

    with fastio.Checkpointer(tmp_path / "ck", every_steps=1) as ckpt:
        ckpt.maybe_save(1, {"model": torch.nn.Linear(2, 2)})
    code, out, err = run_cli(["ckpt", "verify", str(tmp_path / "ck")], capsys)
    assert code == 0 and out == f"{tmp_path / 'ck'}: 1 committed checkpoint verified (step 1)\n", out + err


def test_inspect_of_a_one_source_mixture_says_one_source(one_sample, tmp_path, capsys):
    import json

    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"sources": {"a": str(one_sample)}, "weights": {"a": 1}, "samples_per_epoch": 2}))
    code, out, err = run_cli(["inspect", str(path)], capsys)
    assert code == 0, err
    assert f"mixture:  {path}: 1 source, 2 samples per epoch\n" in out, out


def test_a_dali_index_of_one_sample_says_one_sample(one_sample):
    import hashlib

    from fastio.formats.dali_idx import check_index, key_crcs, parse_index

    with pytest.raises(ValueError, match=r"^x\.idx: header says 1 sample, file lists 0$"):
        parse_index("v1.2 1\n", source="x.idx")
    cut = b"v1.2 1\n"
    with pytest.raises(ValueError, match=r"^x\.idx: header says 1 sample, file lists 0$"):
        key_crcs(cut, samples=1, sha256=hashlib.sha256(cut).hexdigest(), source="x.idx")
    (idx,) = one_sample.glob("*.idx")
    entries = parse_index(idx.read_text(), source=idx.name)
    with pytest.raises(ValueError, match=r"^0\.idx: index lists 1 sample, manifest says 2$"):
        check_index(entries, samples=2, tar_bytes=(one_sample / "0.tar").stat().st_size, source=idx.name)


def test_a_sample_table_of_one_sample_says_one_sample(tmp_path):
    from fastio.dataset.manifest import ShardRecord
    from fastio.dataset.sample_table import build_index
    from fastio.formats.dali_idx import IndexEntry

    record = ShardRecord(name="a.tar", samples=2, bytes=10240, sha256="0" * 64, idx_sha256="0" * 64)
    with pytest.raises(ValueError, match=r"^shard a\.tar: index lists 1 sample, record says 2$"):
        build_index(tmp_path / "table", [(record, [IndexEntry("x", (("jpg", 512, 10),))])], ["jpg"])
    assert not (tmp_path / "table").exists()


def test_verify_of_a_one_token_shard_its_manifest_overstates_says_one(one_token, capsys):
    import json

    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    index_tokens(TokenIndexConfig(one_token, eos_id=0))
    manifest = json.loads((one_token / "manifest.json").read_text())
    manifest["shards"][0].update(samples=2, tokens=3)
    manifest["total_samples"], manifest["tokens"]["total_tokens"] = 2, 3
    (one_token / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(["verify", str(one_token)], capsys)
    assert code == 1 and "part-000.bin: holds 1 document, manifest says 2\n" in out, out + err
    assert "part-000.bin: holds 1 token, manifest says 3\n" in out, out


def test_a_sample_too_long_with_its_one_image_says_one_image(tmp_path):
    from tokens_helpers import image_text_dataset

    ds = image_text_dataset(tmp_path, n=2)  # sample i holds i % 4 images: sample 1 the one image
    pipe = fastio.ImageText(image=fastio.ImageEval(size=8, dtype="uint8", crop_ratio=1.0), seq_len=512,
                            image_seq_len=4000)
    with pytest.raises(fastio.DatasetError, match=r"key '00000001': \d+ tokens with its 1 image expanded to "
                                                  r"image_seq_len 4000, more than seq_len \+ 1 = 513"):
        fastio.Loader(ds, pipeline=pipe, batch_size=1, device="cpu", world_size=1, rank=0)


# The floors and leaves that import nothing else of fastio (order/, read/stats.py, formats/media.py) count through
# fastio.words too.

def test_the_rule_has_one_home_that_progress_re_exports():
    from fastio import progress, words

    assert progress.count is words.count
    assert [words.count(n, "byte") for n in (0, 1, 2)] == ["0 bytes", "1 byte", "2 bytes"]
    assert [words.agree(n, "has", "have") for n in (1, 2)] == ["has", "have"]


def test_a_position_past_a_one_sample_order_says_one_sample():
    from fastio.order.sampler import epoch_order

    with pytest.raises(IndexError, match=r"^position 1 out of range for an order of 1 sample$"):
        epoch_order([1], seed=0, epoch=0, fingerprint="f")[1]
    with pytest.raises(IndexError, match=r"^position 3 out of range for an order of 1 sample$"):
        epoch_order([1], seed=0, epoch=0, fingerprint="f")[np.array([0, 3])]


def test_a_position_past_a_one_sample_mixture_epoch_says_one_sample():
    from fastio.order.mixorder import MixSampler, MixSchedule
    from fastio.order.sampler import SamplerSpec

    schedule = MixSchedule(names=("a",), weights=(1.0,), fingerprints=("f",), samples_per_epoch=1)
    order = MixSampler.make(SamplerSpec(seed=0), schedule, [[1]]).order(0)
    with pytest.raises(IndexError, match=r"^position 1 out of range for a mixture epoch of 1 sample$"):
        order[1]


def test_a_step_of_no_global_batch_of_one_sample_says_one_sample():
    from fastio.order.replicas import step_position

    with pytest.raises(ValueError, match=r"^an epoch has no global batch of 1 sample: no step can be taken$"):
        step_position(0, 0, 1)


def test_the_progress_line_after_one_batch_says_one_batch(capsys):
    from fastio.read.stats import Stats

    stats = Stats(progress=True, every_s=0.0)
    stats.end_wait(stats.begin_wait(), 1)
    assert capsys.readouterr().err.startswith("fastio: 1 batch, ")


def test_a_probe_table_of_one_sample_says_one_sample(tmp_path):
    from fastio.formats.media import ProbeTable, write_probe_table

    write_probe_table(tmp_path / "probes.fxp", [{}])
    data = (tmp_path / "probes.fxp").read_bytes()
    with pytest.raises(ValueError, match=r"^probes\.fxp: version \d+, 1 sample; expected version \d+, 2 samples$"):
        ProbeTable(data, "probes.fxp", samples=2)
    with pytest.raises(ValueError, match=r"version \d+, 2 samples; expected version \d+, 1 sample$"):
        ProbeTable(data.replace(b'"samples": 1', b'"samples": 2'), "probes.fxp", samples=1)


def test_a_shard_cut_to_one_byte_says_one_byte(one_sample, capsys):
    loader = fastio.Loader(one_sample, pipeline=fastio.Raw(), batch_size=1, device="cpu", world_size=1, rank=0)
    size = (one_sample / "0.tar").stat().st_size
    os.truncate(one_sample / "0.tar", 1)
    code, out, err = run_cli(["verify", str(one_sample)], capsys)
    assert code == 1 and f"0.tar: size 1 byte, manifest says {size}" in out, out + err
    with pytest.raises(fastio.DatasetError, match=rf"shard 0\.tar is 1 byte, manifest says {size}: it changed after "
                                                  r"it was indexed; "):
        next(iter(loader))


def test_a_batch_larger_than_a_one_sample_dataset_says_one_sample(one_sample):
    with pytest.raises(fastio.DatasetError, match=r": batch_size 2 is larger than the dataset \(1 sample\): give a "
                                                  r"smaller batch_size, or remainder='partial' for one batch of them$"):
        _loader(one_sample, fastio.Raw())


def test_a_checkpoint_of_one_rank_lacking_one_app_key_says_one_of_each(tmp_path):
    import torch

    with fastio.Checkpointer(tmp_path / "ck", every_steps=1) as ckpt:
        ckpt.maybe_save(1, {"model": torch.nn.Linear(2, 2)})
    with fastio.Checkpointer(tmp_path / "ck", every_steps=1) as ckpt, pytest.raises(
            fastio.CheckpointError, match=r": checkpoint has no state for app key optim on rank 0 \(it holds: model; "
                                          r"written by 1 rank, this run has 1\)$"):
        model = torch.nn.Linear(2, 2)
        ckpt.restore_latest({"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})


def test_one_silent_mel_band_says_it_holds_and_it_would():
    with pytest.raises(ValueError, match=r"^n_mels=48 is too many for n_fft=128 at sample_rate=16000: 1 mel band \(the "
                                         r"first: 0\) holds no FFT bin, so it would always be silent; "):
        fastio.AudioClips(sample_rate=16000, seconds=0.25, n_mels=48, n_fft=128)


def test_a_cache_of_one_block_shard_says_the_one_largest_shard():
    from fastio.read.working_set import Reading, Shards, check_working_set

    with pytest.raises(fastio.StorageError, match=r"\(the largest shards of 1 batch of 1 sample read at once, each "
                                                  r"touching up to 1 shard of the windows of 1 it spans: a batch"):
        check_working_set(Shards([100, 100, 100], [1, 1, 1]), Reading("block", 1, 1), 0, 50, "s3://b/ds")


def test_samples_with_one_field_fields_does_not_list_say_field(tmp_path):
    from fastio.dataset.manifest import ShardRecord
    from fastio.dataset.sample_table import build_index
    from fastio.formats.dali_idx import IndexEntry

    record = ShardRecord(name="a.tar", samples=1, bytes=10240, sha256="0" * 64, idx_sha256="0" * 64)
    with pytest.raises(ValueError, match=r"^samples have field png that fields does not list$"):
        build_index(tmp_path / "table", [(record, [IndexEntry("x", (("jpg", 512, 10), ("png", 1024, 10)))])], ["jpg"])


def test_tokens_of_seq_len_one_over_one_token_say_one_token(one_token):
    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    index_tokens(TokenIndexConfig(one_token, eos_id=0))
    with pytest.raises(fastio.DatasetError, match=r": seq_len 1 needs more than 1 token; the corpus holds 1$"):
        fastio.Loader(one_token, pipeline=fastio.Tokens(seq_len=1), batch_size=1, device="cpu", world_size=1, rank=0)

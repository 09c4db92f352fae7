"""``fastio index --eos-id`` reads every id once: it records the largest (and ``--vocab-size``), refuses ids
outside the vocabulary and int32 tokens under an ``.idx`` that says uint16, naming the shard; ``fastio verify``
finds the same in a dataset indexed before; a Megatron folder indexed without ``--eos-id`` is named as such; and
``examples/gpt_train.py`` trains on the dataset ``fastio index`` makes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from helpers import run_cli

from fastio.convert.token_index import TokenIndexConfig, index_tokens
from fastio.dataset.manifest import load_manifest
from fastio.formats.megatron import MegatronWriter
from fastio.storage.checksum import digests_file

EOS = 0
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt_train.py"


def pair(folder: Path, stem: str, docs: list[np.ndarray], dtype: str = "uint16") -> Path:
    """A Megatron pair ``folder/stem.bin``/``.idx`` of ``docs`` (fastio's writer: megatron-core's bytes)."""
    folder.mkdir(exist_ok=True)
    writer = MegatronWriter(folder / f"{stem}.bin", dtype)
    for doc in docs:
        writer.add(np.asarray(doc))
    writer.close()
    return folder


def documents(n: int = 60, seed: int = 0, top: int = 500) -> list[np.ndarray]:
    """``n`` documents of 1..40 tokens with ids 1..top-1, each ending with :data:`EOS`."""
    rng = np.random.default_rng(seed)
    return [np.r_[rng.integers(1, top, int(rng.integers(0, 40))), EOS] for _ in range(n)]


def widened(docs: list[np.ndarray]) -> list[np.ndarray]:
    """``docs`` as int32 tokens seen through an ``.idx`` that says uint16: each token two, its high half 0."""
    return [np.frombuffer(np.asarray(d, "<i4").tobytes(), "<u2") for d in docs]


def test_index_records_the_largest_id_and_the_vocab_size(tmp_path, capsys):
    docs = documents()
    largest = int(max(d.max() for d in docs))
    data = pair(tmp_path / "data", "a", docs)
    pair(data, "b", [np.array([7, EOS])])
    index_tokens(TokenIndexConfig(data, eos_id=EOS))
    info = load_manifest(data).tokens
    assert (info.max_id, info.vocab_size, info.embedding_size) == (largest, None, largest + 1)
    code, out, err = run_cli(["inspect", str(data)], capsys)
    assert code == 0 and f"vocabulary: not recorded, largest id {largest}" in out, out + err
    code, out, err = run_cli(["index", str(data), "--eos-id", str(EOS), "--vocab-size", "600", "--overwrite"], capsys)
    assert code == 0 and f"largest id {largest}" in out, out + err
    info = load_manifest(data).tokens
    assert (info.max_id, info.vocab_size, info.embedding_size) == (largest, 600, 600)
    assert run_cli(["verify", str(data)], capsys)[0] == 0


def test_an_id_outside_vocab_size_is_refused_naming_the_shard_and_document(tmp_path, capsys):
    docs = documents()
    docs[37] = np.r_[3, 600, EOS]
    data = pair(tmp_path / "data", "a", docs)
    code, out, err = run_cli(["index", str(data), "--eos-id", str(EOS), "--vocab-size", "512"], capsys)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, out + err
    assert err.startswith(f"fastio: error: {data / 'a.bin'}: document 37 holds token id 600, outside the vocabulary "
                          "of 512 ids"), err
    assert not (data / "manifest.json").exists()
    code, out, err = run_cli(["index", str(data), "--eos-id", str(EOS), "--vocab-size", "0"], capsys)
    assert code == 2 and "--vocab-size must be" in err and "eos_id" not in err, err


def test_int32_tokens_under_a_uint16_idx_are_refused_by_index(tmp_path, capsys):
    data = pair(tmp_path / "data", "a", widened(documents()))
    assert (data / "a.bin").stat().st_size == 2 * sum(d.size for d in widened(documents()))  # the sizes agree
    code, out, err = run_cli(["index", str(data), "--eos-id", str(EOS)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, out + err
    assert err.startswith(f"fastio: error: {data / 'a.bin'}: every second token is 0"), err
    assert "int32 tokens under an .idx that says uint16" in err and not (data / "manifest.json").exists()
    ones = pair(tmp_path / "ones", "a", [np.array([5, EOS])] * 30)  # documents of one token and EOS: data as it is
    assert run_cli(["index", str(ones), "--eos-id", str(EOS)], capsys)[0] == 0


def test_int32_tokens_of_a_vocabulary_above_65536_under_a_uint16_idx_are_refused(tmp_path, capsys):
    """The vocabularies that need int32: an id above 65,535 has a high half of 1 (or 2, ...), not 0, so 'every
    second token is 0' missed them and, with an end-of-document id 0, index and verify passed the widened pair (the
    Loader then delivered ids below 65,536 and a 0 or 1 between them). Every token at an odd offset is a small high
    half while the others reach far above it: refused too."""
    docs = widened(documents(top=100_000))
    assert {int(t) for d in docs for t in d[1::2]} == {0, 1}  # the high halves: 0 and 1
    data = pair(tmp_path / "data", "a", docs)
    code, out, err = run_cli(["index", str(data), "--eos-id", str(EOS), "--vocab-size", "100000"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, out + err
    assert err.startswith(f"fastio: error: {data / 'a.bin'}: every second token is at most 1"), err
    assert "int32 tokens under an .idx that says uint16" in err and not (data / "manifest.json").exists()
    small = pair(tmp_path / "small", "a", documents(top=16))  # a vocabulary of 16 ids: every token small, taken
    assert run_cli(["index", str(small), "--eos-id", str(EOS)], capsys)[0] == 0


def test_verify_finds_int32_tokens_under_a_uint16_idx_in_a_dataset_indexed_before(tmp_path, capsys):
    """A manifest as an older fastio index wrote it (no largest id) over the widened pair: verify names the fault."""
    docs = widened(documents())
    data = pair(tmp_path / "data", "a", [np.r_[np.arange(d.size - 1) % 400 + 1, EOS] for d in docs])
    index_tokens(TokenIndexConfig(data, eos_id=EOS))
    pair(data, "a", docs)  # the widened tokens, in place of the indexed ones
    _, digests = digests_file(data / "a.bin", ("sha256", "xxh3_128"))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["shards"][0].update(digests)
    manifest["tokens"].pop("max_id", None)
    (data / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(["verify", str(data)], capsys)
    assert code == 1 and "a.bin: every second token is 0" in out + err, out + err


def test_index_of_megatron_pairs_without_eos_id_asks_for_it(tmp_path, capsys):
    data = pair(tmp_path / "mega", "a", documents())
    code, out, err = run_cli(["index", str(data)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, out + err
    assert f"{data}: holds Megatron .bin/.idx pairs (1), not .tar shards" in err, err
    assert "--eos-id N" in err and "holds no .tar files" not in err, err
    code, out, err = run_cli(["index", str(data), "--vocab-size", "512"], capsys)
    assert code == 2 and "--vocab-size: an option of a Megatron index (with --eos-id)" in err, err


def test_gpt_example_trains_on_megatron_data_indexed_as_the_readme_says(tmp_path, capsys, warm):
    data = pair(tmp_path / "mega", "a", documents(120))
    assert run_cli(["index", str(data), "--eos-id", str(EOS)], capsys)[0] == 0  # no --vocab-size
    code, out, err = warm.run(EXAMPLE, tmp_path, str(data), str(tmp_path / "ck"), "--steps", "3", "--seq-len", "16",
                              "--batch-size", "2")
    assert code == 0 and "done: 3 steps" in out, out + err


def test_a_vocabulary_larger_than_the_token_type_holds_is_refused_by_index_and_verify(tmp_path, capsys):
    """Found by review: uint16 tokens indexed with --vocab-size 100000 were taken: a uint16 .bin cannot hold that
    tokenizer's ids above 65,535 (a tool that wrote them as uint16 cut each to its low 16 bits, another token's id,
    which no check sees), and Megatron writes such a vocabulary as int32."""
    data = pair(tmp_path / "data", "a", documents())
    code, out, err = run_cli(["index", str(data), "--eos-id", str(EOS), "--vocab-size", "100000"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, out + err
    assert err.startswith(f"fastio: error: {data / 'a.bin'}: uint16 tokens cannot hold the ids of a vocabulary of "
                          "100000 ids (at most 65535)"), err
    assert not (data / "manifest.json").exists()
    assert run_cli(["index", str(data), "--eos-id", str(EOS), "--vocab-size", "65536"], capsys)[0] == 0  # they fit
    manifest = json.loads((data / "manifest.json").read_text())  # a dataset indexed before this check
    manifest["tokens"]["vocab_size"] = 100_000
    (data / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = run_cli(["verify", str(data)], capsys)
    assert code == 1 and "uint16 tokens cannot hold the ids of a vocabulary of 100000 ids" in out + err, out + err

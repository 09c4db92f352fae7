"""The document-starts table (doc-starts.fxs): written by fastio index (and convert, merge), read by the Loader for its
packing's block edges instead of the .idx files, checked at open against the manifest and by fastio verify."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest

import fastio
from fastio.convert.token_index import TokenIndexConfig, index_tokens
from fastio.dataset.manifest import load_manifest, write_manifest
from fastio.errors import DatasetError
from fastio.formats.megatron import MegatronIndex, MegatronWriter
from fastio.report.verify import verify
from fastio.tokens.starts import STARTS_EVERY, STARTS_NAME, read_starts

EOS = 0


def _corpus(folder, shards=(2500, 1024, 700)):
    """Pairs of the given document counts (1..8 tokens each, ending with EOS), indexed in place."""
    rng = np.random.default_rng(4)
    folder.mkdir()
    for k, docs in enumerate(shards):
        lengths = rng.integers(1, 9, docs)
        tokens = rng.integers(1, 300, int(lengths.sum()))
        tokens[np.cumsum(lengths) - 1] = EOS
        w = MegatronWriter(folder / f"s-{k}.bin", "uint16")
        w.add_documents(tokens, lengths)
        w.close()
    index_tokens(TokenIndexConfig(folder, EOS))
    return folder


def _loader(folder, **options):
    return fastio.Loader(folder, pipeline=fastio.Tokens(seq_len=32, window=2 * STARTS_EVERY), batch_size=4,
                         device="cpu", seed=1, **options)


def test_the_table_holds_every_1024th_documents_start(tmp_path):
    folder = _corpus(tmp_path / "c")
    m = load_manifest(folder)
    assert m.tokens.starts.name == STARTS_NAME and (folder / STARTS_NAME).stat().st_size == m.tokens.starts.bytes
    every, values = read_starts(folder / STARTS_NAME, m.tokens.starts, [s.samples for s in m.shards])
    assert every == STARTS_EVERY and [v.size for v in values] == [4, 2, 2]
    for shard, got in zip(m.shards, values):
        index = MegatronIndex(folder / shard.idx_name)
        want = index.starts(np.arange(index.documents + 1))[np.r_[np.arange(0, index.documents, every),
                                                                  index.documents]]
        assert got.tolist() == want.tolist()
    assert verify(folder).ok


def test_a_loader_takes_its_block_edges_from_the_table(tmp_path, monkeypatch):
    """Same batches as without the table, and no pread of an .idx while the Loader is made."""
    folder = _corpus(tmp_path / "c")
    bare = tmp_path / "bare"
    bare.mkdir()
    for p in folder.iterdir():
        if p.suffix in (".bin", ".idx"):
            os.link(p, bare / p.name)
    m = load_manifest(folder)
    write_manifest(bare, replace(m, tokens=replace(m.tokens, starts=None)))
    with _loader(bare) as ld:
        want = [b["tokens"].tolist() for b in ld]
    reads, pread = [], os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append(n) or pread(fd, n, at))
    ld = _loader(folder)
    assert reads == []
    monkeypatch.undo()
    with ld:
        assert [b["tokens"].tolist() for b in ld] == want


def test_a_changed_table_is_refused_at_open_and_found_by_verify(tmp_path):
    folder = _corpus(tmp_path / "c")
    table = folder / STARTS_NAME
    data = bytearray(table.read_bytes())
    data[-16] ^= 1  # an entry of the last shard
    table.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"doc-starts\.fxs: document starts table does not match the manifest"):
        _loader(folder)
    report = verify(folder)
    assert not report.ok and any("doc-starts.fxs" in str(p) and "sha256 does not match" in str(p)
                                 for p in report.problems)


def test_a_table_that_disagrees_with_the_idx_files_is_found(tmp_path):
    """A table whose record matches it but whose entries are not the .idx files' (written for other shards):
    verify names the shard; the Loader refuses one whose ends are wrong."""
    from fastio.tokens.starts import write_starts

    folder = _corpus(tmp_path / "c")
    m = load_manifest(folder)
    every, values = read_starts(folder / STARTS_NAME, m.tokens.starts, [s.samples for s in m.shards])
    wrong = [v.copy() for v in values]
    wrong[0][1] += 1
    write_manifest(folder, replace(m, tokens=replace(m.tokens, starts=write_starts(folder, wrong))))
    problems = [str(p) for p in verify(folder).problems]
    assert len(problems) == 1 and "s-0.bin" in problems[0] and "disagree with its .idx" in problems[0], problems
    wrong[1][-1] += 1
    write_manifest(folder, replace(m, tokens=replace(m.tokens, starts=write_starts(folder, wrong))))
    with pytest.raises(DatasetError, match=r"s-1\.idx: the document starts table disagrees with it"):
        _loader(folder)
    assert json.loads((folder / "manifest.json").read_text())["tokens"]["starts"]["name"] == STARTS_NAME

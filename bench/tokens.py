"""Token benchmark: converting text to tokens, reading packed sequences, and the time to a first batch at scale.

Figures (medians over the repeats, runs interleaved on the same files):

- ``convert``: ``fastio convert --tokenizer`` (library call, default workers) against the bare ``tokenizers``
  ``encode_batch`` limit over the same texts in one process (reported, no target: the conversion also writes,
  checksums and publishes the shards);
- ``read vs megatron``: packed sequences (``packing="concat"``, ``seq_len``, batches of 8) delivered by
  ``fastio.Loader(DEST, pipeline=fastio.Tokens(seq_len=...))`` (its reader threads, prefetch), against
  Megatron-Core's ``GPTDataset`` over the same ``.bin``/``.idx`` in a ``torch.utils.data.DataLoader`` with one
  worker (target: 3x the tokens/s);
- ``read vs litdata``: against LitData's ``TokensLoader`` (``StreamingDataset`` + ``StreamingDataLoader``, one
  worker) over the same documents written by ``litdata.optimize`` (target: 3x; ``make bench`` installs litdata
  ``--no-deps``, its own dependencies would replace torch; skipped, saying why, where it is missing);
- ``first batch at scale``: a synthetic token dataset (``.idx`` files of ``scale_docs`` documents, sparse ``.bin``
  files of zeros, a manifest as ``fastio index --eos-id 0`` writes it; made once, then reused) read by
  ``fastio.Loader(DEST, pipeline=fastio.Tokens(seq_len))`` as rank 0 of 1,024 in a fresh process: seconds from the
  process's start to its first batch, and the process's peak resident memory after the imports, the Loader and
  the first batch. fastio's modules are compiled to bytecode first, as installing a package does (pip writes the
  ``.pyc`` files of a wheel), so that an editable checkout run with ``PYTHONDONTWRITEBYTECODE`` does not pay
  compiling them in every process (about 0.2 s); torch's are installed compiled. (Targets: under 2 s and under 1
  GB; the issue's size is 10^8 documents of 10^11 tokens:
  ``--scale-docs 100000000``, whose first run also hashes the 50 GB of zeros of one ``.bin`` for the manifest
  (the eight are alike), about a minute; a folder made before manifests said ``one_sequence_per_document`` and
  recorded a document-starts table gets both added, once its ``.idx`` files are checked to have one sequence per
  document).
- ``packed read at scale``: the same synthetic corpus read by ``fastio.Loader(DEST, pipeline=fastio.Tokens(seq_len))``
  (rank 0 of 1, batches of 8, in this process): input tokens/s and CPU seconds a batch over ``SCALE_BATCHES``
  batches after the first (one short timed run: blocks of documents touched for the first time included), and the
  share of block-table lookups the packing's cache answered (reported, no target: above ``STREAM_TABLE_DOCS``
  documents the packing builds the tables of the blocks a batch touches, kept in ``BLOCK_CACHE_BYTES``).
- ``best-fit construction``: CPU seconds to make ``packing="best-fit"`` (``fit="best"`` and ``"first"``) over the
  same synthetic corpus, in this process (reported, no target: the sequence count of every block, before a first
  batch).

``python bench/tokens.py [--repeats N] [--docs N] [--seq-len N] [--scale-docs N]`` writes
``bench/out/tokens.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import (
    RESULTS_DIR,
    interleaved,
    machine_info,
    median_ratio,
    section_parser,
    synchronize,
    write_results,
)
from bench.quiet import before_section

__all__ = ["run"]

READ_TARGET = 3.0
FIRST_BATCH_TARGET_S = 2.0
FIRST_BATCH_TARGET_GB = 1.0
SCALE_BATCHES = 2000
BATCH = 8
WORDS = ("data loader token stream packed sequence epoch shard index resume elastic rank batch model train "
         "checkpoint mixture weight schedule document corpus megatron fastio throughput memory").split()


def make_corpus(workdir: Path, docs: int) -> tuple[Path, Path, list[str]]:
    """``workdir/corpus-N.jsonl`` of ``docs`` documents of random words, and a byte-level BPE trained on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(20, 400)))) for _ in range(docs)]
    corpus = workdir / f"corpus-{docs}.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts[:2000], trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_path = workdir / "tokenizer.json"
    tok.save(str(tok_path))
    return corpus, tok_path, texts


def bench_convert(workdir: Path, corpus: Path, tok_path: Path, texts: list[str], repeats: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    tok = Tokenizer.from_file(str(tok_path))
    dest = workdir / "tokens"
    tokens = sum(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False) if e.ids)

    def bare() -> None:
        for i in range(0, len(texts), 256):
            tok.encode_batch(texts[i:i + 256], add_special_tokens=False)

    def fastio() -> None:
        convert_tokens(TokenConvertConfig(corpus, dest, tok_path, overwrite=True))

    times = interleaved({"fastio": fastio, "tokenizers": bare}, repeats)
    ratio = median_ratio(times["fastio"], times["tokenizers"])
    return {"tokens": tokens, "fastio_tokens_per_s": tokens / ratio["ours_median_s"],
            "tokenizers_tokens_per_s": tokens / ratio["peer_median_s"], "fraction_of_limit": ratio["speedup"],
            "seconds": times}


def fastio_reader(dest: Path, seq_len: int, device: str = "cpu"):
    """A call iterating one epoch of a ``fastio.Loader`` with ``fastio.Tokens`` (the next epoch each call, as a
    trainer takes them: sequences read ahead in the reader threads), returning the input tokens delivered (on cuda:
    in GPU memory, the copies done)."""
    import fastio

    loader = fastio.Loader(dest, pipeline=fastio.Tokens(seq_len=seq_len), batch_size=BATCH, drop_last=True,
                           device=device, seed=0)

    def epoch() -> int:
        n = sum(b["tokens"][:, :-1].numel() for b in loader)
        synchronize(device)
        return n
    return epoch


class _MegatronTokenizer:
    """What GPTDataset asks of a tokenizer (module level: DataLoader workers may be spawned)."""

    vocab_size, eod, pad, unique_identifiers = 2000, 0, 0, {"class": "bench"}


def megatron_reader(prefix: str, seq_len: int, cache: Path, device: str = "cpu"):
    """Megatron-Core's GPTDataset over the same pair, in a DataLoader with one (persistent) worker (on cuda: pinned
    batches copied without blocking, as Megatron's training loop does)."""
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    ids = IndexedDataset(prefix)
    config = GPTDatasetConfig(random_seed=0, sequence_length=seq_len, split="100,0,0", tokenizer=_MegatronTokenizer(),
                              reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False, path_to_cache=str(cache))
    ds = GPTDataset(ids, prefix, np.arange(len(ids), dtype=np.int32), None, Split.train, config)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=1, drop_last=True, persistent_workers=True,
                                         pin_memory=device == "cuda")

    def epoch() -> int:
        n = sum(b["tokens"].to(device, non_blocking=True).numel() for b in loader)
        synchronize(device)
        return n
    return epoch


def litdata_setup(workdir: Path, dest: Path, seq_len: int) -> Path | None:
    """The same documents written by ``litdata.optimize`` for its TokensLoader (None: litdata missing)."""
    try:
        from litdata import TokensLoader, optimize
    except ImportError:
        return None
    from bench.token_dataset import TokenDataset

    out = workdir / "litdata"
    shutil.rmtree(out, ignore_errors=True)
    ds = TokenDataset(dest)
    docs = [(k, j) for k, s in enumerate(ds.shards) for j in range(s.documents)]
    optimize(fn=functools.partial(_lit_document, str(dest)), inputs=docs, output_dir=str(out),
             chunk_size=(seq_len + 1) * 256, item_loader=TokensLoader(), num_workers=1, mode="overwrite")
    return out


_OPEN: dict[str, Any] = {}


def _lit_document(dest: str, item: tuple[int, int]):
    """One document's tokens, for ``litdata.optimize`` (module level: its workers are spawned)."""
    import torch

    from bench.token_dataset import TokenDataset

    ds = _OPEN.get(dest)
    if ds is None:
        ds = _OPEN[dest] = TokenDataset(dest)
    yield torch.tensor(np.asarray(ds.shards[item[0]].document(item[1]), dtype=np.int64))


def litdata_reader(out: Path, seq_len: int):
    """LitData's TokensLoader over the same documents, one (persistent) worker."""
    from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

    ds = StreamingDataset(input_dir=str(out), item_loader=TokensLoader(block_size=seq_len + 1), shuffle=True,
                          drop_last=True, seed=0)
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=1, drop_last=True, persistent_workers=True)
    return lambda: sum(b[:, :-1].numel() for b in loader)


def bench_read(workdir: Path, dest: Path, seq_len: int, repeats: int) -> dict[str, Any]:
    from fastio.dataset.manifest import load_manifest

    prefix = str(dest / "shards" / load_manifest(dest).shards[0].name[:-len(".bin")])
    if len(load_manifest(dest).shards) != 1:
        raise SystemExit("bench: the read section needs one shard (raise --shard-size)")
    runs = {"fastio": fastio_reader(dest, seq_len)}
    try:
        runs["megatron"] = megatron_reader(prefix, seq_len, workdir / "megatron-cache")
    except ImportError:
        pass
    lit = litdata_setup(workdir, dest, seq_len)
    if lit is not None:
        runs["litdata"] = litdata_reader(lit, seq_len)
    tokens = {name: fn() for name, fn in runs.items()}  # warm-up: workers started, indexes built, page cache
    times = interleaved(runs, repeats)
    out: dict[str, Any] = {name: {"tokens": tokens[name], "tokens_per_s": tokens[name] / np.median(times[name]),
                                  "seconds": times[name]} for name in runs}
    for peer in ("megatron", "litdata"):
        if peer in runs:
            out[f"speedup_vs_{peer}"] = out["fastio"]["tokens_per_s"] / out[peer]["tokens_per_s"]
    if lit is None:
        out["litdata"] = {"skipped": "litdata is not installed (make bench adds it: pip install --no-deps)"}
    if "megatron" not in runs:
        out["megatron"] = {"skipped": "megatron-core is not installed (make install adds it: pip install --no-deps)"}
    return out


def write_synthetic(folder: Path, docs: int, shards: int, mean_len: int = 1000) -> Path:
    """A token dataset of ``shards`` pairs of ``docs // shards`` documents each: real ``.idx`` files, sparse
    ``.bin`` files (int32 zeros: every document ends with the end-of-document id 0) and a manifest, written last
    (a folder that has one is reused as it is)."""
    import struct

    from fastio.dataset.manifest import MANIFEST_NAME
    from fastio.formats.megatron import MAGIC

    if (folder / MANIFEST_NAME).exists():
        _upgrade_manifest(folder)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    per = docs // shards
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 2 * mean_len, per, dtype=np.int64).astype(np.int32)
    pointers = np.zeros(per, np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 4, out=pointers[1:])
    total = int(lengths.astype(np.int64).sum())
    first = folder / "s-000000.idx"
    with open(first, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, 4, per, per + 1))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(per + 1, dtype=np.int64).tobytes())
    for k in range(shards):
        idx = folder / f"s-{k:06d}.idx"
        if k:
            shutil.copyfile(first, idx)
        with open(idx.with_suffix(".bin"), "wb") as f:
            f.truncate(total * 4)  # sparse: int32 tokens, zeros
    _synthetic_manifest(folder, shards, per, total, _write_starts(folder, shards))
    return folder


def _write_starts(folder: Path, shards: int):
    """The document-starts table of :func:`write_synthetic`'s ``shards`` pairs (each ``.idx`` a copy of the
    first), written into ``folder``; its manifest record."""
    from fastio.formats.megatron import MegatronIndex
    from fastio.tokens.starts import shard_starts, write_starts

    one = shard_starts(MegatronIndex(folder / "s-000000.idx", one_per_document=True))
    return write_starts(folder, [one] * shards)


def _synthetic_manifest(folder: Path, shards: int, per: int, tokens: int, starts) -> None:
    """The manifest of :func:`write_synthetic`'s pairs, as ``fastio index --eos-id 0`` would write it, with the
    ``.bin`` checksums computed from their content (``tokens`` int32 zeros, hashed once from memory: the sparse
    files hold nothing else, and reading them would fill the page cache with zeros). Every ``.idx`` is a copy
    of the first, hashed once."""
    from fastio.dataset.manifest import ShardRecord, TokenInfo, make_manifest, write_manifest
    from fastio.storage.checksum import DIGESTS, sha256_file

    nbytes, zeros = tokens * 4, bytes(1 << 24)
    hashes = {a: DIGESTS[a]() for a in ("sha256", "xxh3_128")}
    for at in range(0, nbytes, len(zeros)):
        for h in hashes.values():
            h.update(zeros[:min(len(zeros), nbytes - at)])
    idx_sha256 = sha256_file(folder / "s-000000.idx")[1]
    records = [ShardRecord(name=f"s-{k:06d}.bin", samples=per, bytes=nbytes, sha256=hashes["sha256"].hexdigest(),
                           idx_sha256=idx_sha256, xxh3_128=hashes["xxh3_128"].hexdigest(),
                           location=f"s-{k:06d}.bin", idx_location=f"s-{k:06d}.idx", tokens=tokens)
               for k in range(shards)]
    info = TokenInfo(dtype="int32", eos_id=0, total_tokens=tokens * shards, one_sequence_per_document=True,
                     starts=starts)
    write_manifest(folder, make_manifest(name="synthetic", shards=records, fields=[], kind="tokens", tokens=info,
                                         converted_from={"format": "synthetic", "path": str(folder)}))


def _upgrade_manifest(folder: Path) -> None:
    """Add ``one_sequence_per_document`` (its ``.idx`` files checked first) and the document-starts table to the
    manifest of a folder :func:`write_synthetic` made before manifests had them, the records as they are: nothing
    rehashed."""
    from dataclasses import replace

    from fastio.dataset.manifest import load_manifest, write_manifest
    from fastio.formats.megatron import MegatronIndex

    manifest = load_manifest(folder)
    info = manifest.tokens
    if info.one_sequence_per_document and info.starts is not None:
        return
    if not info.one_sequence_per_document and not all(
            MegatronIndex(folder / s.idx_location).is_one_per_document() for s in manifest.shards):
        raise SystemExit(f"bench: {folder}: an .idx has not one sequence per document; remove the folder")
    starts = _write_starts(folder, len(manifest.shards))
    write_manifest(folder, replace(manifest, tokens=replace(info, one_sequence_per_document=True, starts=starts)))


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def first_batch(folder: Path, seq_len: int) -> dict[str, Any]:
    """Rank 0 of 1,024's first batch through ``fastio.Loader(folder, pipeline=fastio.Tokens(seq_len))``, step by
    step: ``import fastio``, ``import torch`` (which the Loader imports: apart, to show its share), the Loader
    made, its first batch. Seconds from the imports on and this process's peak resident memory (``VmHWM``: its
    own, not a parent's) after each step, and the wall-clock time of the first batch (run in a fresh process
    by :func:`bench_first_batch`, which counts from the process's start)."""
    import time

    start = time.perf_counter()
    seconds, peak = {}, {}

    def step(name: str) -> None:
        seconds[name], peak[name] = time.perf_counter() - start, _peak_rss()

    import fastio
    step("import_fastio")
    import torch  # noqa: F401  (the Loader's own import, timed apart)
    step("import_torch")
    loader = fastio.Loader(str(folder), pipeline=fastio.Tokens(seq_len=seq_len), batch_size=BATCH, world_size=1024,
                           rank=0, drop_last=True, device="cpu", seed=0)
    step("loader")
    batch = next(iter(loader))
    done = time.time()
    step("first_batch")
    assert batch["tokens"].shape == (BATCH, seq_len + 1)
    tokens = loader.read_set.target.manifest.tokens.total_tokens
    loader.close()
    return {"tokens": tokens, "done_at": done, "peak_rss_bytes": peak["first_batch"], "seconds_after": seconds,
            "peak_rss_bytes_after": peak}


def bench_first_batch(workdir: Path, scale_docs: int, seq_len: int) -> dict[str, Any]:
    """:func:`first_batch` over a synthetic corpus of ``scale_docs`` documents in a fresh process: ``seconds``
    from the process's start (``Popen``) to rank 0's first batch."""
    import compileall
    import time

    import fastio

    folder = write_synthetic(workdir / f"scale-{scale_docs}", scale_docs, shards=8)
    compileall.compile_dir(Path(fastio.__file__).parent, quiet=1)  # as an install does (see the module docstring)
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r}); "
            f"from pathlib import Path; from bench.tokens import first_batch; "
            f"print(json.dumps(first_batch(Path({str(folder)!r}), {seq_len})))")
    started = time.time()
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    return {"documents": scale_docs, "seconds": got.pop("done_at") - started, **got,
            "target_s": FIRST_BATCH_TARGET_S}


def bench_scale_read(folder: Path, seq_len: int, batches: int = SCALE_BATCHES) -> dict[str, Any]:
    """Packed sequences of the synthetic corpus ``folder`` read by ``fastio.Loader`` (rank 0 of 1): input tokens/s
    and CPU seconds a batch (this process's, its reader threads' included) over ``batches`` batches after the first,
    and the share of the packing's block-table lookups its cache answered (None: no lookup, the corpus being small
    enough for a whole-epoch table)."""
    import time

    import fastio

    loader = fastio.Loader(str(folder), pipeline=fastio.Tokens(seq_len=seq_len), batch_size=BATCH, drop_last=True,
                           device="cpu", seed=0)
    packing = loader._reader.sources[0].packing
    lookups = {"hit": 0, "all": 0}
    cached = packing._cached

    def counting(key, compute):
        lookups["hit"] += key in packing._cache
        lookups["all"] += 1
        return cached(key, compute)

    packing._cached = counting
    it = iter(loader)
    next(it)
    tokens, cpu, wall = 0, time.process_time(), time.perf_counter()
    for _, batch in zip(range(batches), it):
        tokens += batch["tokens"][:, :-1].numel()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    loader.close()
    return {"documents": packing.documents, "batches": batches, "tokens_per_s": tokens / wall,
            "cpu_s_per_batch": cpu / batches,
            "block_cache_hits": lookups["hit"] / lookups["all"] if lookups["all"] else None}


def bench_bestfit_construction(folder: Path, seq_len: int) -> dict[str, Any]:
    """CPU seconds (this process's) to make the best-fit packing, each fit, over the synthetic corpus ``folder``,
    and the sequences it counts."""
    import time

    from bench.token_dataset import TokenDataset

    ds, out = TokenDataset(folder), {}
    for fit in ("best", "first"):
        cpu = time.process_time()
        packing = ds.packing(seq_len, packing="best-fit", fit=fit)
        out[fit] = {"cpu_s": time.process_time() - cpu, "sequences": packing.sequences}
    return {"documents": packing.documents, **out}


def run(workdir: Path, repeats: int = 3, docs: int = 20_000, seq_len: int = 2048,
        scale_docs: int = 10_000_000, results_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # megatron-core and litdata log every index they build
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    corpus, tok_path, texts = make_corpus(workdir, docs)
    convert = bench_convert(workdir, corpus, tok_path, texts, repeats)
    read = bench_read(workdir, workdir / "tokens", seq_len, repeats)
    scale = bench_first_batch(workdir, scale_docs, seq_len)
    scale_read = bench_scale_read(workdir / f"scale-{scale_docs}", seq_len)
    construction = bench_bestfit_construction(workdir / f"scale-{scale_docs}", seq_len)
    ratios = [{"name": f"tokens/s: fastio / {peer}", "value": read[f"speedup_vs_{peer}"], "target": READ_TARGET,
               "better": "higher"} for peer in ("megatron", "litdata") if f"speedup_vs_{peer}" in read]
    ratios.append({"name": f"first batch at {scale_docs} documents (s)", "value": scale["seconds"],
                   "target": FIRST_BATCH_TARGET_S, "better": "lower"})
    ratios.append({"name": "peak memory to that first batch (GB)", "value": scale["peak_rss_bytes"] / 1e9,
                   "target": FIRST_BATCH_TARGET_GB, "better": "lower"})
    result = {"benchmark": "tokens", "documents": docs, "seq_len": seq_len, "repeats": repeats, "convert": convert,
              "read": read, "first_batch": scale, "scale_read": scale_read,
              "best_fit_construction": construction, "ratios": ratios, "machine": machine_info()}
    if results_dir is not None:
        write_results("tokens", result, results_dir)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.tokens``."""
    p = section_parser(__doc__)
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--scale-docs", type=int, default=10_000_000)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "tokens")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    result = run(args.workdir, args.repeats, args.docs, args.seq_len, args.scale_docs, args.out)
    for r in result["ratios"]:
        print(f"{r['name']}: {r['value']:.3g} (target {'>=' if r['better'] == 'higher' else '<='} {r['target']})")
    c = result["convert"]
    print(f"convert: {c['fastio_tokens_per_s']:.0f} tokens/s, tokenizers encode_batch {c['tokenizers_tokens_per_s']:.0f}"
          f" tokens/s ({c['fraction_of_limit']:.2f} of the limit)")
    s = result["scale_read"]
    hits = s["block_cache_hits"]
    print(f"packed read at {s['documents']} documents: {s['tokens_per_s'] / 1e6:.1f} M tokens/s, "
          f"{s['cpu_s_per_batch'] * 1e3:.2f} ms CPU a batch, "
          + ("a whole-epoch stream table" if hits is None else f"{hits:.0%} block-table cache hits"))


if __name__ == "__main__":
    main()

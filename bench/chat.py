"""Chat benchmark: converting conversations (rendered with a chat template, trained on the assistant's tokens), and
how full best-fit packs them.

Figures (medians over the repeats, runs interleaved on the same files):

- ``convert``: ``fastio convert --tokenizer ... --chat-template ...`` (library call, default workers: render,
  tokenize, loss masks, shards, checksums, manifest) against a single-process loop of transformers'
  ``apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`` over
  the same conversations, tokens/s (target: 3x; ``make install`` installs transformers ``--no-deps``; skipped,
  saying why, where it is missing);
- ``packing``: the padding fraction (padding tokens over all tokens of the packed sequences; not a timing) of
  the Loader's best-fit (``fastio.Tokens(packing="best-fit")``: best-fit decreasing in windows of 4,096
  conversations) against TRL's ``bfd`` (``trl.pack_dataset(strategy="bfd")``, best-fit decreasing, as
  ``SFTTrainer`` calls it: 1,000 examples at a time; ``make bench`` installs TRL ``--no-deps``; a row says why
  where it is missing), both over the whole epoch at once, fastio's first-fit decreasing, and the bound
  (``ceil(tokens / cap)`` sequences). Rows: the converted conversations at ``--seq-len`` (1 to 8 turns, fewer
  more often, replies longer than prompts, words log-normal), and 50,000 conversations of each of
  :data:`DISTRIBUTIONS` (log-normal token lengths matched to UltraChat 200k's and to short instruction pairs'
  means; those over the sequence left out, as ``--overlong drop`` does, and counted) at seq_len 2,048 and 4,096.
  A sequence holds ``seq_len + 1`` tokens; TRL's rows get the same.

``python -m bench.chat [--repeats N] [--conversations N] [--seq-len N] [--packing-only]`` writes
``bench/out/chat.json`` and prints the padding fractions as a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `fastio` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from bench.common import RESULTS_DIR, interleaved, machine_info, median_ratio, section_parser, write_results
from bench.quiet import before_section

__all__ = ["run"]

CONVERT_TARGET = 3.0
WINDOW = 4096
"""The Loader's best-fit window (``fastio.Tokens(window=)``'s default): conversations packed together."""
TRL_MAP_BATCH = 1000
"""The examples TRL's ``pack_dataset`` packs together as ``SFTTrainer`` calls it (``datasets.map``'s batch)."""
PACKING_SEQ_LENS = (2048, 4096)
PACKING_CONVERSATIONS = 50_000
DISTRIBUTIONS = {
    "multi-turn chat (UltraChat-200k-like)": (1250, 0.6),
    "short instruction pairs (Alpaca-like)": (200, 0.8),
}
"""Conversation lengths in tokens, log-normal ``(median, sigma)``. Multi-turn: UltraChat 200k's card gives
1,397,058,554 bytes over its 207,865 ``train_sft`` conversations, 6.7 KB each (the first prompt held twice), about
1,500 tokens at 4 bytes a token: median 1,250 with sigma 0.6 has that mean (1,500) and a long right tail (p90
2,700). Short pairs: one instruction and its answer, mean about 275 tokens. Chosen to match those means and a
plausible spread, not fitted to a histogram (none is read here)."""
WORDS = ("data loader token stream packed sequence epoch shard index resume elastic rank batch model train "
         "checkpoint mixture weight schedule document corpus conversation assistant reply prompt").split()
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}"
          "{% endfor %}")


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations: a system message half the time, 1..8 user/assistant turns (geometric), prompts of
    about 20 words and replies of about 60 (log-normal)."""
    rng = np.random.default_rng(seed)

    def text(median: float) -> str:
        return " ".join(rng.choice(WORDS, max(1, int(rng.lognormal(np.log(median), 0.8)))))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(10)}] if rng.random() < 0.5 else []
        for _ in range(min(8, int(rng.geometric(0.45)))):
            messages += [{"role": "user", "content": text(20)}, {"role": "assistant", "content": text(60)}]
        out.append(messages)
    return out


def make_inputs(workdir: Path, n: int) -> tuple[Path, Path, Path, list]:
    """``chats-N.jsonl``, a byte-level BPE with ChatML's specials and a ``tokenizer_config.json`` holding the
    template, under ``workdir``; and the conversations."""
    chats = conversations(n)
    source = workdir / f"chats-{n}.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    tok_path, config = chat_tokenizer(workdir, chats)
    return source, tok_path, config, chats


def chat_tokenizer(workdir: Path, chats: list, specials: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A byte-level BPE (1,000 ids) trained on ``chats``' text with ChatML's specials and ``specials``, and a
    ``tokenizer_config.json`` holding :data:`CHATML`, under ``workdir``: their paths."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                   *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([m["content"] for c in chats[:2000] for m in c], trainer=trainer)
    tok_path = workdir / "tokenizer.json"
    tok.save(str(tok_path))
    config = workdir / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    return tok_path, config


def transformers_loop(tok_path: Path, chats: list):
    """The peer: one process, ``apply_chat_template`` per conversation with the assistant mask; None where
    transformers is missing."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="<|endoftext|>")

    def loop() -> None:
        for c in chats:
            hf.apply_chat_template(c, chat_template=CHATML, tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    return loop


def bench_convert(workdir: Path, source: Path, tok_path: Path, config: Path, chats: list, repeats: int
                  ) -> dict[str, Any]:
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
    from fastio.dataset.manifest import load_manifest

    dest = workdir / "chat"

    def fastio() -> None:
        convert_tokens(TokenConvertConfig(source, dest, tok_path, chat_template=config, overwrite=True))

    runs = {"fastio": fastio}
    peer = transformers_loop(tok_path, chats)
    if peer is not None:
        runs["transformers"] = peer
    times = interleaved(runs, repeats)
    tokens = load_manifest(dest).tokens.total_tokens
    out: dict[str, Any] = {"conversations": len(chats), "tokens": tokens, "seconds": times,
                           "fastio_tokens_per_s": tokens / float(np.median(times["fastio"]))}
    if peer is None:
        out["skipped"] = "transformers is not installed (make install adds it --no-deps)"
        return out
    ratio = median_ratio(times["fastio"], times["transformers"])
    out.update(transformers_tokens_per_s=tokens / ratio["peer_median_s"], speedup=ratio["speedup"])
    return out


class _Lengths:
    """Documents of the given lengths as one shard's :class:`~fastio.tokens.packing.DocumentTable` (what the
    Loader's best-fit reads of a shard), with no file behind it."""

    def __init__(self, lengths: np.ndarray):
        self.documents = len(lengths)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    @property
    def tokens(self) -> int:
        return int(self._offsets[-1])

    def starts(self, docs: np.ndarray) -> np.ndarray:
        return self._offsets[np.asarray(docs)]


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """``n`` conversation lengths in tokens, log-normal (``median``, ``sigma``), at least 16 (a template's turn
    markers); those over ``cap`` left out, as ``--overlong drop`` leaves them: (the lengths kept, how many left
    out)."""
    drawn = np.maximum(16, np.rint(np.random.default_rng(seed).lognormal(np.log(median), sigma, n))).astype(np.int64)
    return drawn[drawn <= cap], int((drawn > cap).sum())


def trl_bfd_padding(lengths: np.ndarray, cap: int, map_batch: int | None) -> float | str:
    """The padding fraction of TRL's ``pack_dataset(..., strategy="bfd")`` over documents of ``lengths`` in rows
    of ``cap`` tokens, packing ``map_batch`` examples at a time (its ``datasets.map`` batch: 1,000 by default, as
    ``SFTTrainer`` packs; None: the whole epoch at once); or why it could not run (TRL missing)."""
    try:
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401 (pa.compute)
        from datasets import Dataset, disable_progress_bars
        from datasets.table import InMemoryTable
        from trl import pack_dataset
    except (ImportError, RuntimeError) as err:  # trl's lazy module wraps a missing dependency in a RuntimeError
        return f"TRL is not importable ({type(err).__name__}: {str(err).splitlines()[0]}; make bench installs it)"
    disable_progress_bars()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.zeros(int(offsets[-1]), np.int32)))
    packed = pack_dataset(Dataset(InMemoryTable(pa.table({"input_ids": ids}))), cap, strategy="bfd",
                          map_kwargs={"batch_size": map_batch})
    rows = packed.with_format("arrow")[:]["seq_lengths"]
    kept = int(pa.compute.sum(pa.compute.list_flatten(rows)).as_py())
    assert kept == int(lengths.sum())  # every token kept: none is over cap
    return 1.0 - float(lengths.sum()) / (len(packed) * cap)


def padding_fractions(lengths: np.ndarray, seq_len: int) -> dict[str, float | str]:
    """The padding fraction of each packer over documents of ``lengths`` in sequences of ``seq_len + 1`` tokens
    (the Loader's; TRL's rows get the same ``seq_len + 1``): fastio's best-fit in the Loader's windows and over
    the whole epoch, fastio's first-fit decreasing over the whole epoch, TRL's ``bfd`` as ``SFTTrainer`` packs
    (map batches of 1,000) and over the whole epoch, and the bound no packer beats (``ceil(tokens / cap)``
    sequences)."""
    from fastio.tokens.packing import BestFitPacking

    cap, table = seq_len + 1, [_Lengths(lengths)]

    def fastio(window: int, fit: str = "best") -> float:
        return BestFitPacking(table, seq_len, block_docs=window, fit=fit).padding_fraction

    whole, tokens = len(lengths), int(lengths.sum())
    return {"fastio_best_fit_window": fastio(WINDOW), "fastio_best_fit_whole": fastio(whole),
            "fastio_first_fit_decreasing_whole": fastio(whole, "first"),
            "trl_bfd_sfttrainer": trl_bfd_padding(lengths, cap, TRL_MAP_BATCH),
            "trl_bfd_whole": trl_bfd_padding(lengths, cap, None),
            "lower_bound": 1.0 - tokens / (-(-tokens // cap) * cap)}


def bench_packing(dest: Path, seq_len: int, n: int = PACKING_CONVERSATIONS) -> dict[str, Any]:
    """Padding fractions (:func:`padding_fractions`) over the converted conversations at ``seq_len``, and over
    ``n`` conversations of each of :data:`DISTRIBUTIONS` at each of :data:`PACKING_SEQ_LENS`."""
    from bench.token_dataset import TokenDataset

    ds = TokenDataset(dest)
    converted = np.concatenate([np.diff(s.index.starts(np.arange(s.documents + 1))) for s in ds.shards])
    rows = [{"lengths": "the converted conversations", "seq_len": seq_len, "conversations": len(converted),
             "left_out_over_seq_len": 0, **_spread(converted),
             "padding_fraction": padding_fractions(converted, seq_len)}]
    for name, (median, sigma) in DISTRIBUTIONS.items():
        for seq_len in PACKING_SEQ_LENS:
            lengths, left_out = lognormal_lengths(n, median, sigma, seq_len + 1)
            rows.append({"lengths": f"{name}: log-normal, median {median}, sigma {sigma}", "seq_len": seq_len,
                         "conversations": len(lengths), "left_out_over_seq_len": left_out, **_spread(lengths),
                         "padding_fraction": padding_fractions(lengths, seq_len)})
    return {"window": WINDOW, "trl_map_batch": TRL_MAP_BATCH, "rows": rows}


def _spread(lengths: np.ndarray) -> dict[str, float]:
    return {"tokens_median": float(np.median(lengths)), "tokens_mean": float(lengths.mean()),
            "tokens_p90": float(np.percentile(lengths, 90)), "tokens_max": int(lengths.max())}


def run(workdir: Path, repeats: int = 3, conversations: int = 20_000, seq_len: int = 2048,
        results_dir: Path | None = RESULTS_DIR, packing_only: bool = False) -> dict[str, Any]:
    """The section; ``packing_only``: the conversion once, untimed, and the padding fractions (no timing)."""
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    source, tok_path, config, chats = make_inputs(workdir, conversations)
    if packing_only:
        convert_tokens(TokenConvertConfig(source, workdir / "chat", tok_path, chat_template=config, overwrite=True))
        convert = {"skipped": "--packing-only"}
    else:
        convert = bench_convert(workdir, source, tok_path, config, chats, repeats)
    packing = bench_packing(workdir / "chat", seq_len)
    ratios = [] if "speedup" not in convert else [
        {"name": "chat convert tokens/s: fastio / transformers apply_chat_template loop", "value": convert["speedup"],
         "target": CONVERT_TARGET, "better": "higher"}]
    result = {"benchmark": "chat", "conversations": conversations, "seq_len": seq_len, "repeats": repeats,
              "convert": convert, "packing": packing, "ratios": ratios, "machine": machine_info()}
    if results_dir is not None:
        write_results("chat", result, results_dir)
    return result


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.chat``."""
    p = section_parser(__doc__)
    p.add_argument("--conversations", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "work" / "chat")
    p.add_argument("--packing-only", action="store_true", help="only the padding fractions (no timing)")
    return p


def packing_table(packing: dict[str, Any]) -> str:
    """The padding fractions as a Markdown table, a row per length distribution and seq_len."""
    names = list(packing["rows"][0]["padding_fraction"])
    lines = ["| lengths | seq_len | conversations (left out) | median / p90 tokens | " + " | ".join(names) + " |",
             "|" + "---|" * (4 + len(names))]
    for r in packing["rows"]:
        cells = [f"{v:.2%}" if isinstance(v, float) else "n/a" for v in r["padding_fraction"].values()]
        lines.append(f"| {r['lengths']} | {r['seq_len']} | {r['conversations']} ({r['left_out_over_seq_len']}) | "
                     f"{r['tokens_median']:.0f} / {r['tokens_p90']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    result = run(args.workdir, args.repeats, args.conversations, args.seq_len, args.out, args.packing_only)
    for r in result["ratios"]:
        print(f"{r['name']}: {r['value']:.3g} (target >= {r['target']})")
    c = result["convert"]
    if "fastio_tokens_per_s" in c:
        print(f"convert: {c['fastio_tokens_per_s']:.0f} tokens/s" + (
            f", {c['skipped']}" if "skipped" in c else f", transformers {c['transformers_tokens_per_s']:.0f}"))
    print("padding fraction (padding tokens / all tokens of the packed sequences):")
    print(packing_table(result["packing"]))
    skipped = {v for r in result["packing"]["rows"] for v in r["padding_fraction"].values() if isinstance(v, str)}
    for why in sorted(skipped):
        print(f"n/a: {why}")


if __name__ == "__main__":
    main()

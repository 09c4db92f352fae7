"""Chat benchmark: converting conversations (rendered with a chat template, trained on the assistant's tokens), and
how full best-fit packs them.

Figures (medians over the repeats, runs interleaved on the same files):

- ``convert``: ``fastio convert --tokenizer ... --chat-template ...`` (library call, default workers: render,
  tokenize, loss masks, shards, checksums, manifest) against a single-process loop of transformers'
  ``apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`` over
  the same conversations, tokens/s (target: 3x; ``make install`` installs transformers ``--no-deps``; skipped,
  saying why, where it is missing);
- ``packing``: the padding fraction of the Loader's best-fit (``fastio.Tokens(packing="best-fit")``, windows of
  4,096 conversations) over the converted conversations, against first-fit decreasing over the whole epoch at once
  (the reference: no window) and best-fit over the whole epoch (reported, no target). The conversations' lengths
  follow a realistic spread: 1 to 8 turns (fewer more often), replies longer than prompts, lengths log-normal.

``python -m bench.chat [--repeats N] [--conversations N] [--seq-len N]`` writes ``bench/out/chat.json``.
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    chats = conversations(n)
    source = workdir / f"chats-{n}.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([m["content"] for c in chats[:2000] for m in c], trainer=trainer)
    tok_path = workdir / "tokenizer.json"
    tok.save(str(tok_path))
    config = workdir / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|endoftext|>"}))
    return source, tok_path, config, chats


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


def bench_packing(dest: Path, seq_len: int) -> dict[str, Any]:
    """Padding fractions of the Loader's windowed best-fit, and of first-fit decreasing and best-fit over the
    whole epoch at once."""
    from fastio.tokens.dataset import TokenDataset

    ds = TokenDataset(dest)
    whole = ds.documents
    fractions = {"best_fit_window": ds.packing(seq_len, packing="best-fit", block_docs=WINDOW).padding_fraction,
                 "first_fit_decreasing_whole": ds.packing(seq_len, packing="best-fit", fit="first",
                                                          block_docs=whole).padding_fraction,
                 "best_fit_whole": ds.packing(seq_len, packing="best-fit", block_docs=whole).padding_fraction}
    lengths = np.concatenate([np.diff(s.index.starts(np.arange(s.documents + 1))) for s in ds.shards])
    return {"seq_len": seq_len, "window": WINDOW, "conversations": whole, "padding_fraction": fractions,
            "tokens_per_conversation": {"median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
                                        "max": int(lengths.max())}}


def run(workdir: Path, repeats: int = 3, conversations: int = 20_000, seq_len: int = 2048,
        results_dir: Path | None = RESULTS_DIR) -> dict[str, Any]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    source, tok_path, config, chats = make_inputs(workdir, conversations)
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
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    before_section(args.quiet_wait)
    result = run(args.workdir, args.repeats, args.conversations, args.seq_len, args.out)
    for r in result["ratios"]:
        print(f"{r['name']}: {r['value']:.3g} (target >= {r['target']})")
    c, p = result["convert"], result["packing"]
    print(f"convert: {c['fastio_tokens_per_s']:.0f} tokens/s" + (f", {c['skipped']}" if "skipped" in c else
                                                                  f", transformers {c['transformers_tokens_per_s']:.0f}"))
    print("padding fraction at seq_len {}: {}".format(p["seq_len"], ", ".join(
        f"{k} {v:.3%}" for k, v in p["padding_fraction"].items())))


if __name__ == "__main__":
    main()

"""A chat dataset in the Loader (fastio.Tokens, best-fit): whole conversations packed, loss_mask True exactly on
the trained tokens (transformers' assistant mask), position_ids / cu_seqlens / segment_ids / max_seqlen cut at each
conversation (not at the end-of-text id the template writes inside one), refusals, a mixture with plain text, exact
and elastic resume."""

from __future__ import annotations

import json
import os
import re
import textwrap
from collections import Counter

import numpy as np
import pytest
from resume import check_resume, run_ranks
from tokens_helpers import GLUED, chat_dataset, conversations, hf_ids_and_mask, hf_tokenizer, stored_conversations

import fastio
from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
from fastio.dataset.manifest import load_manifest
from fastio.errors import DatasetError

SEQ = 160
N = 80


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A chat dataset of GLUED conversations: an end-of-text token after every reply, so inside a multi-turn one."""
    return chat_dataset(tmp_path_factory.mktemp("chat-loader"), n=N, template=GLUED)


def _loader(dest, **options):
    options = {"batch_size": 4, "device": "cpu", "seed": 5, "reader_threads": 2, **options}
    return fastio.Loader(dest, pipeline=fastio.Tokens(seq_len=SEQ, packing="best-fit", window=16), **options)


def _segments(b):
    """Each (row, segment) of a batch as (tokens, loss_mask, position_ids), padding left out."""
    t, m, pos, seg = (b[k].numpy() for k in ("tokens", "loss_mask", "position_ids", "segment_ids"))
    out = []
    for r in range(t.shape[0]):
        for s in np.unique(seg[r][seg[r] > 0]).tolist():
            at = seg[r] == s
            out.append((tuple(t[r][at].tolist()), tuple(m[r][at].astype(int).tolist()), pos[r][at]))
    return out


def _check_layouts(b):
    """cu_seqlens from segment_ids (a boundary where a row starts or its segment id changes, over the inputs
    tokens[:, :-1]), max_seqlen its longest segment, no trained padding."""
    seg, cu, mask = b["segment_ids"].numpy(), b["cu_seqlens"].numpy(), b["loss_mask"].numpy()
    inputs = seg[:, :-1]
    change = np.ones(inputs.shape, bool)
    change[:, 1:] = inputs[:, 1:] != inputs[:, :-1]
    assert np.array_equal(cu, np.r_[np.flatnonzero(change.reshape(-1)), inputs.size])
    assert b["max_seqlen"] == int(np.diff(cu).max()) and isinstance(b["max_seqlen"], int)
    assert not mask[seg == 0].any() and seg.dtype == np.int32


def test_every_conversation_once_whole_with_transformers_mask(chat):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    root = chat.parent
    hf = hf_tokenizer(root / "tokenizer.json", root / "tokenizer_config.json")
    want = Counter((tuple(ids), (0, *mask[1:]))  # the first token is no target: test_no_conversations_first_...
                   for ids, mask in (hf_ids_and_mask(hf, GLUED, c) for c in conversations(N, 0)))
    eos = load_manifest(chat).tokens.eos_id
    assert any(eos in ids[:-1] for ids, _ in want)  # an end-of-text id inside a conversation: not a boundary
    got = Counter()
    with _loader(chat) as ld:
        for b in ld:
            _check_layouts(b)
            keep = ~b["padded"].numpy()
            rows = {"tokens", "loss_mask", "position_ids", "segment_ids"}
            for ids, mask, pos in _segments({k: (v[keep] if k in rows else v) for k, v in b.items()}):
                assert np.array_equal(pos, np.arange(len(ids)))  # position_ids restart at each conversation
                got[(ids, mask)] += 1
    assert got == want  # each conversation once, whole, its mask transformers' assistant mask (but its first token)


def test_no_conversations_first_token_is_a_target(chat):
    """A conversation whose first token its mask trains (GLUED renders a system message first as 'a' + text, the
    first token straddling a generation block's edge): packed after another conversation, that token's target slot
    would be predicted from the other conversation's last token, a target transformers never trains (its labels
    shift within one conversation; DataCollatorWithFlattening labels each packed sequence's first token -100). The
    Loader's loss_mask is False there wherever the conversation lands, True on every other trained token."""
    stored = stored_conversations(chat)
    assert any(mask[0] for _, mask in stored)  # the case arises: a stored mask trains a first token
    want = Counter((tuple(ids), (0, *mask[1:])) for ids, mask in stored)
    got, later = Counter(), 0
    with _loader(chat) as ld:
        for b in ld:
            seg, mask = b["segment_ids"].numpy(), b["loss_mask"].numpy()
            first = (seg > 0) & (np.diff(seg, axis=1, prepend=0) != 0)
            assert not mask[first].any()
            later += int(first[:, 1:].sum())
            keep = ~b["padded"].numpy()
            rows = {"tokens", "loss_mask", "position_ids", "segment_ids"}
            got.update((ids, m) for ids, m, _ in _segments({k: (v[keep] if k in rows else v) for k, v in b.items()}))
    assert later > 0 and got == want  # conversations packed after others; every other trained token still trained


def test_refusals_concat_and_a_seq_len_a_conversation_does_not_fit(chat):
    with pytest.raises(DatasetError, match=r"chat: a chat dataset .* is packed whole: .*packing='best-fit'"):
        fastio.Loader(chat, pipeline=fastio.Tokens(seq_len=SEQ), batch_size=2, device="cpu")
    longest = load_manifest(chat).tokens.chat.longest
    with pytest.raises(DatasetError, match=rf"its longest conversation has {longest} tokens, more than seq_len \+ 1 "
                                           rf"= 64: a conversation is never cut; raise seq_len to at least "
                                           rf"{longest - 1}"):
        fastio.Loader(chat, pipeline=fastio.Tokens(seq_len=63, packing="best-fit"), batch_size=2, device="cpu")
    tight = fastio.Tokens(seq_len=longest - 1, packing="best-fit")  # seq_len + 1 == the longest: it fits (--help)
    with fastio.Loader(chat, pipeline=tight, batch_size=2, device="cpu") as ld:
        assert max(int((b["segment_ids"] > 0).sum(axis=1).max()) for b in ld) == longest


def test_the_seq_len_refusal_names_the_cli_flags_and_the_library_fields(chat):
    """A library user converts with TokenConvertConfig, not the CLI: the one line names both spellings."""
    with pytest.raises(DatasetError) as err:
        fastio.Loader(chat, pipeline=fastio.Tokens(seq_len=63, packing="best-fit"), batch_size=2, device="cpu")
    line = str(err.value)
    assert "\n" not in line
    assert "--max-tokens 64 (--overlong drop or --overlong truncate;" in line
    assert "TokenConvertConfig(max_tokens=64, overlong='drop') or overlong='truncate'" in line


def test_exact_resume_is_bitwise(chat):
    check_resume(lambda: _loader(chat), n=3, k=4)


def _ids(steps):
    return [i for step in steps for b in step for i, p in zip(b["index"].tolist(), b["padded"].tolist()) if not p]


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2)])
def test_elastic_resume_delivers_each_remaining_sequence_once(chat, old, new):
    before, states = run_ranks([_loader(chat, world_size=old, rank=r, batch_size=2) for r in range(old)], n=2)
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1
    after, _ = run_ranks([_loader(chat, world_size=new, rank=r, batch_size=2) for r in range(new)], state=states[0])
    whole, _ = run_ranks([_loader(chat, batch_size=2)])
    assert _ids(after)  # mid-epoch
    assert Counter(_ids(before) + _ids(after)) == Counter(_ids(whole))
    assert len(set(_ids(whole))) == len(_ids(whole))


@pytest.fixture(scope="module")
def plain(chat):
    """A plain-text token dataset of the chat dataset's tokenizer."""
    root = chat.parent
    texts = [" ".join(m["content"] for m in c) for c in conversations(30, 9)]
    (root / "plain.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    convert_tokens(TokenConvertConfig(root / "plain.jsonl", root / "plain", root / "tokenizer.json", workers=1))
    return root / "plain"


def test_a_mixture_keeps_each_conversations_mask_and_trains_every_plain_token(chat, plain):
    stored = {tuple(ids): (0, *mask[1:]) for ids, mask in stored_conversations(chat)}  # the first: no target
    mix = fastio.Mixture({"chat": chat, "plain": plain}, weights={"chat": 0.5, "plain": 0.5})
    seen = Counter()
    with _loader(mix, batch_size=8) as ld:
        for b in ld:
            _check_layouts(b)
            sources = b["source"].tolist()
            for r, source in enumerate(sources):
                row = {k: (v[r:r + 1] if k in ("tokens", "loss_mask", "position_ids", "segment_ids") else v)
                       for k, v in b.items()}
                for ids, mask, pos in _segments(row):
                    assert np.array_equal(pos, np.arange(len(ids)))
                    if source == 0:
                        assert stored[ids] == mask
                    else:
                        assert all(mask)  # plain text: every token trained
                    seen[source] += 1
    assert seen[0] > 0 and seen[1] > 0


def test_sft_example_trains_on_the_mask_and_resumes_exactly_after_sigkill(chat, tmp_path, warm_one_thread):
    """examples/sft_train.py killed with SIGKILL mid-run: the same command continues from its last committed step
    with the same sequences and bit-identical losses; each step trains on the replies' tokens only."""
    import sys
    from pathlib import Path

    from resume import killed_and_resumed

    example = Path(__file__).resolve().parent.parent / "examples" / "sft_train.py"
    command = [sys.executable, str(example), str(chat), str(tmp_path / "ckpt"), "--seq-len", str(SEQ),
               "--batch-size", "4"]
    before, after, start = killed_and_resumed(warm_one_thread, command, tmp_path / "ckpt")
    assert start in (5, 10) and sorted(after) == list(range(start + 1, 19))
    overlap = [s for s in after if s in before]
    assert len(overlap) >= 3 and all(after[s] == before[s] for s in overlap)
    trained = [int(line.split(" trained ")[1].split()[0]) for line in after.values()]
    assert all(0 < t < 4 * SEQ for t in trained)  # the replies only: some targets of every batch, never all


def test_an_s3_chat_dataset_is_written_verified_and_read_through_the_cache(chat, moto_server, s3_bucket, tmp_path):
    """A chat conversion into s3:// (masks uploaded), fastio verify of it (masks fetched and checked), and a Loader
    through the node cache (masks fetched into its metadata) giving the local dataset's batches bit for bit."""
    from resume import same_batch

    from fastio.report.verify import verify
    from fastio.storage import open_storage

    root, url = chat.parent, f"s3://{s3_bucket}/chat"
    options = moto_server.options()
    convert_tokens(TokenConvertConfig(root / "chats.jsonl", url, root / "tokenizer.json", workers=1,
                                      chat_template=root / "tokenizer_config.json", max_samples_per_shard=20,
                                      storage_options=options, staging_dir=tmp_path / "staging"))
    keys = {o.key for o in open_storage(url, options).list()}
    assert {f"shards/{p.name}" for p in (chat / "shards").glob("*.mask")} <= keys
    report = verify(url, storage_options=options)
    assert report.ok, [str(p) for p in report.problems]
    remote = _loader(url, cache_dir=str(tmp_path / "cache"), cache_size="1GB", storage_options=options)
    with remote, _loader(chat) as local:
        for x, y in zip(remote, local, strict=True):
            assert same_batch(x, y)
    assert list((tmp_path / "cache").rglob("*.mask"))  # fetched into the cache's metadata, checked
    store = open_storage(url, options)
    changed = bytearray(store.get("shards/shard-000000.mask"))
    changed[-1] ^= 1
    (tmp_path / "changed").write_bytes(bytes(changed))
    store.put_file("shards/shard-000000.mask", tmp_path / "changed")
    assert "loss mask shard-000000.mask sha256 does not match" in str(verify(url, storage_options=options).problems)


def test_token_dataset_batches_are_the_loaders(chat):
    """TokenDataset.batch (the numpy reference) gives a chat dataset's Loader batches: the stored mask, the
    conversations' boundaries."""
    from bench.token_dataset import TokenDataset

    ds = TokenDataset(chat)
    packing = ds.packing(SEQ, packing="best-fit", seed=5, block_docs=16)
    with _loader(chat) as ld:
        for b in ld:
            want = ds.batch(packing, 0, b["index"].numpy())
            for key in ("tokens", "loss_mask", "position_ids", "cu_seqlens"):
                assert np.array_equal(want[key], b[key].numpy()), key


@pytest.fixture(scope="module")
def chat_all(chat):
    """The chat dataset's conversations converted again with train_on='all': the same .bin files (so the same
    fingerprint), other loss masks."""
    root = chat.parent
    convert_tokens(TokenConvertConfig(root / "chats.jsonl", root / "chat-all", root / "tokenizer.json",
                                      chat_template=root / "tokenizer_config.json", train_on="all", workers=1,
                                      max_samples_per_shard=20))
    return root / "chat-all"


def _state_after(dest, n=2):
    with _loader(dest) as ld:
        it = iter(ld)
        for _ in range(n):
            next(it)
        return ld.state_dict()


def test_a_resume_on_other_loss_masks_is_refused_naming_the_option(chat, chat_all):
    assert load_manifest(chat).fingerprint == load_manifest(chat_all).fingerprint  # the tokens are the same
    state = _state_after(chat)
    with _loader(chat_all) as other, pytest.raises(fastio.LoaderStateError) as err:
        other.load_state_dict(state)
    line = str(err.value)
    assert "train_on" in line and "'generation'" in line and "'all'" in line and str(chat_all) in line
    with _loader(chat) as same:  # the same masks: accepted
        same.load_state_dict(state)


def test_a_resume_on_a_plain_index_of_the_chat_shards_is_refused(chat, tmp_path):
    """The chat dataset's .bin/.idx pairs indexed as plain documents (every token trained): same fingerprint."""
    import shutil

    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    src = tmp_path / "pairs"
    src.mkdir()
    for f in (chat / "shards").glob("*.[bi][id][nx]"):
        shutil.copy(f, src / f.name)
    eos = load_manifest(chat).tokens.eos_id
    index_tokens(TokenIndexConfig(src, eos_id=eos))
    assert load_manifest(src).fingerprint == load_manifest(chat).fingerprint
    state = _state_after(chat)
    with _loader(src) as other, pytest.raises(fastio.LoaderStateError, match="loss mask"):
        other.load_state_dict(state)


def test_a_state_saved_before_loss_masks_were_recorded_still_loads(chat):
    state = _state_after(chat)
    state.pop("loss_mask")
    with _loader(chat) as ld:
        ld.load_state_dict(state)
        assert ld.consumed == state["consumed"]


def test_a_mixture_resume_on_a_source_of_other_loss_masks_is_refused_naming_the_source(chat, chat_all, plain):
    def mix(source):
        return fastio.Mixture({"chat": source, "plain": plain}, weights={"chat": 0.5, "plain": 0.5})
    state = _state_after(mix(chat))
    with _loader(mix(chat_all)) as other, pytest.raises(fastio.LoaderStateError) as err:
        other.load_state_dict(state)
    assert "source 'chat'" in str(err.value) and "train_on='generation'" in str(err.value)
    with _loader(mix(chat_all)) as other:  # the next epoch is drawn from the masks as they are now
        other.load_state_dict(other.next_epoch_state(state))
        assert other.epoch == state["epoch"] + 1


@pytest.mark.parametrize("verify", [False, True])
def test_a_chat_manifest_listing_no_mask_for_a_shard_is_refused_naming_it(chat, tmp_path, verify):
    """A damaged manifest whose chat shard has no mask_sha256: refused naming the shard (with verify=True it was a raw
    TypeError from the sha256 comparison; without, the mask read unchecked by any checksum)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(chat, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    del manifest["shards"][1]["mask_sha256"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    name = manifest["shards"][1]["name"]
    with pytest.raises(DatasetError, match=rf"bad: shard {name}: the manifest lists no loss mask .*fastio verify"):
        with _loader(bad, verify=verify) as ld:
            list(ld)


def _understated_longest(chat, tmp_path):
    """(a copy of the chat dataset whose manifest says its longest conversation is one token shorter than it is, that
    conversation's length)."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(chat, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    longest = manifest["tokens"]["chat"]["longest"]
    manifest["tokens"]["chat"]["longest"] = longest - 1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return bad, longest


def test_a_manifest_understating_the_longest_conversation_is_refused_naming_the_shard(chat, tmp_path):
    """Found by hostile review of hand-edited manifests: tokens.chat.longest edited below the real longest let a
    seq_len through that the longest conversation does not fit, and best-fit packing cut it into pieces without a
    word (its second piece trained without its prompt). The documents' lengths are read anyway when the packing
    counts its sequences: a conversation longer than the manifest says is refused there, naming the shard."""
    import re

    from fastio.formats.megatron import MegatronIndex

    bad, longest = _understated_longest(chat, tmp_path)
    tokens = fastio.Tokens(seq_len=longest - 2, packing="best-fit", window=16)  # fits the edited longest only
    with pytest.raises(DatasetError, match=rf"bad: shard \S+: holds a conversation of {longest} tokens, more than "
                                           rf"the manifest's tokens\.chat\.longest \({longest - 1}\)") as err:
        with fastio.Loader(bad, pipeline=tokens, batch_size=4, device="cpu", seed=5) as ld:
            list(ld)
    name = re.search(r"shard (\S+):", str(err.value))[1]
    idx = MegatronIndex(bad / "shards" / name.replace(".bin", ".idx"))
    assert int(np.diff(idx.starts(np.arange(idx.documents + 1))).max()) == longest  # the shard it is in


def test_verify_names_the_shard_holding_a_conversation_longer_than_the_manifest_says(chat, tmp_path):
    """The Loader's refusal above tells the user to look at the manifest; fastio verify (which reads every .idx)
    passed such a manifest as clean. Now it names each shard holding a conversation longer than tokens.chat.longest."""
    from fastio.report.verify import verify

    assert not verify(chat).problems
    bad, longest = _understated_longest(chat, tmp_path)
    lines = [p.line() for p in verify(bad).problems]
    assert lines and all(re.fullmatch(rf"shard-\d+\S*: holds a conversation of {longest} tokens, more than the "
                                      rf"manifest's tokens\.chat\.longest \({longest - 1}\)", line) for line in lines), lines


def test_verify_names_a_manifest_overstating_the_longest_conversation(chat, tmp_path):
    """The other way round: tokens.chat.longest edited above every conversation makes the Loader refuse a seq_len
    all of them fit ("its longest conversation has N tokens"), and fastio verify passed the manifest as clean; it
    now names the manifest, with both lengths."""
    import shutil

    from fastio.report.verify import verify

    bad = tmp_path / "bad"
    shutil.copytree(chat, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    longest = manifest["tokens"]["chat"]["longest"]
    manifest["tokens"]["chat"]["longest"] = longest + 100
    (bad / "manifest.json").write_text(json.dumps(manifest))
    assert [p.line() for p in verify(bad).problems] == [
        f"manifest.json: tokens.chat.longest is {longest + 100}, the longest conversation of its shards has "
        f"{longest} tokens"]


def test_a_mask_cut_short_under_a_running_loader_is_named_not_a_sigbus(chat, tmp_path):
    """A chat shard's .mask cut short between two reads (after the Loader mapped it): refused naming the file, as a
    .bin is; it killed the process with SIGBUS."""
    import os
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(chat, bad)
    with _loader(bad, reader_threads=1, read_ahead=1, prefetch=1) as ld:
        it = iter(ld)
        next(it)  # the masks of the shards read so far are mapped
        for mask in (bad / "shards").glob("*.mask"):
            os.truncate(mask, 8)
        with pytest.raises(DatasetError, match=r"bad/shards/shard-\d+\.mask: 8 bytes, .*truncated"):
            list(it)


def test_a_dataset_converted_again_is_refused_by_its_fingerprint_before_its_masks(chat, tmp_path):
    """Other conversations with other masks: the refusal is the fingerprint's (another dataset, the way to the next
    epoch), not a loss-mask difference that would suggest only the masks changed."""
    other = chat_dataset(tmp_path, n=30, seed=4, template=GLUED, train_on="all")
    state = _state_after(chat)
    with _loader(other) as ld, pytest.raises(fastio.LoaderStateError, match="fingerprint"):
        ld.load_state_dict(state)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the open files in /proc/self/fd (Linux)")
def test_too_many_open_files_is_named_with_the_limit(chat, warm_one_thread, tmp_path):
    """Found by hostile review (a chat dataset of 1,500 shards under ulimit -n 1024): a token Loader keeps each
    shard's .idx and .bin, and a chat shard's .mask, open, so a dataset of more shards than the limit allows
    failed opening with a raw OSError naming nothing ('[Errno 24] Too many open files', from numpy's memmap), or
    mid-epoch naming a file but not the cause. Now each is one DatasetError naming the file, the limit and the way
    out, wherever the limit is reached (a process allowed two files more than it holds at the start)."""
    script = textwrap.dedent(f"""
        import os, resource, fastio
        def run():
            with fastio.Loader({str(chat)!r}, pipeline=fastio.Tokens(seq_len={SEQ}, packing="best-fit"),
                               batch_size=4, device="cpu", seed=0, reader_threads=1) as loader:
                return sum(1 for _ in loader)
        run()  # everything imported: what the limit stops below is the dataset's files
        held = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + 2, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            run()
        except fastio.DatasetError as err:
            print(err)
    """)
    # a process of its own, as its limit is lowered: the warm interpreter the SFT test started runs it (torch and DALI
    # imported already)
    (tmp_path / "limited.py").write_text(script)
    rc, stdout, stderr = warm_one_thread.run(tmp_path / "limited.py", tmp_path, timeout=300)
    assert rc == 0, stderr[-2000:]
    assert re.fullmatch(rf"{re.escape(str(chat))}/shards/shard-\d+\.(idx|bin|mask): (cannot be mapped \()?Too many "
                        r"open files: this process reached its limit of \d+ open files \(ulimit -n\); .*raise the "
                        r"limit.*\n", stdout), stdout + stderr[-2000:]

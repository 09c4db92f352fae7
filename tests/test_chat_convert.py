"""``fastio convert chats.jsonl DEST --tokenizer ... --chat-template ...``: conversations stored as Megatron pairs
with a loss mask beside each shard, equal to transformers' apply_chat_template ids and assistant masks; the mask
checksummed in the manifest and checked by verify; refusals as one line naming the file, line and field."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli
from tokens_helpers import (
    CHATML,
    chat_config,
    chat_dataset,
    chat_tokenizer,
    conversations,
    hf_ids_and_mask,
    hf_tokenizer,
    stored_conversations,
    write_chats,
)

from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
from fastio.dataset.manifest import load_manifest
from fastio.errors import ConvertError
from fastio.report.verify import verify


@pytest.fixture(scope="module")
def chat_ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatds")
    return chat_dataset(root, n=60)


def test_stored_ids_and_masks_equal_transformers_conversation_by_conversation(chat_ds):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    root = chat_ds.parent
    hf = hf_tokenizer(root / "tokenizer.json", root / "tokenizer_config.json")
    stored = stored_conversations(chat_ds)
    chats = conversations(60, 0)
    assert len(stored) == len(chats)
    for i, (chat, got) in enumerate(zip(chats, stored)):
        assert got == hf_ids_and_mask(hf, CHATML, chat), f"conversation {i}"


def test_manifest_records_masks_and_chat_info(chat_ds):
    manifest = load_manifest(chat_ds)
    chat = manifest.tokens.chat
    stored = stored_conversations(chat_ds)
    assert len(manifest.shards) == 3 and all(r.mask_sha256 for r in manifest.shards)
    assert chat.trained_tokens == sum(sum(m) for _, m in stored) > 0
    assert chat.longest == max(len(ids) for ids, _ in stored)
    assert chat.train_on == "generation" and chat.mask == "bits-v1"
    assert sorted(p.name for p in (chat_ds / "shards").glob("*.mask")) == [r.mask_name for r in manifest.shards]
    assert verify(chat_ds).ok


def test_verify_names_a_changed_missing_or_cut_mask(tmp_path):
    dest = chat_dataset(tmp_path, n=30)
    mask = dest / "shards" / "shard-000001.mask"
    data = bytearray(mask.read_bytes())
    data[9] ^= 1
    mask.write_bytes(bytes(data))
    assert "loss mask shard-000001.mask sha256 does not match" in str(verify(dest).problems)
    mask.write_bytes(bytes(data[:-1]))
    assert "loss mask shard-000001.mask sha256 does not match" in str(verify(dest).problems)
    mask.unlink()
    assert "loss mask shard-000001.mask is missing" in str(verify(dest).problems)


def test_cli_converts_conversations_and_says_what_it_trains(tmp_path, capsys):
    tok = chat_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "t.jinja").write_text(CHATML)
    write_chats(tmp_path / "c.jsonl", conversations(10), field="conv")
    code, out, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(tok),
                              "--chat-template", str(tmp_path / "t.jinja"), "--messages-field", "conv",
                              "--workers", "1"], capsys)
    assert code == 0, err
    assert "10 documents" in out and "tokens trained" in out
    chat = load_manifest(tmp_path / "d").tokens.chat
    assert chat.trained_tokens > 0
    code, out, err = run_cli(["inspect", str(tmp_path / "d")], capsys)
    assert code == 0 and f"chat:     conversations, {chat.trained_tokens} tokens trained" in out, out + err
    assert f"seq_len at least {chat.longest - 1} with packing='best-fit'" in out


def test_a_template_without_generation_blocks_is_refused_naming_the_way_out(tmp_path, capsys):
    tok = chat_tokenizer(tmp_path / "tokenizer.json")
    plain = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    (tmp_path / "t.jinja").write_text(plain)
    write_chats(tmp_path / "c.jsonl", conversations(5))
    args = ["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(tok), "--chat-template",
            str(tmp_path / "t.jinja"), "--workers", "1"]
    code, _, err = run_cli(args, capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert err.startswith("fastio: error: ") and "t.jinja" in err and "{% generation %}" in err
    assert "--train-on all" in err and not (tmp_path / "d").exists()
    code, out, err = run_cli(args + ["--train-on", "all"], capsys)
    assert code == 0, err
    stored = stored_conversations(tmp_path / "d")
    assert all(mask == [1] * len(ids) for ids, mask in stored)


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "user"}]}, "c.jsonl:3: messages[0] has no 'content'"),
    ({"messages": [{"content": "hi"}]}, "c.jsonl:3: messages[0] has no 'role'"),
    ({"messages": [{"role": "robot", "content": "hi"}]},
     "c.jsonl:3: field 'messages': chat template {config}: the template refused it: unknown role robot"),
    ({"text": "hi"}, "c.jsonl:3: has no field 'messages'"),
    ({"messages": "hi"}, "c.jsonl:3: field 'messages' is str, not a list of messages"),
])
def test_bad_conversations_are_one_line_naming_file_line_and_field(tmp_path, capsys, line, message):
    tok = chat_tokenizer(tmp_path / "tokenizer.json")
    config = chat_config(tmp_path / "tokenizer_config.json")
    chats = conversations(4)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [{"messages": chats[0]},
                                                                             {"messages": chats[1]}, line]))
    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(tok),
                            "--chat-template", str(config), "--workers", "1"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fastio: error: ") and message.format(config=config) in err, err
    assert not (tmp_path / "d").exists()


def test_a_template_failing_to_render_is_named(tmp_path):
    tok = chat_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "t.jinja").write_text("{% generation %}{{ messages[0].content.missing.deeper }}{% endgeneration %}")
    write_chats(tmp_path / "c.jsonl", conversations(2))
    with pytest.raises(ConvertError, match=r"c.jsonl:1: field 'messages': chat template .*t.jinja: the template"):
        convert_tokens(TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "d", tok,
                                          chat_template=tmp_path / "t.jinja", workers=1))


def test_two_workers_write_the_same_bytes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = chat_dataset(tmp_path / "a", n=50)
    two = chat_dataset(tmp_path / "b", n=50, workers=2, batch_size=7)
    for a in sorted((one / "shards").iterdir()):
        assert a.read_bytes() == (two / "shards" / a.name).read_bytes(), a.name


@pytest.mark.parametrize("options", [{"shard_size": 1500}, {"max_samples_per_shard": 7}], ids=["bytes", "documents"])
def test_parts_merged_equal_the_whole_conversion_masks_included(tmp_path, options):
    from test_tokens_parts import assert_same_dataset

    from fastio.convert.merge import merge

    options = {"max_samples_per_shard": None, **options}
    whole = chat_dataset(tmp_path, n=45, **options)
    for k in (2, 0, 1):  # any order
        convert_tokens(TokenConvertConfig(tmp_path / "chats.jsonl", tmp_path / "ds", tmp_path / "tokenizer.json",
                                          chat_template=tmp_path / "tokenizer_config.json", workers=1, part=(k, 3),
                                          **options))
    result = merge(tmp_path / "ds")
    assert result.linked > 0 and result.repacked > 0
    assert_same_dataset(whole, tmp_path / "ds")
    assert verify(tmp_path / "ds").ok and len(list((tmp_path / "ds" / "shards").glob("*.mask"))) > 1


def test_parts_whose_special_tokens_differ_are_refused_naming_the_token(tmp_path, capsys):
    """Found by review: the parts of a chat conversion were compared by the tokenizer file's checksum and the
    template's text alone, so a part converted with a tokenizer_config.json whose bos_token differs (the same
    tokenizer.json and template: another token rendered at every conversation's start) merged silently, and parts of
    two tokenizers of one vocabulary size whose special tokens have other ids were refused naming only two
    checksums. A merge now refuses both in one line naming the parts and the token that differs."""
    chat_tokenizer(tmp_path / "tokenizer.json")
    chat_tokenizer(tmp_path / "swapped.json", ("<|im_end|>", "<|im_start|>", "<s>"))  # 400 ids too, two swapped
    config = chat_config(tmp_path / "tokenizer_config.json")
    other_bos = tmp_path / "other" / "tokenizer_config.json"
    other_bos.parent.mkdir()
    other_bos.write_text(json.dumps({**json.loads(config.read_text()), "bos_token": "<|im_start|>"}))
    write_chats(tmp_path / "chats.jsonl", conversations(20))
    cases = [((tmp_path / "tokenizer.json", other_bos), "the chat template's bos_token '<|im_start|>' (part 0: '<s>')"),
             ((tmp_path / "swapped.json", config), "special token '<|im_start|>' id 2 (part 0: id 1)")]
    for i, ((tok, template), named) in enumerate(cases):
        dest = tmp_path / f"ds{i}"
        for k, (t, c) in enumerate([(tmp_path / "tokenizer.json", config), (tok, template)]):
            convert_tokens(TokenConvertConfig(tmp_path / "chats.jsonl", dest, t, chat_template=c, workers=1,
                                              part=(k, 2)))
        code, _, err = run_cli(["merge", str(dest)], capsys)
        assert code == 2 and err.count("\n") == 1 and "part-0-of-2: part-1-of-2:" in err and named in err, err
        assert not (dest / "manifest.json").exists() and (dest / ".parts").is_dir()
    padded = tmp_path / "padded" / "tokenizer_config.json"  # a token the template never renders: the same ids
    padded.parent.mkdir()
    padded.write_text(json.dumps({**json.loads(config.read_text()), "pad_token": "<|im_end|>"}))
    (tmp_path / "t.jinja").write_text(CHATML)  # its bos and eos filled in from the tokenizer: the config's
    for k, c in enumerate([padded, tmp_path / "t.jinja"]):
        convert_tokens(TokenConvertConfig(tmp_path / "chats.jsonl", tmp_path / "ds2", tmp_path / "tokenizer.json",
                                          chat_template=c, workers=1, part=(k, 2)))
    code, _, err = run_cli(["merge", str(tmp_path / "ds2")], capsys)
    assert code == 0, err
    record = tmp_path / "ds0" / ".parts" / "part-1-of-2" / "part.json"  # a part converted before they were recorded
    data = json.loads(record.read_text())
    del data["plan"]["tokens"]["special_tokens"], data["plan"]["tokens"]["chat"]["variables"]
    record.write_text(json.dumps(data))
    code, _, err = run_cli(["merge", str(tmp_path / "ds0")], capsys)
    assert code == 0, err


def _first_turns_that_fit(hf, chat, limit, template=CHATML, reply="assistant"):
    """The reference for overlong='truncate': transformers' ids and mask of the longest run of first messages that
    ends with an assistant reply (role ``reply``) and fits ``limit`` tokens (None: none does)."""
    for k in range(len(chat), 0, -1):
        if chat[k - 1]["role"] == reply:
            got = hf_ids_and_mask(hf, template, chat[:k])
            if len(got[0]) <= limit:
                return got
    return None


def _assert_truncated_as_transformers_would(tmp_path, result, config, template, chats, limit, train_on, reply):
    """The truncated conversion in ``tmp_path / "chat"`` holds what transformers gives each of ``chats``: whole where
    it fits in ``limit`` tokens, else its first turns up to a ``reply`` message that fit (dropped where none does),
    the mask all ones unless ``train_on`` is "generation"; the manifest counts the dropped and the truncated."""
    hf = hf_tokenizer(tmp_path / "tokenizer.json", config)
    want, dropped, truncated = [], 0, 0
    for chat in chats:
        full = hf_ids_and_mask(hf, template, chat)
        cut = full if len(full[0]) <= limit else _first_turns_that_fit(hf, chat, limit, template, reply)
        dropped, truncated = dropped + (cut is None), truncated + (cut is not None and cut is not full)
        if cut is not None:
            want.append(cut if train_on == "generation" else (cut[0], [1] * len(cut[0])))
    assert truncated > 0 and result.documents == len(want)
    assert stored_conversations(tmp_path / "chat") == want
    source = load_manifest(tmp_path / "chat").converted_from
    assert (source["overlong_dropped"], source["overlong_truncated"]) == (dropped, truncated)


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_conversations_over_max_tokens_are_dropped_or_keep_their_first_turns_whole(tmp_path, overlong):
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    limit = 80
    dest = chat_dataset(tmp_path, n=60, max_tokens=limit, overlong=overlong)
    hf = hf_tokenizer(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    want, dropped, truncated = [], 0, 0
    for chat in conversations(60, 0):
        full = hf_ids_and_mask(hf, CHATML, chat)
        if len(full[0]) <= limit:
            want.append(full)
            continue
        cut = _first_turns_that_fit(hf, chat, limit) if overlong == "truncate" else None
        dropped, truncated = dropped + (cut is None), truncated + (cut is not None)
        if cut is not None:
            want.append(cut)
    assert dropped + truncated > 0 and (truncated > 0) == (overlong == "truncate")
    assert stored_conversations(dest) == want
    source = load_manifest(dest).converted_from
    assert (source["overlong_dropped"], source["overlong_truncated"]) == (dropped, truncated)
    assert load_manifest(dest).tokens.chat.longest <= limit


GPT_ROLES = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'gpt' %}"
             "{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
             "{% else %}{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
"""ChatML for ShareGPT's roles: 'gpt' replies trained, 'human' and 'system' prompts."""


@pytest.mark.parametrize(("template", "train_on"), [(GPT_ROLES, "generation"), (GPT_ROLES, "all"),
                                                    (GPT_ROLES.replace("{% generation %}", "").replace(
                                                        "{% endgeneration %}", ""), "all")],
                         ids=["generation", "all", "no-blocks"])
def test_truncate_keeps_the_first_turns_of_conversations_in_sharegpt_roles(tmp_path, template, train_on):
    """Found by review: overlong='truncate' cut only after a message of role 'assistant', so a conversation whose
    replies are ShareGPT's 'gpt' (a template that trains them) was dropped, counted, instead of truncated. A cut
    now ends after a message the template renders inside a {% generation %} block, whatever its role (without
    blocks: after one of the reply roles, 'gpt' among them)."""
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    limit, names = 80, {"user": "human", "assistant": "gpt"}
    chats = [[{**m, "role": names.get(m["role"], m["role"])} for m in c] for c in conversations(60, 0)]
    chat_tokenizer(tmp_path / "tokenizer.json")
    config = chat_config(tmp_path / "tokenizer_config.json", template)
    write_chats(tmp_path / "chats.jsonl", chats)
    result = convert_tokens(TokenConvertConfig(tmp_path / "chats.jsonl", tmp_path / "chat", tmp_path / "tokenizer.json",
                                               chat_template=config, workers=1, max_tokens=limit,
                                               overlong="truncate", train_on=train_on))
    _assert_truncated_as_transformers_would(tmp_path, result, config, template, chats, limit, train_on, "gpt")


CAPITALISED = GPT_ROLES.replace("'gpt'", "'Assistant'")
"""ChatML for capitalised roles ('System', 'User', 'Assistant'): 'Assistant' replies trained."""
TRAINS_ALL_TURNS = GPT_ROLES.replace("{% if m.role == 'gpt' %}", "{% if true %}")
"""ChatML that trains every turn, whatever its role (the prompts' too)."""


@pytest.mark.parametrize(("names", "keys", "template", "train_on"), [
    ({"system": "System", "user": "User", "assistant": "Assistant"}, ("role", "content"),
     CAPITALISED.replace("{% generation %}", "").replace("{% endgeneration %}", ""), "all"),
    ({"system": "System", "user": "User", "assistant": "Assistant"}, ("role", "content"), TRAINS_ALL_TURNS,
     "generation"),
    ({"system": "SYSTEM", "user": "Human", "assistant": "GPT"}, ("role", "content"), TRAINS_ALL_TURNS, "generation"),
    ({"system": "system", "user": "human", "assistant": "gpt"}, ("from", "value"), GPT_ROLES, "generation"),
    ({"system": "system", "user": "human", "assistant": "gpt"}, ("from", "value"), TRAINS_ALL_TURNS, "generation"),
], ids=["capitalised-no-blocks", "capitalised-all-turns", "upper-sharegpt-all-turns", "sharegpt-keys",
        "sharegpt-keys-all-turns"])
def test_truncate_reads_roles_whatever_their_case_and_sharegpt_keys(tmp_path, names, keys, template, train_on):
    """Found by review: overlong='truncate' compared roles case-sensitively, so conversations in 'User'/'Assistant'
    were dropped (no 'assistant' reply to cut after, under a template without blocks) or cut after a 'User' prompt
    (under a template that trains every turn), and ShareGPT's own 'from'/'value' messages were refused. A role is
    now read, in one place, whatever its case, and a 'from'/'value' message enters as the 'role'/'content' message
    the template sees; what the template renders is unchanged (the role as the data spells it)."""
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    limit = 80
    chats = [[{"role": names[m["role"]], "content": m["content"]} for m in c] for c in conversations(60, 0)]
    chat_tokenizer(tmp_path / "tokenizer.json")
    config = chat_config(tmp_path / "tokenizer_config.json", template)
    write_chats(tmp_path / "chats.jsonl", [[dict(zip(keys, m.values())) for m in c] for c in chats])
    result = convert_tokens(TokenConvertConfig(tmp_path / "chats.jsonl", tmp_path / "chat", tmp_path / "tokenizer.json",
                                               chat_template=config, workers=1, max_tokens=limit,
                                               overlong="truncate", train_on=train_on))
    _assert_truncated_as_transformers_would(tmp_path, result, config, template, chats, limit, train_on,
                                            names["assistant"])


ALL_TURNS = CHATML.replace("{% if message['role'] == 'assistant' %}", "{% if true %}")
"""ChatML that trains every turn: the user's and the system's inside a {% generation %} block too."""


def test_truncate_ends_on_the_models_reply_under_a_template_that_trains_user_turns(tmp_path):
    """Found by review: overlong='truncate' cut after any message the template renders inside a {% generation %}
    block, so under a template that trains the user's turns too a truncated conversation could end on a user
    message, a prompt with no reply after it. A cut now ends after a reply of the model's (a trained message of a
    role that is not a prompt's: not user, human, system, developer, tool...); none that fits: dropped, counted."""
    pytest.importorskip("transformers", reason="transformers is installed --no-deps by make install")
    limit = 80
    chat_tokenizer(tmp_path / "tokenizer.json")
    config = chat_config(tmp_path / "tokenizer_config.json", ALL_TURNS)
    long_reply = [{"role": "user", "content": "alpha"}, {"role": "assistant", "content": "beta gamma " * 60},
                  {"role": "user", "content": "delta"}, {"role": "assistant", "content": "eta"}]
    chats = [*conversations(30, 0), long_reply]  # only its first user turn fits: dropped, never kept alone
    write_chats(tmp_path / "chats.jsonl", chats)
    result = convert_tokens(TokenConvertConfig(tmp_path / "chats.jsonl", tmp_path / "chat", tmp_path / "tokenizer.json",
                                               chat_template=config, workers=1, max_tokens=limit,
                                               overlong="truncate"))
    hf = hf_tokenizer(tmp_path / "tokenizer.json", config)
    want, dropped, truncated = [], 0, 0
    for chat in chats:
        full = hf_ids_and_mask(hf, ALL_TURNS, chat)
        cut = full if len(full[0]) <= limit else _first_turns_that_fit(hf, chat, limit, ALL_TURNS)
        dropped, truncated = dropped + (cut is None), truncated + (cut is not None and cut is not full)
        if cut is not None:
            want.append(cut)
    assert truncated > 0 and dropped > 0 and result.documents == len(want)
    assert stored_conversations(tmp_path / "chat") == want
    source = load_manifest(tmp_path / "chat").converted_from
    assert (source["overlong_dropped"], source["overlong_truncated"]) == (dropped, truncated)


def test_a_conversation_over_max_tokens_is_refused_by_default_naming_it(tmp_path):
    with pytest.raises(ConvertError, match=r"chats.jsonl:\d+: field 'messages': the conversation has \d+ tokens, more "
                                           r"than max_tokens=40 \(overlong='drop' or overlong='truncate'"):
        chat_dataset(tmp_path, n=20, max_tokens=40)


def test_parquet_of_openai_and_sharegpt_messages_converts_as_the_jsonl_of_each(tmp_path):
    """Found by review: a Parquet column of both kinds of message (two datasets concatenated: its struct has
    'role', 'content', 'from' and 'value', each row null in the other's) was refused: a ShareGPT row's 'role' is
    there, null. A null key is absent, as a JSONL line would spell it: each row converts as its own JSONL does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = conversations(20, 0)
    sharegpt = [[{"from": m["role"], "value": m["content"]} for m in c] for c in chats[10:]]
    table = pa.table({"messages": [*chats[:10], *sharegpt]})
    assert {f.name for f in table.schema.field("messages").type.value_type} == {"role", "content", "from", "value"}
    pq.write_table(table, tmp_path / "mixed.parquet")
    chat_tokenizer(tmp_path / "tokenizer.json")
    config = chat_config(tmp_path / "tokenizer_config.json")
    write_chats(tmp_path / "chats.jsonl", [*chats[:10], *sharegpt])
    for name in ("mixed.parquet", "chats.jsonl"):
        convert_tokens(TokenConvertConfig(tmp_path / name, tmp_path / name.split(".")[0], tmp_path / "tokenizer.json",
                                          chat_template=config, workers=1))
    assert stored_conversations(tmp_path / "mixed") == stored_conversations(tmp_path / "chats")
    assert len(stored_conversations(tmp_path / "mixed")) == 20


def test_parquet_conversations_convert_as_jsonl_and_a_txt_file_is_refused(tmp_path, capsys):
    import filecmp

    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = chat_dataset(tmp_path, n=30)
    pq.write_table(pa.table({"messages": conversations(30, 0)}), tmp_path / "chats.parquet", row_group_size=7)
    convert_tokens(TokenConvertConfig(tmp_path / "chats.parquet", tmp_path / "pq", tmp_path / "tokenizer.json",
                                      chat_template=tmp_path / "tokenizer_config.json", workers=1,
                                      max_samples_per_shard=20))
    names = sorted(p.name for p in (jsonl / "shards").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "pq" / "shards").iterdir())
    assert all(filecmp.cmp(jsonl / "shards" / n, tmp_path / "pq" / "shards" / n, shallow=False) for n in names)
    (tmp_path / "c.txt").write_text("hello")
    code, _, err = run_cli(["convert", str(tmp_path / "c.txt"), str(tmp_path / "t"), "--tokenizer",
                            str(tmp_path / "tokenizer.json"), "--chat-template", str(tmp_path / "tokenizer_config.json"),
                            "--workers", "1"], capsys)
    assert code != 0 and err.startswith("fastio: error: ") and "c.txt: a .txt file holds no conversations" in err


BOS_AND_EOS = ("{{ bos_token }}{% for m in messages %}{{ m.role + ': ' }}{% if m.role == 'assistant' %}{% generation %}"
               "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content + '\\n' }}{% endif %}"
               "{% endfor %}")
"""A template writing ``{{ bos_token }}`` and ``{{ eos_token }}``: what they are depends on the config's files."""


@pytest.mark.parametrize("config, legacy", [
    ({"eos_token": "<|endoftext|>"}, None),  # no bos_token: undefined, rendered as nothing
    ({"eos_token": "<|endoftext|>", "bos_token": None}, None),
    ({"eos_token": "<|endoftext|>"}, {"bos_token": "<s>"}),  # a legacy save: special_tokens_map.json's
    ({"eos_token": "<|endoftext|>", "bos_token": "<|im_start|>"}, {"bos_token": {"content": "<s>"}}),  # it wins
    ({"eos_token": "<|endoftext|>", "added_tokens_decoder": {}}, {"bos_token": "<s>"}),  # not a legacy save
    ({}, None),  # no eos_token either: undefined; the end-of-document id is the end-of-text token found by name
], ids=["no-bos", "null-bos", "legacy-bos", "legacy-over-config", "not-legacy", "no-specials"])
def test_a_configs_special_tokens_are_those_transformers_loads_none_guessed(tmp_path, config, legacy):
    """Found by hostile review: a tokenizer_config.json naming no bos_token (Qwen's "bos_token": null) under a
    template writing {{ bos_token }} was rendered with '<s>' (a special token guessed by its name, as for a .jinja
    file alone), where transformers loading the folder renders nothing: every conversation had one token more
    than the model's own. A legacy save's special_tokens_map.json beside the config (no added_tokens_decoder in
    it), which transformers reads over the config, was ignored. The conversion now renders with the special
    tokens transformers loads from the folder, and no others."""
    from transformers import PreTrainedTokenizerFast

    tok = chat_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": BOS_AND_EOS, **config}))
    if legacy is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(legacy))
    chat = [{"role": "user", "content": "alpha beta"}, {"role": "assistant", "content": "gamma"}]
    convert_tokens(TokenConvertConfig(write_chats(tmp_path / "c.jsonl", [chat]), tmp_path / "out", tok,
                                      chat_template=tmp_path / "tokenizer_config.json", workers=1))
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    if "eos_token" not in config:  # transformers renders an undefined eos_token as nothing too
        hf.eos_token = None
    want = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert stored_conversations(tmp_path / "out") == [(list(want["input_ids"]), list(want["assistant_masks"]))]
    assert load_manifest(tmp_path / "out").tokens.eos_id == 0  # <|endoftext|>, by the config or by its name


@pytest.mark.parametrize("saved", [
    {"truncation": {"direction": "Right", "max_length": 12, "strategy": "LongestFirst", "stride": 0}},
    {"padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                 "pad_type_id": 0, "pad_token": "<|endoftext|>"}},
], ids=["truncation", "padding"])
def test_a_truncation_or_padding_saved_in_the_tokenizer_is_not_applied(tmp_path, saved):
    """Found by hostile review: a tokenizer.json saved with a truncation (``enable_truncation(512)`` then
    ``save``: some published ones are) cut every conversation at its max_length, mid-turn, silently (the stored
    ids and mask ended there; here no reply token was left, so the run was refused as training nothing), and one
    saved with a padding stored each conversation padded with pad tokens, as if the conversation held them.
    transformers applies neither unless asked (apply_chat_template tokenizes without truncation or padding);
    fastio now loads the tokenizer without them."""
    spec = json.loads(chat_tokenizer(tmp_path / "plain.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps({**spec, **saved}))
    config = chat_config(tmp_path / "tokenizer_config.json")
    chats = conversations(6, seed=3, turns=(2, 4))
    convert_tokens(TokenConvertConfig(write_chats(tmp_path / "c.jsonl", chats), tmp_path / "out",
                                      tmp_path / "tokenizer.json", chat_template=config, workers=1))
    hf = hf_tokenizer(tmp_path / "tokenizer.json", config)
    want = [tuple(map(list, hf_ids_and_mask(hf, CHATML, c))) for c in chats]
    assert stored_conversations(tmp_path / "out") == want
    assert max(len(ids) for ids, _ in want) > 12 and min(len(ids) for ids, _ in want) < 64

"""Bad chat input a user writes by mistake, refused in one ``fastio: error:`` line naming the file, line and field
(never a traceback from ``tokenizers``, never DEST left behind): a JSON ``\\ud800`` escape (half a surrogate pair,
valid JSON but not text), a line that is not an object, a missing field named by its own flag."""

from __future__ import annotations

import json

import pytest
from helpers import run_cli
from tokens_helpers import SHAREGPT_ROLES, chat_config, chat_tokenizer, conversations, train_tokenizer

from fastio.convert.token_convert import TokenConvertConfig, convert_tokens
from fastio.errors import ConvertError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatbad")
    return chat_tokenizer(root / "tokenizer.json"), chat_config(root / "tokenizer_config.json")


def _source(path, last: str):
    """Two good conversations then the raw line ``last`` (line 3)."""
    good = "".join(json.dumps({"messages": c}) + "\n" for c in conversations(2))
    path.write_text(good + last + "\n")
    return path


def _cli(tmp_path, capsys, files, *extra):
    tok, config = files
    return run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(tok),
                    *extra, "--workers", "1"], capsys)


LONE = '{"role": "user", "content": "hi \\ud800 there"}, {"role": "assistant", "content": "ok"}'


def test_a_lone_surrogate_escape_in_a_message_is_one_line_naming_line_and_field(tmp_path, capsys, files):
    _source(tmp_path / "c.jsonl", '{"messages": [' + LONE + "]}")
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fastio: error: ") and "c.jsonl:3: field 'messages' holds '\\ud800'" in err, err
    assert "surrogate" in err and not (tmp_path / "d").exists()


def test_a_lone_surrogate_escape_in_a_plain_document_is_named(tmp_path, files):
    (tmp_path / "p.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\udfff end"}\n')
    with pytest.raises(ConvertError, match=r"p.jsonl:2: field 'text' holds '\\udfff', half of a UTF-16 surrogate"):
        convert_tokens(TokenConvertConfig(tmp_path / "p.jsonl", tmp_path / "d", files[0], workers=1))
    assert not (tmp_path / "d").exists()


def test_a_surrogate_pair_escape_is_text_and_converts(tmp_path, files):
    pair = '{"role": "user", "content": "smile \\ud83d\\ude00"}, {"role": "assistant", "content": "ok"}'
    _source(tmp_path / "c.jsonl", '{"messages": [' + pair + "]}")
    convert_tokens(TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "d", files[0], chat_template=files[1],
                                      workers=1))
    assert (tmp_path / "d" / "manifest.json").exists()


@pytest.mark.parametrize("line, said", [("[1, 2]", "a list, not a JSON object"),
                                        ("null", "null, not a JSON object"),
                                        # json's own words counted the line's newline as a line 2: 'line 2 column 1'
                                        ('{"messages": [', "not a JSON object (Expecting value at the end of the line)"),
                                        ('{"messages": [}]}', "not a JSON object (Expecting value at column 15)"),
                                        ('{"text": "hi"}', "has no field 'messages' (--messages-field messages; "
                                                           "the line's fields: 'text')"),
                                        # found by review: a ShareGPT line's field was not named
                                        ('{"id": 1, "conversations": []}', "has no field 'messages' (--messages-field "
                                                                           "messages; the line's fields: 'id', "
                                                                           "'conversations')"),
                                        ("{}", "has no field 'messages' (--messages-field messages; the line's fields: "
                                               "none)")])
def test_a_line_that_is_not_a_conversation_object_is_named_with_the_chat_flag(tmp_path, capsys, files, line, said):
    _source(tmp_path / "c.jsonl", line)
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]))
    assert code == 2 and err.startswith("fastio: error: ") and err.endswith(f"c.jsonl:3: {said}\n"), err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_an_empty_messages_field_flag_is_refused_not_replaced_by_the_default(tmp_path, capsys, files):
    _source(tmp_path / "c.jsonl", json.dumps({"messages": conversations(1)[0]}))
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]), "--messages-field", "")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("fastio: error: --messages-field") and "''" in err, err
    assert not (tmp_path / "d").exists()


def test_overlong_other_than_refuse_without_max_tokens_is_refused_naming_both_flags(tmp_path, capsys, files):
    _source(tmp_path / "c.jsonl", json.dumps({"messages": conversations(1)[0]}))
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]), "--overlong", "drop")
    assert code == 2 and err == ("fastio: error: --overlong drop needs --max-tokens N (the most tokens a conversation "
                                 "may have; without it no conversation is over)\n"), err
    assert not (tmp_path / "d").exists()


def test_every_conversation_left_out_as_overlong_is_named_as_such_not_as_empty(tmp_path, capsys, files):
    _source(tmp_path / "c.jsonl", json.dumps({"messages": conversations(1)[0]}))
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]), "--max-tokens", "3",
                        "--overlong", "drop")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.endswith("c.jsonl: nothing to write: 3 conversations longer than --max-tokens 3 left out "
                        "(--overlong drop)\n"), err
    assert not (tmp_path / "d").exists()


def test_an_eos_token_the_template_config_names_but_the_tokenizer_lacks_is_blamed_on_the_config(tmp_path, capsys,
                                                                                              files):
    bare = train_tokenizer(tmp_path / "bare.json", eos=None, specials=("<|im_start|>", "<|im_end|>", "<s>"))
    _source(tmp_path / "c.jsonl", json.dumps({"messages": conversations(1)[0]}))
    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(bare),
                            "--chat-template", str(files[1]), "--workers", "1"], capsys)
    assert code == 2 and err == (f"fastio: error: {bare}: '<|endoftext|>' is not a special token (the eos_token of "
                                 f"{files[1]}); its special tokens: <s>, <|im_end|>, <|im_start|>\n"), err


@pytest.mark.parametrize("flag, said", [
    (["--special-in-text", "refuse"], "--special-in-text refuse is not an option of a conversion of conversations "
                                      "(--chat-template): a special token's string in a message is that special "
                                      "token, as transformers encodes it"),
    (["--text-field", "body"], "--text-field body is not an option of a conversion of conversations "
                               "(--chat-template): the conversations are read from --messages-field messages")])
def test_a_plain_text_option_with_a_chat_template_is_refused_not_ignored(tmp_path, capsys, files, flag, said):
    """--special-in-text refuse used to be accepted and ignored: a message holding '<|im_end|>' was converted with
    that special token's id, what the user had asked to refuse."""
    _source(tmp_path / "c.jsonl", json.dumps({"messages": [{"role": "user", "content": "alpha<|im_end|>"},
                                                           {"role": "assistant", "content": "beta"}]}))
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]), *flag)
    assert code == 2 and err == f"fastio: error: {said}\n", err
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match=r"^special_in_text='refuse' is not an option of a conversion of conversations "
                                         r"\(chat_template\)"):
        TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "d", files[0], chat_template=files[1],
                           special_in_text="refuse")


def test_conversations_of_which_no_token_is_trained_are_refused_not_published(tmp_path, capsys, files):
    """ShareGPT's roles ('human', 'gpt') under a template that tests for 'assistant': every conversation rendered,
    none trained; it used to be published with exit 0 ('0 tokens trained (0.0%)'), a dataset that trains nothing."""
    (tmp_path / "t.jinja").write_text(SHAREGPT_ROLES)
    chats = [[{"role": "human", "content": "alpha"}, {"role": "gpt", "content": "beta"}]] * 3
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(files[0]),
                            "--chat-template", str(tmp_path / "t.jinja"), "--workers", "1"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"fastio: error: {tmp_path / 'c.jsonl'}: nothing to train: no token of the 3 conversations "
                          f"is inside a {{% generation %}} block of {tmp_path / 't.jinja'}"), err
    assert "--train-on all" in err and not (tmp_path / "d").exists()
    for k in (0, 1):  # parts: each may train nothing, the merge refuses the whole
        convert_tokens(TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "p", files[0], workers=1, part=(k, 2),
                                          chat_template=tmp_path / "t.jinja"))
    code, _, err = run_cli(["merge", str(tmp_path / "p")], capsys)
    assert code == 2 and "nothing to train: no token of the 3 conversations" in err, err
    assert not (tmp_path / "p" / "manifest.json").exists()
    chats[1] = [{"role": "human", "content": "alpha"}, {"role": "assistant", "content": "beta"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    result = convert_tokens(TokenConvertConfig(tmp_path / "c.jsonl", tmp_path / "d", files[0], workers=1,
                                               chat_template=tmp_path / "t.jinja"))
    assert result.documents == 3 and result.trained > 0  # one trained conversation is enough


def test_a_template_message_holding_a_newline_is_still_one_line(tmp_path, capsys, files):
    """The template's own words go into the line: CHATML's raise_exception('unknown role ' ~ role) with a role
    holding a newline (data), or a template raising a two-line message, printed two lines; control characters are
    now escaped."""
    _source(tmp_path / "c.jsonl", json.dumps({"messages": [{"role": "wiz\nard", "content": "x"}]}))
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(files[1]))
    assert code == 2 and err.endswith("the template refused it: unknown role wiz\\nard\n") and err.count("\n") == 1, err
    (tmp_path / "t.jinja").write_text('{% generation %}{{ raise_exception("no\\r\\nway\\tout") }}{% endgeneration %}')
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(tmp_path / "t.jinja"), "--train-on", "all")
    assert code == 2 and err.endswith("the template refused it: no\\r\\nway\\tout\n") and err.count("\n") == 1, err
    assert not (tmp_path / "d").exists()


def test_conversations_the_template_renders_to_nothing_are_named_as_such(tmp_path, capsys, files):
    """Every conversation rendered empty (a template whose output is all under a false condition) was refused as
    'holds no document with text (3 empty documents)': the text was there, the template wrote nothing of it."""
    (tmp_path / "t.jinja").write_text("{% if false %}{% generation %}{{ messages }}{% endgeneration %}{% endif %}")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations(3)))
    code, _, err = _cli(tmp_path, capsys, files, "--chat-template", str(tmp_path / "t.jinja"))
    assert code == 2 and err == (f"fastio: error: {tmp_path / 'c.jsonl'}: holds no conversation the chat template "
                                 "renders to any token (3 conversations rendered empty)\n"), err
    assert not (tmp_path / "d").exists()


def test_a_bos_token_the_template_renders_but_the_tokenizer_lacks_is_blamed_on_the_config(tmp_path, capsys, files):
    other = train_tokenizer(tmp_path / "other.json", specials=("<|im_start|>", "<|im_end|>"))
    _source(tmp_path / "c.jsonl", json.dumps({"messages": conversations(1)[0]}))
    code, _, err = run_cli(["convert", str(tmp_path / "c.jsonl"), str(tmp_path / "d"), "--tokenizer", str(other),
                            "--chat-template", str(files[1]), "--workers", "1"], capsys)
    assert code == 2 and err == (f"fastio: error: {other}: '<s>' is not a special token (the bos_token of "
                                 f"{files[1]}, which its template renders); its special tokens: <|endoftext|>, "
                                 "<|im_end|>, <|im_start|>\n"), err
    assert not (tmp_path / "d").exists()

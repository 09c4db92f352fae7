"""Hugging Face chat templates: a conversation rendered to text as transformers' ``apply_chat_template`` renders it,
with the character spans its ``{% generation %}...{% endgeneration %}`` blocks produced.

The environment is transformers' (``transformers.utils.chat_template_utils``, 5.x): a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
``generation`` block tag; its ``tojson`` filter (no HTML escaping, ``ensure_ascii=False``), and the globals
``raise_exception`` (a :class:`ChatTemplateError` carrying the template's message), ``strftime_now``, ``dict`` and a
``namespace`` that refuses underscore names. A conversation is prepared as transformers prepares it: keys whose
value is None dropped, a message's reasoning (``reasoning_content``, ``thinking`` or ``reasoning``) given under
``thinking`` and ``reasoning_content`` too; the template sees ``messages``, ``tools=None``, ``documents=None``,
``add_generation_prompt=False`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).

A generation span is ``(start, end)`` in characters of the rendered text: where the block's output begins in the
text rendered before it, and its length after. The template of a ``tokenizer_config.json`` is its ``chat_template``
(a string, or a list of named templates: the one named ``default``), or the ``chat_template.jinja`` beside it where
there is one (transformers saves a template there, and takes it first), and its special tokens (``bos_token``,
``eos_token``, ...: a string or an added-token object's ``content``) are the template's variables: those of the
config, and where it lists no ``added_tokens_decoder`` (a legacy save) those of a ``special_tokens_map.json`` beside
it over them, as transformers loads a tokenizer's folder; one neither names is undefined (rendered as nothing).

The only importer of ``jinja2``.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE_FILE", "GENERATION_TAG", "REASONING_FIELDS", "SPECIAL_TOKENS_MAP_FILE", "SPECIAL_TOKEN_KEYS",
           "ChatTemplate", "ChatTemplateError",
           "has_generation", "load_chat_template", "prepare_messages", "render"]

GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
"""A ``{% generation %}`` tag (transformers' own test of a template for one)."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""The file beside ``tokenizer_config.json`` that holds a tokenizer's template as transformers (>= 4.43) saves it;
loading, transformers takes it over a ``chat_template`` the config holds."""
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
"""The file beside ``tokenizer_config.json`` of a legacy save's special tokens: transformers reads it (over the
config's) where the config lists no ``added_tokens_decoder``."""
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens of a ``tokenizer_config.json`` a template sees by these names."""
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning comes under (transformers', in its order: the first one set is given under
``thinking`` and ``reasoning_content`` too)."""


class ChatTemplateError(ValueError):
    """A template that cannot be read, compiled or rendered (the message says why, without a location: the caller
    names the file and line)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source text, where it came from, and the variables it is rendered with."""

    text: str
    path: str
    variables: dict[str, str] = field(default_factory=dict)
    config: str | None = None
    """The ``tokenizer_config.json`` whose special tokens are :attr:`variables` (None: a ``.jinja`` file alone, whose
    caller may fill them in)."""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def has_generation(self) -> bool:
        return has_generation(self.text)

    @property
    def rendered_variables(self) -> dict[str, str]:
        """The :attr:`variables` its text names (``{{ bos_token }}``): the special tokens that can reach its output,
        not those a config lists and it never writes (a ``pad_token``)."""
        return {k: v for k, v in self.variables.items() if re.search(rf"\b{re.escape(k)}\b", self.text)}


def has_generation(text: str) -> bool:
    """Whether template ``text`` marks what the assistant generates with ``{% generation %}``."""
    return GENERATION_TAG.search(text) is not None


def _token_text(value: Any) -> str | None:
    """A special token's string in a ``tokenizer_config.json``: a string, or an added-token object's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(data: Any, path: Path) -> str:
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # named templates: transformers' default is the one named "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None and named:
            raise ChatTemplateError(f"{path}: holds named chat templates ({', '.join(map(repr, named))}) but none "
                                    "named 'default' (write the one to train with to a .jinja file and pass that)")
    if not isinstance(template, str):
        raise ChatTemplateError(f"{path}: holds no chat_template string, and no {CHAT_TEMPLATE_FILE} is beside it (a "
                                "tokenizer_config.json's, or a .jinja file)")
    return template


def load_chat_template(path: str | Path) -> ChatTemplate:
    """The template of a ``.jinja`` file (no variables of its own) or of a ``tokenizer_config.json`` (with its special
    tokens as variables: its ``chat_template``, or where a :data:`CHAT_TEMPLATE_FILE` is beside it, that file's, as
    transformers loads a tokenizer's folder); a :class:`ChatTemplateError` naming the file otherwise."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"{path}: cannot be read as a chat template ({getattr(err, 'strerror', None) or err})"
                                ) from None
    if path.suffix.lower() != ".json":
        text, variables = raw, {}
    else:
        try:
            data = json.loads(raw)
        except ValueError as err:
            raise ChatTemplateError(f"{path}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ChatTemplateError(f"{path}: a JSON {type(data).__name__}, not an object (a tokenizer_config.json)")
        variables = _special_tokens(data, path)
        beside = path.with_name(CHAT_TEMPLATE_FILE)
        if beside.is_file():  # transformers' priority over the config's own chat_template
            return replace(load_chat_template(beside), variables=variables, config=str(path))
        text = _config_template(data, path)
    _compiled(text, str(path))  # a syntax error named now, not at the first conversation
    return ChatTemplate(text, str(path), variables, None if path.suffix.lower() != ".json" else str(path))


def _special_tokens(config: dict, path: Path) -> dict[str, str]:
    """The special tokens of a ``tokenizer_config.json`` (``config``, read from ``path``) by name, as transformers
    loads them: the config's, and where it lists no ``added_tokens_decoder`` (a legacy save) those a
    :data:`SPECIAL_TOKENS_MAP_FILE` beside it names, over them; a token given as None is none."""
    tokens = {k: config.get(k) for k in SPECIAL_TOKEN_KEYS}
    legacy = path.with_name(SPECIAL_TOKENS_MAP_FILE)
    if "added_tokens_decoder" not in config and legacy.is_file():
        try:
            extra = json.loads(legacy.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ChatTemplateError(f"{legacy}: cannot be read as JSON ({getattr(err, 'strerror', None) or err})"
                                    ) from None
        if not isinstance(extra, dict):
            raise ChatTemplateError(f"{legacy}: a JSON {type(extra).__name__}, not an object")
        tokens.update((k, extra[k]) for k in SPECIAL_TOKEN_KEYS if k in extra)
    return {k: t for k, v in tokens.items() if (t := _token_text(v)) is not None}


def prepare_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as transformers hands them to the template: keys whose value is None dropped, a message's
    reasoning under ``thinking`` and ``reasoning_content`` too."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the conversation rendered (:func:`prepare_messages` first) and its generation spans in
    characters; a :class:`ChatTemplateError` with the template's own message (on one line: :func:`_one_line`) when
    it raises or fails."""
    import jinja2

    compiled = _compiled(template.text, template.path)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    try:
        with compiled.environment.fastio_tracker(blocks, spans):
            for block in compiled.generate(messages=prepare_messages(messages), tools=None, documents=None,
                                           add_generation_prompt=False, **template.variables):
                blocks.append(block)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the template refused it: {_one_line(str(err))}") from None
    except Exception as err:  # noqa: BLE001 (a template may fail in any way: an attribute of None, a bad index)
        raise ChatTemplateError(f"the template failed: {type(err).__name__}: {_one_line(str(err))}") from None
    return "".join(blocks), spans


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _one_line(text: str) -> str:
    """A template's message (its words, often with the data's: ``'unknown role ' ~ role``) with its control
    characters escaped (a newline as ``\\n``), so that the refusal stays one line."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)


@lru_cache(maxsize=8)
def _compiled(text: str, where: str):
    """The compiled template (one environment per template: its tracker's state is its own)."""
    import jinja2

    try:
        return _environment().from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"{where}: not a jinja template: line {err.lineno}: {err.message}") from None


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_tracker_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_namespace_class())
    return env


def _tracker_extension():
    """The ``{% generation %}`` tag: its body's output, and where it begins in the text rendered so far."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(fastio_tracker=self.tracking)
            self._blocks = self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context, caller):
            rv = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(rv)))
            return rv

        @contextmanager
        def tracking(self, blocks: list[str], spans: list[tuple[int, int]]):
            self._blocks, self._spans = blocks, spans
            try:
                yield
            finally:
                self._blocks = self._spans = None

    return GenerationTracker


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in a template, without attribute access to the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _namespace_class():
    import jinja2.utils

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's ``namespace`` refusing underscore-prefixed attributes."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                                      f"on a namespace, got {name!r}")

    return TemplateNamespace

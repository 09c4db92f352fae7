"""``fastio convert``, ``fastio verify``, ``fastio inspect``: parse options, call the library, print.

Heavy modules are imported inside the commands so that ``fastio --help`` stays instant.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

from fastio.cli.group import cli, long_flag, storage_flags, storage_options, warn_idle_flags
from fastio.errors import ConvertError, DatasetError, FastioError
from fastio.formats.images import DEFAULT_MAX_PIXELS
from fastio.words import one_line

__all__ = ["convert", "index", "inspect", "merge", "verify"]

_FLAG_OF_FIELD = {"progress_every_s": "progress_every"}
"""Config fields whose flag has another name: ``progress_every_s`` is ``--progress-every``."""
_CLI_WORDS = {" (or None)": "", "(or None for no limit)": "(0 for no limit)"}
"""A config's "not given" (None) in the command's words: a flag left out, ``--max-pixels 0``."""


def _in_flags(text: str, *, leading: bool = False, command: click.Command | None = None) -> str:
    """A library message in terms of the flags of ``command`` (default: the current command; ``fastio inspect``
    names what ``fastio convert`` recorded with :func:`convert`'s): ``on_error='fail'`` -> ``--on-error fail``,
    ``overwrite=True`` -> ``--overwrite``, ``path_column=NAME`` -> ``--path-column NAME``, ``max_tokens=3`` ->
    ``--max-tokens 3``, ``part=...`` -> ``--part ...``, ``(max_pixels)`` -> ``(--max-pixels)`` and, with ``leading``
    (a parameter's ValueError), a leading ``max_side`` -> ``--max-side``
    (``progress_every_s`` -> ``--progress-every``: :data:`_FLAG_OF_FIELD`), unless that word is a value given on
    the command line (a folder named ``dest``); a flag the message already names before its Python spelling
    (``--transcode vp9 (transcode='vp9')``) is named once; Python's None in the command's words (:data:`_CLI_WORDS`)."""
    ctx = click.get_current_context()
    flags = {opt[2:].replace("-", "_"): opt for p in (command or ctx.command).params if isinstance(p, click.Option)
             for opt in p.opts if opt.startswith("--")}
    flags.update({field: flags[name] for field, name in _FLAG_OF_FIELD.items() if name in flags})
    for python, words in _CLI_WORDS.items():
        text = text.replace(python, words)
    names = "|".join(sorted(flags, key=len, reverse=True))
    given = {str(v) for v in ctx.params.values() if isinstance(v, (str, Path))}  # a path the user named stays one
    if leading:
        text = re.sub(rf"^({names})(?=[: ])", lambda m: m[1] if m[1] in given else flags[m[1]], text)
    text = re.sub(rf"\b({names})=(True\b|'[^']*'|[A-Z]+\b|\d+\b|\.\.\.)",
                  lambda m: flags[m[1]] + ("" if m[2] == "True" else " " + m[2].strip("'")), text)
    text = re.sub(rf"\(({names})\)", lambda m: m[0] if m[1] in given else f"({flags[m[1]]})", text)  # (max_pixels)
    return re.sub(r"(--[a-z][a-z-]*(?: [^\s()]+)?) \(\1\)", r"\1", text)


@cli.command()
@click.argument("source")
@click.argument("dest")
@click.option("--format", "fmt", metavar="FORMAT", default=None,
              help="imagefolder, csv, jsonl, parquet or files (default: detected from SOURCE; a detected image "
                   "folder already split, SOURCE/train/<class>/ and SOURCE/val/<class>/, is written as DEST/train "
                   "and DEST/val with one class list; --format imagefolder reads it as one dataset labelled by "
                   "its split folders).")
@click.option("--shard-size", default="256MB", show_default=True,
              help="Largest shard size: bytes or human units (256MB, 1GiB, 500k).")
@click.option("--max-samples-per-shard", type=int, default=None, help="At most this many samples per shard.")
@click.option("--workers", type=int, default=None,
              help="Worker processes (default: one per CPU; never more than the samples to load).")
@click.option("--shuffle/--no-shuffle", default=False, show_default=True,
              help="Permute the sample order with --seed before sharding.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --shuffle and --split.")
@click.option("--split-by", default=None, metavar="label|random",
              help="How --split is drawn: label (each split takes its fraction of every class; the default when "
                   "the source has labels) or random.")
@click.option("--split", default=None, metavar="NAME=FRAC[,...]",
              help="E.g. val=0.05: write DEST/train and DEST/val, each a complete dataset.")
@click.option("--classes-from", type=click.Path(path_type=Path), default=None, metavar="DATASET",
              help="Image folders: label by DATASET's class list (label k the same class as there), for a split "
                   "converted apart (images/val after images/train); a class folder it lacks is refused.")
@click.option("--max-side", type=int, default=None,
              help="Downscale and re-encode images whose longer side exceeds this (default: keep bytes).")
@click.option("--quality", type=int, default=90, show_default=True, help="JPEG/WebP quality with --max-side.")
@click.option("--transcode", default=None, metavar="flac|vp9|vp9,flac|none",
              help="flac (the default): store audio DALI's audio decoder cannot read (MP3, AAC, ALAC, ...) decoded "
                   "as FLAC, counted in the summary; vp9: re-encode video of a codec --video-decoder does not keep "
                   "(FFV1, ProRes, ...) as VP9 WebM (and skip such audio); vp9,flac: both; with PyAV, no ffmpeg "
                   "needed; none: such files are skipped and listed.")
@click.option("--video-decoder", default="auto", show_default=True, metavar="auto|cpu|nvdec",
              help="Which videos are kept as they are: auto (VP8, VP9, MJPEG, H.264, HEVC, MPEG-4, AV1: a Loader "
                   "decodes them with NVDEC on a GPU, with DALI's CPU decoder or PyAV on a CPU), cpu (only what "
                   "DALI's CPU decoder reads: VP8, VP9, MJPEG) or nvdec (as auto).")
@click.option("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, show_default=True,
              help="An image with more pixels (read from its header, before decoding) is rejected like a corrupt "
                   "one (see --on-error); 0: no limit of fastio's own.")
@click.option("--on-error", default="skip", show_default=True, metavar="skip|fail",
              help="A rejected input (corrupt or unreadable file, image over --max-pixels or of a type the Loader "
                   "does not decode, bad or empty label, "
                   "path outside --root, symlink against the policy, an image-text line's missing image) is "
                   "skipped and listed in the manifest, "
                   "or stops the run.")
@click.option("--overwrite", is_flag=True, help="Replace a DEST that holds a dataset or other files.")
@click.option("--name", default="shard", show_default=True, help="Shard file prefix: shards/NAME-000000.tar.")
@click.option("--path-column", default=None, help="Tables: column with file paths (default: detected).")
@click.option("--label-column", default=None, help="Tables: column with labels (default: detected: label, class or cls).")
@click.option("--key-column", default=None, help="Tables: column with sample keys (default: detected: __key__ or key).")
@click.option("--labels", default="auto", show_default=True, metavar="auto|integers|names",
              help="Tables: label rule. auto: the values when all are integral (2, 2.0), sorted class names "
                   "numbered from 0 when none is, an error naming rows on a mix; names: always class names.")
@click.option("--root", type=click.Path(path_type=Path), default=None,
              help="Tables and image-text JSONL: relative paths start here and every path must resolve inside it "
                   "(default: the table's or JSONL's folder).")
@click.option("--part", default=None, metavar="K/N",
              help="Convert only part K (0-based) of N into DEST/.parts/ for `fastio merge DEST`; "
                   "auto/N takes K from SLURM_ARRAY_TASK_ID.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary line.")
@click.option("--progress-every", type=float, default=5.0, show_default=True, metavar="SECONDS",
              help="When stderr is not a terminal (a log file, Slurm): a progress line this often.")
@click.option("--staging-dir", default=None, type=click.Path(path_type=Path),
              help="s3:// DEST: where the dataset is written before the upload, in a folder named after DEST "
                   "and only you can write in (one that is a link or others can write in is refused; a killed "
                   "run's copy is replaced by the rerun; needs the dataset's size; default: the system temp dir).")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="A tokenizer.json: write a token dataset (Megatron .bin/.idx shards) from JSONL, Parquet or .txt "
                   "documents (docs/tokens.md).")
@click.option("--text-field", default=None, help="With --tokenizer, not --chat-template: the JSONL field or "
                                                 "Parquet column of the text (default: text).")
@click.option("--eos", default=None, metavar="TOKEN", help="With --tokenizer: the end-of-document token appended to "
                                                            "each document, one of the tokenizer's special tokens "
                                                            "(default: its end-of-text token); with --chat-template "
                                                            "none is appended: it is the dataset's end-of-document "
                                                            "id (default: the template config's eos_token).")
@click.option("--special-in-text", default=None, metavar="plain|refuse",
              help="With --tokenizer, not --chat-template: a special token's string in a document's text "
                   "(<|endoftext|>) is encoded as plain text, the documents counted (plain, the default), or refused "
                   "naming the document.")
@click.option("--chat-template", type=click.Path(path_type=Path), default=None, metavar="FILE",
              help="With --tokenizer: each document is a conversation (a list of {role, content} messages, or "
                   "ShareGPT's {from, value}, in --messages-field) rendered with this Hugging Face chat template "
                   "(a .jinja file or a tokenizer_config.json); the tokens of its {% generation %} blocks are "
                   "trained (a loss mask beside each shard; docs/tokens.md).")
@click.option("--messages-field", default=None, help="With --chat-template: the JSONL field or Parquet column of "
                                                     "each conversation's messages (default: messages).")
@click.option("--train-on", default=None, metavar="generation|all",
              help="With --chat-template: the tokens of the template's {% generation %} blocks (the assistant's "
                   "replies; the default) or every token.")
@click.option("--max-tokens", type=int, default=None, metavar="N",
              help="With --chat-template: the most tokens a conversation may have (the training seq_len + 1); a "
                   "longer one is handled by --overlong, never cut mid-turn (default: no limit; the Loader refuses a "
                   "seq_len + 1 below the longest). With --image-field too: each image counted as --image-seq-len "
                   "tokens.")
@click.option("--overlong", default=None, metavar="refuse|drop|truncate",
              help="With --max-tokens: a longer conversation stops the run naming it (refuse, the default), is left "
                   "out and counted (drop), or keeps its first turns that fit, whole, ending with the model's reply (a "
                   "message the template trains, never a user's; truncate; counted; dropped where none fits); drop and "
                   "truncate without --max-tokens are refused. With --image-field: refuse or drop (a dropped line "
                   "is listed as skipped).")
@click.option("--image-field", default=None, metavar="FIELD",
              help="With --tokenizer and --chat-template: an image-text conversion (docs/image-text.md): each JSONL "
                   "line's FIELD lists its images (paths relative to the JSONL's folder, or s3:// URLs; the JSONL may "
                   "be an s3:// URL too), stored as images beside the conversation's tokens and loss mask; a "
                   "dataset of which no token is trained is refused.")
@click.option("--image-token", default=None, metavar="TOKEN",
              help="With --image-field: the placeholder of one image in the messages' text, one of the "
                   "tokenizer's added tokens (default: <image>).")
@click.option("--image-seq-len", type=int, default=None, metavar="N",
              help="With --image-field and --max-tokens (needed there): the tokens each image becomes in the Loader "
                   "(fastio.ImageText's image_seq_len), counted against --max-tokens.")
@storage_flags()
def convert(source: str, dest: str, fmt: str | None, shard_size: str, max_samples_per_shard: int | None,
            workers: int | None, shuffle: bool, seed: int, split_by: str | None, split: str | None, max_side: int | None,
            quality: int, max_pixels: int, on_error: str, overwrite: bool, name: str, path_column: str | None,
            label_column: str | None, key_column: str | None, labels: str, root: Path | None, part: str | None,
            quiet: bool, progress_every: float, staging_dir: Path | None, tokenizer: Path | None,
            text_field: str | None, eos: str | None, special_in_text: str | None, chat_template: Path | None,
            messages_field: str | None, train_on: str | None, max_tokens: int | None, overlong: str | None,
            image_field: str | None, image_token: str | None, image_seq_len: int | None, endpoint_url: str | None,
            region: str | None,
            profile: str | None, classes_from: Path | None = None, transcode: str | None = None,
            video_decoder: str = "auto") -> None:
    """Pack SOURCE (image/video/audio folder, CSV/JSONL/Parquet table, loose files) into verified shards in DEST.

    DEST is a folder or s3://bucket/prefix (written locally, then uploaded; the manifest last); a run that fails
    or is stopped with Ctrl-C takes back what it wrote (a killed one leaves it marked unfinished for the rerun). With
    --part K/N, convert one of N parts (they may run at once, on several nodes); then `fastio merge DEST`.
    With --tokenizer, tokenize text documents (a file, a folder or an s3:// prefix) into a token dataset; with
    --chat-template too, conversations, trained on the assistant's tokens; with --image-field too, image-text
    conversations (images beside tokens and mask; the JSONL and its images local or on s3://)."""
    from fastio.convert.run import convert as run_convert

    image_text = _image_text_options(tokenizer, chat_template, image_field, image_token, messages_field,
                                     {"max_tokens": max_tokens, "overlong": overlong, "image_seq_len": image_seq_len},
                                     {"text_field": text_field, "eos": eos, "special_in_text": special_in_text,
                                      "train_on": train_on})
    if image_text is None and any(v is not None for v in (tokenizer, text_field, eos, special_in_text, chat_template,
                                                          messages_field, train_on, max_tokens, overlong)):
        _convert_tokens(click.get_current_context(), quiet, workers=workers)
        return
    config = _convert_config(click.get_current_context().params)
    warn_idle_flags(click.get_current_context(), _convert_idle(click.get_current_context()))  # once values are good
    try:
        result = run_convert(config) if image_text is None else _run_image_text(config, image_text)
    except ConvertError as err:
        raise ConvertError(_in_flags(str(err))) from None
    if not quiet:
        click.echo(result.summary(words=_in_flags))


def _convert_config(p: dict[str, Any]) -> Any:
    """The ``ConvertConfig`` of ``fastio convert``'s flags ``p`` (click's parameters by name); a value it refuses is a
    ConvertError naming the flag."""
    from fastio.convert.run import ConvertConfig
    from fastio.progress import progress_wanted

    kwargs: dict[str, Any] = {} if p["workers"] is None else {"workers": p["workers"]}
    if p.get("transcode") is not None:
        kwargs["transcode"] = p["transcode"]
    quiet = p["quiet"]
    try:
        return ConvertConfig(
            source=p["source"], dest=p["dest"], format=p["fmt"], shard_size=p["shard_size"],
            max_samples_per_shard=p["max_samples_per_shard"], shuffle=p["shuffle"], seed=p["seed"],
            split=p["split"], split_by=p["split_by"], max_side=p["max_side"], quality=p["quality"],
            max_pixels=p["max_pixels"] or None, on_error=p["on_error"], overwrite=p["overwrite"], name=p["name"],
            path_column=p["path_column"], label_column=p["label_column"], key_column=p["key_column"],
            labels=p["labels"], root=p["root"], classes_from=p["classes_from"], part=p["part"],
            progress=progress_wanted(quiet),
            progress_every_s=None if quiet or progress_wanted(quiet) else p["progress_every"],
            staging_dir=p["staging_dir"], video_decoder=p.get("video_decoder", "auto"),
            storage_options=storage_options(p["endpoint_url"], p["region"], p["profile"]), **kwargs,
        )
    except ValueError as err:
        raise ConvertError(_in_flags(str(err), leading=True)) from None


_PARTNERS = {"quality": ("max_side",), "split_by": ("split",), "seed": ("shuffle", "split")}
"""A ``fastio convert`` flag that is read only with one of these (given, or true)."""


def _convert_idle(ctx: click.Context) -> dict[str, str]:
    """:func:`~fastio.cli.group.warn_idle_flags`' flags of ``fastio convert`` (the conversion is the same as without
    them): ``--staging-dir`` with a local DEST; outside a token conversion (which refuses them by name; an
    image-text one takes them), a flag given without any of its partners (:data:`_PARTNERS`)."""
    params, idle = ctx.params, {}
    if not _remote(params["dest"]):
        idle["staging_dir"] = "with an s3:// DEST (a local DEST is written where it is)"
    token_conversion = params["tokenizer"] is not None and params["image_field"] is None
    for name, partners in _PARTNERS.items() if not token_conversion else ():
        if not any(params[p] for p in partners):
            idle[name] = "with " + " or ".join(long_flag(ctx, p) for p in partners)
    return idle


def _remote(dest: str) -> bool:
    """Whether DEST is an object store URL (``s3://``; a ``file://`` URL is a local folder), as the library reads it
    (a URL it cannot read is refused here, as it would be there)."""
    from fastio.storage.url import is_remote

    return is_remote(dest)


def _mixture_file(dest: str) -> bool:
    """Whether ``fastio inspect DEST`` reads a mixture file: a ``.json`` that is not a folder, nor a dataset's own
    ``manifest.json`` or ``splits.json`` (those are named as files of their dataset)."""
    from fastio.dataset.manifest import MANIFEST_NAME, SPLITS_NAME

    return dest.endswith(".json") and not Path(dest).is_dir() and Path(dest).name not in (MANIFEST_NAME, SPLITS_NAME)


def _image_text_options(tokenizer: Path | None, chat_template: Path | None, image_field: str | None,
                        image_token: str | None, messages_field: str | None, lengths: dict[str, Any],
                        others: dict[str, Any]):
    """An image-text conversion's options (``--image-field`` given; ``lengths``: ``max_tokens``, ``overlong`` and
    ``image_seq_len``, None where not given), refusing the token-only flags (``others``: parameter name -> value,
    None where not given) by name; None without."""
    if image_field is None:
        for name in ("image_token", "image_seq_len"):
            if {"image_token": image_token, **lengths}[name] is not None:
                raise ConvertError(f"{long_flag(click.get_current_context(), name)} needs --image-field (an "
                                   "image-text conversion)")
        return None
    if tokenizer is None or chat_template is None:
        raise ConvertError("--image-field needs --tokenizer and --chat-template (an image-text conversion)")
    given = [long_flag(click.get_current_context(), name) for name, value in others.items() if value is not None]
    if given:
        raise ConvertError(f"{', '.join(given)}: not an option of an image-text conversion (--image-field)")
    from fastio.convert.image_text import ImageTextOptions

    try:
        return ImageTextOptions(tokenizer, chat_template, image_field=image_field,
                                image_token=_given(image_token, "<image>"),
                                messages_field=_given(messages_field, "messages"),
                                max_tokens=lengths["max_tokens"], image_seq_len=lengths["image_seq_len"],
                                overlong=_given(lengths["overlong"], "refuse"))
    except ValueError as err:
        raise ConvertError(_in_flags(str(err), leading=True)) from None


def _given(value: Any, default: Any) -> Any:
    """A flag's value, or ``default`` where it was not given (an empty value given stays, for the config to refuse:
    ``--messages-field ''`` is not the default field)."""
    return default if value is None else value


def _run_image_text(config, options):
    from fastio.convert.image_text import convert_image_text

    return convert_image_text(config, options)


_TOKEN_FLAGS = ("source", "dest", "tokenizer", "text_field", "eos", "special_in_text", "workers", "shard_size",
                "max_samples_per_shard", "name", "overwrite", "quiet", "part", "endpoint_url", "region", "profile",
                "staging_dir", "chat_template", "messages_field", "train_on", "max_tokens", "overlong")


def _convert_tokens(ctx: click.Context, quiet: bool, **kwargs: Any) -> None:
    """``fastio convert --tokenizer``: the flags a token conversion takes, the others refused by name."""
    from fastio.convert.token_convert import TokenConvertConfig, convert_tokens

    params = ctx.params
    other = [long_flag(ctx, p) for p in params if p not in _TOKEN_FLAGS and
             ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
    if params["tokenizer"] is None:
        raise ConvertError("--text-field, --eos, --special-in-text and the chat options (--chat-template, ...) need "
                           "--tokenizer (a token conversion)")
    if other:
        raise ConvertError(f"{', '.join(other)}: not an option of a token conversion (--tokenizer)")
    options = {k: params[k] for k in ("source", "dest", "tokenizer", "eos", "shard_size", "max_samples_per_shard",
                                      "name", "overwrite", "part", "staging_dir", "chat_template")}
    chat = ("messages_field", "train_on", "max_tokens", "overlong")
    if params["chat_template"] is None and any(params[k] is not None for k in chat):
        raise ConvertError("--messages-field, --train-on, --max-tokens and --overlong need --chat-template (a "
                           "conversion of conversations)")
    options.update({"messages_field": _given(params["messages_field"], "messages"),
                    "train_on": _given(params["train_on"], "generation"), "max_tokens": params["max_tokens"],
                    "overlong": _given(params["overlong"], "refuse")})
    options.update({"text_field": _given(params["text_field"], "text"),
                    "special_in_text": _given(params["special_in_text"], "plain"),
                    "storage_options": storage_options(params["endpoint_url"], params["region"], params["profile"])},
                   **{k: v for k, v in kwargs.items() if v is not None})
    try:
        config = TokenConvertConfig(**options)
    except ValueError as err:
        raise ConvertError(_in_flags(str(err), leading=True)) from None
    warn_idle_flags(ctx, _convert_idle(ctx))  # once its values are good
    try:
        result = convert_tokens(config)
    except ConvertError as err:
        raise ConvertError(_in_flags(str(err))) from None
    if not quiet:
        click.echo(result.summary(words=_in_flags))


@cli.command()
@click.argument("dest")
@click.option("--overwrite", is_flag=True, help="Replace a dataset DEST already holds.")
@click.option("--keep-parts", is_flag=True, help="Keep DEST/.parts/ after publishing (default: remove it).")
@click.option("--quiet", "-q", is_flag=True, help="No summary line.")
def merge(dest: str, overwrite: bool, keep_parts: bool, quiet: bool) -> None:
    """Publish the N parts written by `fastio convert --part K/N` (or `fastio index --dest DEST --part K/N`) as
    one dataset in DEST, identical to a single run. Fails naming any part that is missing, incomplete or made
    differently."""
    from fastio.convert.merge import merge as run_merge

    try:
        result = run_merge(dest, overwrite=overwrite, keep_parts=keep_parts)
    except ConvertError as err:
        raise ConvertError(_in_flags(str(err))) from None
    if not quiet:
        click.echo(result.summary())


@cli.command()
@click.argument("source", nargs=-1, required=True)
@click.option("--dest", default=None,
              help="Where the metadata goes (default: SOURCE's folder, .idx files beside the tars); elsewhere for "
                   "read-only shards: the manifest then names them by absolute path or URL.")
@click.option("--label-field", default=None, help="Field holding integer labels (default: cls or label, "
                                                   "when every sample has it).")
@click.option("--image-field", default=None, help="Main image field (default: the one most samples have).")
@click.option("--name", default="webdataset", show_default=True, help="Dataset name in the manifest.")
@click.option("--threads", type=int, default=4, show_default=True, help="Shards read at once.")
@click.option("--video-decoder", default="auto", show_default=True, metavar="auto|cpu|nvdec",
              help="Which videos are probed: auto (every codec a Loader decodes, H.264 too), cpu (VP8, VP9, MJPEG) "
                   "or nvdec (as auto); a member of another codec stays in its shard, named, not probed.")
@click.option("--overwrite", is_flag=True, help="Index again where a manifest exists, replacing the .idx files "
                                                "fastio wrote (shards and .idx files it did not write are never "
                                                "written).")
@click.option("--part", default=None, metavar="K/N",
              help="Index only part K (0-based) of N of the listing into DEST/.parts/ for `fastio merge DEST`; "
                   "auto/N takes K from SLURM_ARRAY_TASK_ID.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary line.")
@click.option("--eos-id", type=int, default=None,
              help="SOURCE is a folder or s3:// prefix of Megatron .bin/.idx pairs: index them as a token dataset "
                   "whose documents end with this end-of-document id (docs/tokens.md).")
@click.option("--vocab-size", type=int, default=None,
              help="With --eos-id: the tokenizer's size (its largest id + 1), recorded in the manifest; an id at or "
                   "above it is refused (the largest id is recorded either way).")
@storage_flags()
def index(source: tuple[str, ...], dest: str | None, label_field: str | None, image_field: str | None, name: str,
          threads: int, overwrite: bool, part: str | None, quiet: bool, eos_id: int | None, vocab_size: int | None,
          endpoint_url: str | None, region: str | None, profile: str | None, video_decoder: str = "auto") -> None:
    """Make existing WebDataset shards a fastio dataset without rewriting them.

    SOURCE is a folder of .tar shards, s3://bucket/prefix/, a brace pattern (/data/{00000..00999}.tar), or
    one or several local .tar files (wds/*.tar). Writes .idx files (existing ones are checked; only those an
    earlier fastio index wrote are replaced, with --overwrite), samples.fxi, probes.fxp when samples hold video or
    audio (each such member probed once with PyAV) and manifest.json. With --eos-id, SOURCE is a folder or s3://
    prefix of Megatron .bin/.idx pairs and only doc-starts.fxs (where documents start) and manifest.json (with
    the largest id, and --vocab-size) are written."""
    from fastio.convert.listing import paths_pattern
    from fastio.convert.wds_index import IndexConfig, index_shards
    from fastio.progress import count, progress_wanted

    if eos_id is not None:
        _index_tokens(click.get_current_context(), quiet)
        return
    if vocab_size is not None:
        raise DatasetError("--vocab-size: an option of a Megatron index (with --eos-id)")
    try:
        pattern = source[0] if len(source) == 1 else paths_pattern(list(source))
        config = IndexConfig(source=pattern, dest=dest, label_field=label_field, image_field=image_field, name=name,
                             threads=threads, overwrite=overwrite, part=part, video_decoder=video_decoder,
                             storage_options=storage_options(endpoint_url, region, profile))
    except ValueError as err:
        raise DatasetError(_in_flags(str(err), leading=True)) from None
    show = progress_wanted(quiet)
    report = (lambda done, total: click.echo(f"\rindexed {done}/{count(total, 'shard')}", nl=done == total, err=True)) \
        if show else None
    try:
        result = index_shards(config, progress=report)
    except DatasetError as err:
        raise DatasetError(_in_flags(str(err), leading=True)) from None
    if not quiet:
        click.echo(result.summary())


_TOKEN_INDEX_FLAGS = ("source", "dest", "eos_id", "vocab_size", "name", "overwrite", "quiet", "endpoint_url", "region",
                      "profile")


def _index_tokens(ctx: click.Context, quiet: bool) -> None:
    """``fastio index --eos-id``: Megatron pairs indexed in place; WebDataset-only flags refused by name."""
    from fastio.convert.token_index import TokenIndexConfig, index_tokens

    params = ctx.params
    other = [f"--{p.replace('_', '-')}" for p in params if p not in _TOKEN_INDEX_FLAGS and
             ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
    if other:
        raise DatasetError(f"{', '.join(other)}: not an option of a Megatron index (--eos-id)")
    name = params["name"] if ctx.get_parameter_source("name") is not click.core.ParameterSource.DEFAULT else "megatron"
    try:
        if len(params["source"]) != 1:
            raise DatasetError("--eos-id takes one folder or s3:// prefix of Megatron .bin/.idx pairs, not "
                               f"{len(params['source'])} paths")
        config = TokenIndexConfig(source=params["source"][0], eos_id=params["eos_id"], dest=params["dest"], name=name,
                                  overwrite=params["overwrite"], vocab_size=params["vocab_size"],
                                  storage_options=storage_options(params["endpoint_url"], params["region"],
                                                                  params["profile"]))
        result = index_tokens(config)
    except (ValueError, DatasetError) as err:
        raise DatasetError(_in_flags(str(err), leading=True)) from None
    if not quiet:
        click.echo(result.summary())


@cli.command()
@click.argument("dest")
@click.option("--decode", is_flag=True,
              help="Also decode every image, a clip of each video (its first 16 frames) and every audio file (PyAV, "
                   "and DALI's audio decoder as the Loader runs it), and "
                   "name each sample without an image field (the image pipelines refuse it).")
@click.option("--quiet", "-q", is_flag=True, help="Print problems only.")
@storage_flags()
def verify(dest: str, decode: bool, quiet: bool, endpoint_url: str | None, region: str | None,
           profile: str | None) -> None:
    """Check DEST against its manifest: checksums, counts, tar members, token ids, index. Exit 1 on any problem.

    DEST is a folder or s3://bucket/prefix (each object is downloaded and checked, one shard at a time)."""
    from fastio.progress import count
    from fastio.report.verify import verify as run_verify

    report = run_verify(dest, decode=decode, storage_options=storage_options(endpoint_url, region, profile))
    for problem in report.problems:
        click.echo(problem.line())
    if report.problems:
        click.echo(f"fastio: verify: {count(len(report.problems), 'problem')} in {dest}", err=True)
        raise click.exceptions.Exit(1)
    if not quiet:
        decoded = f", {report.decoded_line()}" if decode else ""
        click.echo(f"ok: {dest}: {count(report.shards, 'shard')}, {count(report.samples, 'sample')} verified{decoded}")


@cli.command()
@click.argument("dest")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--max-images", type=click.IntRange(min=0), default=1000, show_default=True,
              help="Probe the headers of at most this many images for size statistics.")
@click.option("--order", is_flag=True,
              help="Also rate the Loader's epoch order per shuffle mode: class mixing per batch against "
                   "a uniform shuffle, and the mean displacement of samples from their stored position.")
@click.option("--seed", type=int, default=0, show_default=True, help="Loader seed for --order (a mixture file: its order).")
@click.option("--epoch", type=click.IntRange(min=0), default=0, show_default=True,
              help="Epoch for --order (a mixture file: its order).")
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True,
              help="Global batch size for --order (capped at the dataset size; a mixture file: its order).")
@click.option("--seq-len", type=click.IntRange(min=1), default=2048, show_default=True,
              help="A token dataset's --order: sequences of this many tokens (+1), packed as fastio.Tokens does "
                   "(concat: sequences and tail; best-fit and first-fit: padding). A mixture file of token "
                   "datasets: its order in concat sequences of this length.")
@click.option("--skipped", "list_skipped", is_flag=True,
              help="List every input the conversion or index left out, with its reason (and nothing else).")
@storage_flags(cache=True)
def inspect(dest: str, as_json: bool, max_images: int, order: bool, seed: int, epoch: int,
            batch_size: int, seq_len: int, list_skipped: bool, endpoint_url: str | None, region: str | None,
            profile: str | None, cache_dir: Path | None, cache_size: str | None) -> None:
    """Describe DEST: samples, shards, bytes, fields, classes with counts, image sizes (and, with
    --order, how well each shuffle mode of the Loader mixes the data). A token dataset: documents and tokens
    (with --order, its packing into --seq-len sequences). A --split DEST: each split.
    DEST is a folder or s3://bucket/prefix (shards are read through the node-local cache)."""
    from fastio.report.inspect import inspect as run_inspect

    mixture = _mixture_file(dest)  # a mixture file (docs/mixtures.md)
    _check_size(cache_size, "cache_size")
    warn_idle_flags(click.get_current_context(), _inspect_idle(click.get_current_context(), mixture))
    if mixture:
        _inspect_mixture(dest, as_json, seed, epoch, batch_size, seq_len, cache_dir, cache_size,
                         storage_options(endpoint_url, region, profile))
        return
    try:
        if _skipped_only(click.get_current_context()):  # the report's flags ignored: not computed, nor refused
            order, max_images = False, 0
        info = run_inspect(dest, max_images=max_images, order=order, seed=seed, epoch=epoch, batch_size=batch_size,
                           cache_dir=cache_dir, cache_size=cache_size, seq_len=seq_len,
                           storage_options=storage_options(endpoint_url, region, profile))
    except ValueError as err:
        raise FastioError(_in_flags(str(err), leading=True)) from None
    first = next(iter(info["splits"].values())) if "splits" in info else info  # the splits are of one kind
    warn_idle_flags(click.get_current_context(), _kind_idle(click.get_current_context(), "tokens" in first))
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    show = _print_skipped if list_skipped else _print_info
    if "splits" in info:
        for name, sub in info["splits"].items():
            click.echo(f"[{name}]")
            show(sub)
    else:
        show(info)


def _inspect_idle(ctx: click.Context, mixture: bool) -> dict[str, str]:
    """:func:`~fastio.cli.group.warn_idle_flags`' flags of ``fastio inspect`` (the report is the same without them):
    a dataset's ``--order`` options without ``--order``, the cache flags with a local DEST, ``--skipped`` with
    ``--json`` (the report holds every skipped input), the report's flags with ``--skipped`` alone (it prints
    nothing else); a ``mixture`` file's report is an order report (it reads
    the ``--order`` options without it, and the cache flags for its sources) that probes no image and lists no
    skipped input."""
    idle = {"list_skipped": "without --json (its report lists them in skipped_inputs)"} if ctx.params["as_json"] else {}
    if mixture:
        return {**idle, **{name: "with a dataset DEST (not a mixture file)" for name in ("max_images", "list_skipped")}}
    if not ctx.params["order"]:
        idle.update({name: "with --order" for name in ("seed", "epoch", "batch_size", "seq_len")})
    if not _remote(ctx.params["dest"]):
        idle.update({name: "with an s3:// DEST (a local one is read where it is)" for name in ("cache_dir", "cache_size")})
    if _skipped_only(ctx):
        idle.update({name: "without --skipped (it lists the skipped inputs alone)" for name in _REPORT_FLAGS})
    return idle


_REPORT_FLAGS = ("max_images", "order", "seed", "epoch", "batch_size", "seq_len")
"""The flags of ``fastio inspect``'s report, which ``--skipped`` (without ``--json``) does not print."""


def _skipped_only(ctx: click.Context) -> bool:
    """Whether ``fastio inspect`` prints the skipped inputs alone (``--skipped`` without ``--json``)."""
    return ctx.params["list_skipped"] and not ctx.params["as_json"]


def _kind_idle(ctx: click.Context, tokens: bool, mixture: bool = False) -> dict[str, str]:
    """The flags of ``fastio inspect`` that the kind of DEST (known once it is open) does not read, for
    :func:`~fastio.cli.group.warn_idle_flags`: a token dataset's ``--order`` is its packing (``--seq-len`` alone)
    and it has no images; a dataset (or ``mixture`` file) of samples has no packing. The ``--order`` options
    without ``--order`` are :func:`_inspect_idle`'s (said once)."""
    ordered = ctx.params["order"] or mixture
    if _skipped_only(ctx) and not mixture:  # said by _inspect_idle
        return {}
    if tokens:
        idle = {} if mixture else {"max_images": "with a dataset of samples (a token dataset has no images)"}
        if ordered and not mixture:
            idle.update({name: "with a dataset of samples (a token dataset's --order is its packing into --seq-len)"
                         for name in ("seed", "epoch", "batch_size")})
        return idle
    return {"seq_len": "with a token dataset (or a mixture file of them)"} if ordered else {}


def _check_size(value: str | None, field: str) -> None:
    """FastioError in the command's words (``--cache-size: cannot read 'lots' as a size ...``) unless ``value`` is
    a size (or not given), whether or not the command goes on to read it."""
    from fastio.progress import parse_size

    try:
        if value is not None:
            parse_size(value, field)
    except ValueError as err:
        raise FastioError(_in_flags(str(err), leading=True)) from None


def _print_packing(p: dict[str, Any] | None) -> None:
    from fastio.progress import count

    if p:
        c = p["concat"]
        click.echo(f"packing:  seq_len {p['seq_len']}, window {count(p['window'], 'document')}: concat "
                   f"{count(c['sequences'], 'sequence')} ({count(c['tail_tokens'], 'token')} of tail left out); "
                   f"best-fit {p['best-fit']['sequences']} "
                   f"(padding {p['best-fit']['padding_fraction']:.1%}), first-fit {p['first-fit']['sequences']} "
                   f"(padding {p['first-fit']['padding_fraction']:.1%})")


def _recorded(reason: str) -> str:
    """A skip reason as the manifest records it (config fields: ``(max_pixels)``) in :func:`convert`'s flags
    (``(--max-pixels)``), as the conversion printed it; the options a ``fastio index`` reason names
    (``video_decoder='cpu'``) are flags of both commands."""
    return _in_flags(reason, command=convert)


def _print_skipped(info: dict[str, Any]) -> None:
    for s in info["skipped_inputs"]:
        click.echo(one_line(f"{s.get('path')}: {_recorded(str(s.get('reason')))}"))
    if not info["skipped_inputs"]:
        click.echo(f"{info['path']}: nothing was skipped")


def _inspect_mixture(path: str, as_json: bool, seed: int, epoch: int, batch_size: int, seq_len: int,
                     cache_dir: Path | None, cache_size: str | None, options: dict | None) -> None:
    from fastio.progress import count
    from fastio.read.mixture import Mixture
    from fastio.report.mix_order import mixture_order_report

    try:
        mixture = Mixture.from_file(path, cache_dir=cache_dir, cache_size=cache_size, storage_options=options)
        info = mixture_order_report(mixture, seed=seed, epoch=epoch, batch_size=batch_size, seq_len=seq_len)
    except ValueError as err:
        raise FastioError(_in_flags(str(err), leading=True)) from None
    ctx = click.get_current_context()
    warn_idle_flags(ctx, _kind_idle(ctx, info["unit"] == "sequences", mixture=True))
    if as_json:
        click.echo(json.dumps(info, indent=2, sort_keys=True))
        return
    click.echo(f"mixture:  {path}: {count(len(info['sources']), 'source')}, "
               f"{count(info['samples_per_epoch'], info['unit_singular'], info['unit'])} per epoch")
    for s in info["sources"]:
        click.echo(f"  {s['name']:<12} share {s['share']:.4f}  {s['per_epoch']} per epoch of {s['samples']} "
                   f"({s['cycles']:.2f} cycles)  {s['path']}")
    click.echo(f"order:    epochs {info['epoch']}..{info['epoch'] + info['epochs'] - 1}, "
               f"{count(info['batches'], 'batch', 'batches')} of {info['batch_size']} (seed {info['seed']})")
    for name, b in info["per_batch"].items():
        r = info["repeat_distance"][name]
        again = f"repeats after >= {r['min']} (median {r['median']:g}) positions" if r["repeats"] else "no repeat"
        expected = f"expected {b['expected']:g}, " if b["expected"] is not None else ""
        click.echo(f"  {name:<12} per batch {b['min']}..{b['max']} ({expected}max deviation "
                   f"{b['max_deviation']:g}); {again}")
    if len(info["phases"]) > 1 or info["phases"][0]["position"]:
        for p in info["phases"]:
            shares = ", ".join(f"{k} {w:.4f}" for k, w in p["shares"].items())
            click.echo(f"phase:    from position {p['position']}: {shares}; "
                       f"{count(p['batches'], 'batch', 'batches')} wholly inside")
            for name, b in p["per_batch"].items():
                if b["min"] is not None:
                    click.echo(f"  {name:<12} per batch {b['min']}..{b['max']} (expected {b['expected']:g}, max "
                               f"deviation {b['max_deviation']:g})")


def _vocabulary(tokens: dict[str, Any]) -> str:
    """A token or image-text dataset's vocabulary as ``fastio inspect`` prints it: its size, and the largest id
    where recorded."""
    largest = "" if tokens.get("max_id") is None else f", largest id {tokens['max_id']}"
    return f"{tokens.get('vocab_size') or 'not recorded'}{largest}"


def _tokenizer(tokens: dict[str, Any]) -> str:
    """``; tokenizer sha256 HEX`` (its first 12 digits: what a Mixture compares) where a token or image-text dataset
    records the checksum of its tokenizer file, else nothing."""
    sha = tokens.get("tokenizer_sha256")
    return "" if sha is None else f"; tokenizer sha256 {sha[:12]}"


def _print_image_text(info: dict[str, Any] | None) -> None:
    """An image-text dataset's vocabulary line, with the rows a model's token embedding needs."""
    if info is None:
        return
    rows = "" if info["embedding_size"] is None else f"; a token embedding of {info['embedding_size']} rows"
    click.echo(f"text:     vocabulary: {_vocabulary(info)}{rows}{_tokenizer(info)}")


def _print_info(info: dict[str, Any]) -> None:
    from fastio.progress import count, human_bytes, skipped_lines

    src = info.get("source") or {}
    click.echo(f"dataset:  {info['path']} (fingerprint {info['fingerprint']})")
    if src:
        click.echo(f"source:   {src.get('format')} {src.get('path')}")
    click.echo(f"samples:  {count(info['samples'], 'sample')} in {count(info['shards'], 'shard')}, "
               f"{human_bytes(info['bytes'])} of shard files (skipped at conversion: {info['skipped']})"
               + skipped_lines(info["skipped_inputs"], f"fastio inspect {info['path']} --skipped", words=_recorded))
    tokens = info.get("tokens")
    if tokens:
        d = tokens["per_document"] or {"min": 0, "median": 0, "max": 0}
        total = count(tokens["total_tokens"], f"{tokens['dtype']} token")
        click.echo(f"tokens:   {count(info['samples'], 'document')}, {total} "
                   f"(end of document: id {tokens['eos_id']}; vocabulary: {_vocabulary(tokens)}{_tokenizer(tokens)}); "
                   f"tokens per document min {d['min']}  median {d['median']}  max {d['max']}")
        chat = tokens.get("chat")
        if chat:
            click.echo(f"chat:     conversations, {count(chat['trained_tokens'], 'token')} trained "
                       f"({100 * chat['trained_tokens'] / max(tokens['total_tokens'], 1):.1f}%, "
                       f"train_on {chat['train_on']}); the longest {count(chat['longest'], 'token')}: seq_len at least "
                       f"{max(chat['longest'] - 1, 1)} with packing='best-fit'")
        _print_packing(info.get("packing"))
        return
    click.echo("fields:   " + ", ".join(f"{f} ({n})" for f, n in info["fields"].items()))
    _print_image_text(info.get("image_text"))
    if info.get("videos"):
        click.echo("videos:   " + ", ".join(f"{v['codec']} {v['count']}" + ("" if v["cpu"] else " (NVDEC on a GPU, "
                                                                             "PyAV on a CPU)") for v in info["videos"]))
    if info.get("classes"):
        click.echo(f"classes:  {len(info['classes'])}")
        named = any(c["name"] for c in info["classes"])  # indexed shards have labels without names
        for c in info["classes"]:
            click.echo(f"  {c['label']:>6}  {c['name'] or '':<24} {c['count']}" if named
                       else f"  {c['label']:>6}  {c['count']}")
    sizes = info.get("image_sizes")
    if sizes and sizes["width"]:
        w, h, b = sizes["width"], sizes["height"], sizes["bytes"]
        unreadable = f", {sizes['unreadable']} unreadable" if sizes["unreadable"] else ""
        formats = ", ".join(f"{f} {n}" for f, n in info.get("image_formats", {}).items())
        click.echo(f"images:   {formats or 'field ' + sizes['field']}; {sizes['probed']} probed{unreadable}")
        click.echo(f"  width (px)         min {w['min']}  median {w['median']}  mean {w['mean']}  max {w['max']}")
        click.echo(f"  height (px)        min {h['min']}  median {h['median']}  mean {h['mean']}  max {h['max']}")
        click.echo(f"  bytes per image    min {b['min']}  median {b['median']}  mean {b['mean']}  max {b['max']}")
    for q in info.get("order", []):
        click.echo(f"order:    {q['mode']:<6} batch {q['batch_size']}: classes per batch {q['class_mixing']:.2f}"
                   f" (uniform {q['class_mixing_ideal']:.2f}, ratio {q['class_mixing_ratio']:.2f}),"
                   f" mean displacement {q['mean_displacement']:.3f} (uniform {q['mean_displacement_ideal']:.3f})")


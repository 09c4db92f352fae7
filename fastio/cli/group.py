"""The ``fastio`` click group that every subcommand module registers on (its own module, so that the
subcommand modules and :func:`fastio.cli.main` import it without importing each other), the object-store
flags that several subcommands share, and the one rule for a flag given where it changes nothing
(:func:`warn_idle_flags`)."""

from __future__ import annotations

from pathlib import Path

import click

from fastio import __version__

__all__ = ["FullHelpGroup", "cli", "long_flag", "storage_flags", "storage_options", "warn_idle_flags"]


class FullHelpGroup(click.Group):
    """A group whose ``--help`` lists each command with its whole first sentence (wrapped), where click would
    cut it at the terminal's width with "..."; its subgroups are of this class too."""

    group_class = type  # click: subgroups made with @group.group() are FullHelpGroups

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=FullHelpGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fastio")
def cli() -> None:
    """fastio: pack datasets into WebDataset shards, load them through DALI, checkpoint and resume."""


def storage_flags(cache: bool = False):
    """``--endpoint-url``, ``--region``, ``--profile`` (and with ``cache``, ``--cache-dir``, ``--cache-size``)
    for an argument that is an ``s3://`` URL; they become ``storage_options`` (and the cache parameters)."""
    def wrap(fn):
        flags = [
            click.option("--endpoint-url", default=None, metavar="URL",
                         help="s3:// URLs: S3-compatible endpoint (default: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, "
                              "the profile, AWS)."),
            click.option("--region", default=None,
                         help="s3:// URLs: region (default: AWS_REGION or AWS_DEFAULT_REGION, the profile, us-east-1)."),
            click.option("--profile", default=None, help="s3:// URLs: AWS profile (default: AWS_PROFILE, else default)."),
        ]
        if cache:
            flags += [
                click.option("--cache-dir", default=None, type=click.Path(path_type=Path),
                             help="s3:// DEST: node-local shard cache (default: $FASTIO_CACHE_DIR, else "
                                  "$XDG_CACHE_HOME/fastio, else ~/.cache/fastio)."),
                click.option("--cache-size", default=None,
                             help="s3:// DEST: cache bound, e.g. 500GB (default: half the free space)."),
            ]
        for flag in reversed(flags):
            fn = flag(fn)
        return fn
    return wrap


def storage_options(endpoint_url: str | None, region: str | None, profile: str | None) -> dict[str, str]:
    """The flags of :func:`storage_flags` that were given, as ``storage_options``."""
    given = {"endpoint": endpoint_url, "region": region, "profile": profile}
    return {k: v for k, v in given.items() if v is not None}


def long_flag(ctx: click.Context, name: str) -> str:
    """The long flag of parameter ``name`` as the user types it (``fmt`` -> ``--format``)."""
    option = next(p for p in ctx.command.params if p.name == name)
    return next(opt for opt in option.opts if opt.startswith("--"))


def warn_idle_flags(ctx: click.Context, idle: dict[str, str]) -> None:
    """``warning: FLAG: read only WHEN; ignored`` on stderr for each parameter of ``idle`` (name -> WHEN, e.g.
    ``with --order``) given on the command line: a flag that changes nothing here, said so that the user does not
    believe it applied; a warning, not a refusal (the command does what it does without the flag)."""
    for name, when in idle.items():
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            click.echo(f"warning: {long_flag(ctx, name)}: read only {when}; ignored", err=True)

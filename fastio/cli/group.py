"""The ``fastio`` click group that every subcommand module registers on (its own module, so that the
subcommand modules and :func:`fastio.cli.main` import it without importing each other), and the object-store
flags that several subcommands share."""

from __future__ import annotations

from pathlib import Path

import click

from fastio import __version__

__all__ = ["FullHelpGroup", "cli", "storage_flags", "storage_options"]


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

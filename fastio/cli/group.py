"""The ``fastio`` click group that every subcommand module registers on (its own module, so that the
subcommand modules and :func:`fastio.cli.main` import it without importing each other)."""

from __future__ import annotations

import click

from fastio import __version__

__all__ = ["cli"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fastio")
def cli() -> None:
    """fastio: pack datasets into WebDataset shards, load them through DALI, checkpoint and resume."""

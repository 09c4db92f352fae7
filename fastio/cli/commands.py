"""Imports every subcommand module so that each registers itself on the ``cli`` group."""

from fastio.cli import ckpt_commands, dataset_commands  # noqa: F401

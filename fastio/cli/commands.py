"""Imports every subcommand module so that each registers itself on the ``cli`` group."""

# Each module below defines its commands with ``@cli.command(...)``.

"""Imports every subcommand module so that each registers itself on the ``cli`` group (:mod:`fastio.cli.group`)."""

import fastio.cli.ckpt_commands  # noqa: F401
import fastio.cli.dataset_commands  # noqa: F401

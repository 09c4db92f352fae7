"""The ``fastio`` command: parse options, call one library function, print.

Every :class:`~fastio.errors.FastioError` becomes one line on stderr (a control character of a name in it escaped) and
exit code 2. A command group
given no command (``fastio``, ``fastio ckpt``) prints its help on stdout and exits 0, as ``pip`` does:
asking for nothing is not an error.
"""

from __future__ import annotations

import os
import sys

import click

from fastio.cli.group import cli
from fastio.errors import FastioError
from fastio.words import one_line

__all__ = ["cli", "entry", "main"]

# click >= 8.2 raises this for a group called without a command; older click prints the help and exits 0.
_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _register() -> None:
    from fastio.cli import commands  # noqa: F401  (subcommand modules attach themselves to `cli`)


def entry() -> int:
    """The ``fastio`` command's own process (the console script, ``python -m fastio.cli``): no BLAS thread pool
    (numpy's OpenBLAS starts one a CPU at import, and no command multiplies matrices; ``OPENBLAS_NUM_THREADS`` set to 1
    unless it is set), so the process stays single-threaded and its convert workers can be forks of it
    (:mod:`fastio.convert.workers`); stdout escapes what its encoding cannot write (a lone surrogate in a name it
    prints: a JSON ``\\ud800`` escape, a file name that is not UTF-8), as stderr does, rather than failing after the
    work is done; then :func:`main`. (:func:`main` itself, called in a process of yours, changes nothing of its
    environment.)"""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    return main()


def main(argv: list[str] | None = None) -> int:
    _register()
    try:
        rc = cli.main(args=argv, prog_name="fastio", standalone_mode=False)
    except FastioError as err:
        click.echo(f"fastio: error: {one_line(str(err))}", err=True)  # a name holding a newline stays on the line
        return 2
    except click.exceptions.Abort:
        click.echo("fastio: aborted", err=True)
        return 130
    except _NO_ARGS as err:
        click.echo(err.ctx.get_help())
        return 0
    except click.exceptions.UsageError as err:
        hint = f" (see '{err.ctx.command_path} --help')" if err.ctx is not None else ""
        click.echo(f"fastio: error: {err.format_message()}{hint}", err=True)
        return 2
    except click.ClickException as err:
        click.echo(f"fastio: error: {err.format_message()}", err=True)
        return 2
    except click.exceptions.Exit as err:
        return err.exit_code
    except KeyboardInterrupt:
        click.echo("fastio: interrupted", err=True)
        return 130
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(entry())

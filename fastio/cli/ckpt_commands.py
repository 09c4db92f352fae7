"""``fastio ckpt ls`` and ``fastio ckpt verify``: inspect a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fastio.checkpoint import layout
from fastio.cli.group import cli
from fastio.progress import human_bytes

__all__ = ["ckpt"]


@cli.group()
def ckpt() -> None:
    """Inspect checkpoint directories written by fastio.Checkpointer."""


def _local_dir(directory: str) -> Path:
    """DIRECTORY as a local path; an object-store URL is refused by name (not read as a folder named ``s3:``)."""
    from fastio.errors import FastioError
    from fastio.storage import parse_location

    loc = parse_location(directory)
    if loc.remote:
        raise FastioError(f"{directory}: fastio ckpt reads local checkpoint directories; for an object store, "
                          "Checkpointer(url).steps() lists committed steps and restore_latest() fetches one")
    return loc.path


@ckpt.command("ls")
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
def ls_cmd(directory: str, as_json: bool) -> None:
    """List the checkpoints in DIRECTORY (either engine): step, engine (+zstd when compressed), size as stored,
    commit time, metrics."""
    directory = _local_dir(directory)
    rows = layout.list_checkpoints(directory)
    if as_json:
        click.echo(json.dumps({"dir": str(directory), "checkpoints": rows}, indent=1))
        return
    if not rows:
        click.echo(f"{directory}: no checkpoints")
        return
    click.echo(f"{'STEP':>10}  {'STATE':<11} {'ENGINE':<18} {'SIZE':>10}  {'COMMITTED (UTC)':<20}  METRICS")
    for r in rows:
        metrics = " ".join(f"{k}={v:.6g}" for k, v in sorted(r["metrics"].items()))
        state = "committed" if r["committed"] else "quarantined" if ".quarantined" in r["path"] else "incomplete"
        engine = (r["engine"] or "-") + (f"+{r['compression']}" if r.get("compression") else "")
        click.echo(f"{r['step']:>10}  {state:<11} {engine:<18} {human_bytes(r['bytes']):>10}  "
                   f"{r['time_utc'] or '-':<20}  {metrics}")


@ckpt.command("verify")
@click.argument("directory")
@click.option("--all", "include_uncommitted", is_flag=True,
              help="Also report step-N.tmp directories (writes in progress or interrupted).")
def verify_cmd(directory: str, include_uncommitted: bool) -> None:
    """Check every committed checkpoint in DIRECTORY (either engine) against its recorded checksums; exit 1 on a problem.

    A directory that is not a checkpoint directory is an error (exit 2)."""
    directory = _local_dir(directory)
    report = layout.verify_report(directory, include_uncommitted=include_uncommitted)
    if report.problems:
        for line in report.problems:
            click.echo(line)
        raise click.exceptions.Exit(1)
    click.echo(f"{directory}: {len(report.steps)} committed checkpoint(s) verified "
               f"({', '.join(f'step {s}' for s in report.steps) or 'none'})")

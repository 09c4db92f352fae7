"""``fastio ckpt ls`` and ``fastio ckpt verify``: inspect a checkpoint directory or ``s3://`` prefix."""

from __future__ import annotations

import json
import math

import click

from fastio.cli.group import cli, storage_flags, storage_options
from fastio.progress import count, human_bytes, table_lines
from fastio.words import agree

__all__ = ["ckpt"]


@cli.group()
def ckpt() -> None:
    """Inspect checkpoint directories (or s3:// prefixes) written by fastio.Checkpointer."""


@ckpt.command("ls")
@click.argument("directory")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of a table.")
@storage_flags()
def ls_cmd(directory: str, as_json: bool, endpoint_url: str | None, region: str | None, profile: str | None) -> None:
    """List the checkpoints in DIRECTORY, a directory or an s3:// prefix (either engine): step, state, engine
    (+ the codec when compressed: torchsnapshot+zstd, dcp+zstd+shuffle), size as stored, commit time, metrics;
    each column as wide as its widest cell."""
    from fastio.checkpoint.catalog import list_steps

    directory, rows = list_steps(directory, storage_options(endpoint_url, region, profile))
    if as_json:
        click.echo(json.dumps({"dir": directory, "checkpoints": [_json_row(r) for r in rows]}, indent=1))
        return
    if not rows:
        click.echo(f"{directory}: no checkpoints")
        return
    table = [["STEP", "STATE", "ENGINE", "SIZE", "COMMITTED (UTC)", "METRICS"]]
    for r in rows:
        engine = (r["engine"] or "-") + (f"+{r['compression']}" if r.get("compression") else "")
        table.append([str(r["step"]), r["state"], engine, human_bytes(r["bytes"]), r["time_utc"] or "-",
                      " ".join(f"{k}={v:.6g}" for k, v in sorted(r["metrics"].items()))])
    for line in table_lines(table, right=frozenset({0, 3})):
        click.echo(line.rstrip())


def _json_row(row: dict) -> dict:
    """``row`` with its non-finite metrics (NaN, inf: a save accepts them) as null, which strict JSON parsers read
    (Python's ``json`` would print ``NaN``/``Infinity``, which they refuse)."""
    metrics = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row["metrics"].items()}
    return {**row, "metrics": metrics}


@ckpt.command("verify")
@click.argument("directory")
@click.option("--all", "include_uncommitted", is_flag=True,
              help="Also report step-N.tmp directories (writes in progress or interrupted; on s3://, steps "
                   "without their commit marker).")
@storage_flags()
def verify_cmd(directory: str, include_uncommitted: bool, endpoint_url: str | None, region: str | None,
               profile: str | None) -> None:
    """Check every committed checkpoint in DIRECTORY, a directory or an s3:// prefix (either engine), against its
    recorded checksums; exit 1 on a problem. On s3:// each step is downloaded into a temporary directory first.

    Superseded steps (a rollback) are skipped, and so is a step that retention deletes while it is being checked
    ("being deleted"). A directory that is not a checkpoint directory is an error (exit 2)."""
    from fastio.checkpoint.catalog import verify_steps

    directory, report = verify_steps(directory, include_uncommitted=include_uncommitted,
                                     storage_options=storage_options(endpoint_url, region, profile))
    if report.problems:
        for line in report.problems:
            click.echo(line)
        raise click.exceptions.Exit(1)
    steps = agree(len(report.vanished), "step")
    gone = f"; skipped {steps} {', '.join(map(str, report.vanished))}: being deleted" if report.vanished else ""
    click.echo(f"{directory}: {count(len(report.steps), 'committed checkpoint')} verified "
               f"({', '.join(f'step {s}' for s in report.steps) or 'none'}){gone}")

"""The interface between the Checkpointer and a checkpoint engine (the library that writes the files).

The Checkpointer owns everything around one ``step-N`` directory: staging a private copy of the state,
scheduling, the commit marker and atomic publish, retention, verification, the elastic-resume rule and
the RNG record. An engine owns the files inside the directory: how state dicts become
files, which ranks write what, and how a rank reads its state back. It is the only code that imports
its library (torchsnapshot, torch.distributed.checkpoint) or touches that library's internals.

State is addressed by app key (``"model"``, ``"optim"``, ...); inside a key, engines name leaves by
``key/sub/path`` (the ``replicated`` globs use that form). Every method that says *collective* must be
called by all ranks of ``pg`` together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["RESERVED_PREFIX", "WRITE_CHECKSUM", "Engine", "SavedCheckpoint", "Stateful", "first_line", "written_record"]

RESERVED_PREFIX = "_fastio"
"""App keys the Checkpointer keeps for itself (the RNG streams; older checkpoints' ``_fastio_progress``): it refuses
an app's key starting with it, so an engine may also name files of its own with it where app keys name theirs."""

WRITE_CHECKSUM = "xxh3_128"
"""The checksum an engine takes of each file from the bytes it writes (:meth:`Engine.save`'s records): the commit's,
so that the commit need not read the file back."""


def written_record(data: Any, size: int | None = None, digest: str | None = None) -> dict[str, Any]:
    """What :meth:`Engine.save` returns for one file: ``{"bytes": size, "xxh3_128": digest}`` of the bytes-like
    ``data`` it wrote (or of the ``size`` and ``digest`` already taken)."""
    if data is not None:
        from fastio.storage.checksum import digest_bytes

        size, digest = digest_bytes(data, WRITE_CHECKSUM)
    return {"bytes": size, WRITE_CHECKSUM: digest}


def first_line(err: BaseException) -> str:
    """One line for an engine's (or the disk's) error: the last unindented line of its text, where
    torchsnapshot and torch put the cause, or ``Type: text`` when the text is one line."""
    text = str(err).strip()
    for line in reversed(text.splitlines()):
        if line.strip() and not line.startswith(" "):
            return f"{type(err).__name__}: {line.strip()}" if line is text else line.strip()
    return type(err).__name__


@runtime_checkable
class Stateful(Protocol):
    """What an engine saves and restores: an object with ``state_dict`` and ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class SavedCheckpoint(Protocol):
    """One written checkpoint, opened for reading by :meth:`Engine.open`."""

    path: Path
    """The step directory."""

    world_size: int
    """How many ranks wrote it (as the engine recorded it)."""

    def keys(self, rank: int) -> set[str]:
        """App keys whose state saving rank ``rank`` can read back: its own and the replicated ones."""
        ...

    def is_replicated(self, key: str, rank: int) -> bool:
        """True when every leaf of ``key`` that saving rank ``rank`` sees was written as replicated
        (identical on every rank, so any rank of any world size may restore it)."""
        ...

    def restore(self, targets: dict[str, Stateful], *, strict: bool = True, cast: bool = False) -> list[str]:
        """Collective: load each target from this rank's saved state (its own rank's, or the replicated
        copy); each target's ``load_state_dict`` is called once. Raises what the engine raises. Modules are
        restored by the strict rule (:mod:`fastio.checkpoint.engines.strict`): ``strict`` refuses any
        difference with a CheckpointError naming the keys; otherwise returns what was skipped, one line each.
        ``cast``: a tensor of another dtype than the app's is cast (torch's copy), not a difference."""
        ...

    def shapes(self, key: str, rank: int) -> dict[str, tuple[int, ...] | None]:
        """The state keys saving rank ``rank`` wrote for ``key`` (a flat state dict, a module's), with the shape of
        each plain tensor (None for anything else), from the engine's metadata: no tensor is read."""
        ...

    def dtypes(self, key: str, rank: int) -> dict[str, str]:
        """The dtype (its name, ``torch.float32``) of each plain tensor saving rank ``rank`` wrote for ``key``, by the
        state keys :meth:`shapes` names, from the engine's metadata: no tensor is read."""
        ...

    def param_groups(self, key: str, rank: int) -> list[int] | None:
        """How many parameters each parameter group of the optimizer state saving rank ``rank`` wrote for
        ``key`` holds, without reading a tensor; None when that state has no ``param_groups`` (not an optimizer's)
        or is global state that the engine checks by its own rule (DCP)."""
        ...

    def group_settings(self, key: str, rank: int) -> list[set[str]] | None:
        """The setting names (``lr``, ``betas``, ...) of each parameter group of the optimizer state saving rank
        ``rank`` wrote for ``key``, without reading a tensor; None when that state shows no such groups or is global
        state that the engine checks by its own rule (DCP)."""
        ...

    def state_shapes(self, key: str, rank: int) -> dict[tuple[int, str], tuple[int, ...]]:
        """The shape of each tensor of the optimizer state saving rank ``rank`` wrote for ``key``, by (parameter
        position, state name) (``state/0/exp_avg``), without reading a tensor; empty when that state has none or
        is global state that the engine checks by its own rule (DCP)."""
        ...

    def read(self, key: str, rank: int) -> Any:
        """The state dict that saving rank ``rank`` wrote for ``key``, rebuilt as it was saved (nested
        dicts, lists, tuples); not collective. :class:`~fastio.errors.CheckpointError` naming the key
        when it cannot be read."""
        ...


class Engine(Protocol):
    """A checkpoint engine; :func:`fastio.checkpoint.engines.get_engine` returns one by name."""

    name: str
    """The registry name, recorded in every commit marker so a restore uses the engine that wrote it."""

    def prepare(self, app: dict[str, Any]) -> tuple[dict[str, Stateful], frozenset[str]]:
        """The app objects as this engine saves and restores them (an engine may wrap a module or an
        optimizer in an adapter), and the keys of *global* state: one logical state across ranks
        (sharded or identical), which the engine may write once and reshard. Others are per rank."""
        ...

    def refusal(self, tensor: Any) -> str | None:
        """Why this engine cannot write ``tensor`` (a dtype or layout its format has no place for), in words that
        follow its key path; None when it can. Asked of every tensor while a save stages, before anything is
        written."""
        ...

    def placements(self) -> dict[int, int] | None:
        """How the staged buffers of a save written ``direct`` should lie in memory (asked before each such save's
        staging, :meth:`fastio.checkpoint.staging.Stager.stage`): None when the engine's writes gain nothing from
        it (buffers as torch allocates them); else a mapping, from an address in a buffer the last save wrote to how
        far past a page boundary it should have been (its offset in its file, modulo
        :data:`~fastio.storage.direct.ALIGN`), empty when every buffer was as its file needs or none was written
        (buffers then start at page boundaries)."""
        ...

    def placeable(self, tensor: Any) -> bool:
        """Whether a save written ``direct`` writes ``tensor``'s staged buffer from its own bytes (then the Stager
        may place it, :meth:`placements`): not where the engine serialises the buffer's whole storage (``torch.save``),
        which for a placed buffer, a view into a larger allocation, would write bytes that are no part of it."""
        ...

    def save(self, path: Path, states: dict[str, dict[str, Any]], *, pg: Any = None,
             replicated: Sequence[str] = (), global_keys: Sequence[str] = (),
             writeback: bool = True, direct: bool = False) -> dict[str, dict[str, Any]] | None:
        """Collective: write ``states`` (app key -> a private, already staged state dict) into the
        existing directory ``path``. ``replicated``: globs over ``key/sub/path`` of state identical on
        every rank (written once). ``global_keys``: what :meth:`prepare` said is global. Runs on the
        Checkpointer's writer thread; must leave no process-wide setting changed when it returns or
        raises. The Checkpointer commits afterwards. May return the files this rank wrote, by path relative
        to ``path``, with their ``"bytes"`` and a checksum taken from the bytes written (``"xxh3_128"``): the
        commit then records those instead of reading the files back (None: it reads them all). ``writeback``:
        start each file's writeback to the disk as it is written (:func:`~fastio.storage.atomic.start_writeback`),
        so that the commit's fsyncs find it done; False when the files are replaced before the commit (compressed),
        whose bytes would go to the disk for nothing. ``direct``: write the data files past the page cache where the
        engine can (:mod:`fastio.storage.direct`; an engine that cannot writes as before)."""
        ...

    def reads(self, files: Sequence[str], saved_world: int, world: int) -> dict[str, int]:
        """Of a step's ``files`` (paths relative to it, written by ``saved_world`` ranks), those a restore on
        ``world`` ranks will have rank R read, as ``{file: R}``, as far as the engine can tell before the load
        plans anything: the restore's check then has R check them, kept in memory for its load (see
        :meth:`open`). A guess (only ever which rank checks what, and what is read twice); empty when none."""
        ...

    def open(self, path: Path, *, pg: Any = None, held: Mapping[str, Any] | None = None) -> SavedCheckpoint:
        """Open the checkpoint in ``path`` for reading; :class:`~fastio.errors.CheckpointError` naming
        ``path`` when the engine's own metadata is missing or unreadable. ``held``: files of ``path`` already
        read and checked, by path relative to it -> their bytes (a buffer), which the restore reads from there
        rather than from the file."""
        ...

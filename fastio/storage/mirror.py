"""Directories published under an object-store prefix, each one complete once its marker object exists.

``DirMirror(storage, marker)`` keeps ``PREFIX/NAME/...`` copies of local directories: :meth:`push` uploads
every file and the marker last (a reader that sees the marker sees every file), :meth:`remove` deletes the
marker first (the copy stops counting before its files go) and then only the keys under ``NAME/``,
:meth:`pull` downloads a complete copy into a temporary folder and renames it into place (the folder is removed
if the download fails). The checkpoint
layer uses it for ``step-N`` directories whose marker is the commit file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from fastio.errors import StorageError
from fastio.storage.atomic import fsync_dir
from fastio.storage.base import Storage

__all__ = ["DirMirror"]


class DirMirror:
    """Mirror of directories ``NAME`` under ``storage``'s root, complete when ``NAME/<marker>`` exists."""

    def __init__(self, storage: Storage, marker: str):
        self.storage, self.marker = storage, marker

    def names(self) -> list[str]:
        """Names of complete directories (with their marker), sorted."""
        return sorted({o.key.split("/")[0] for o in self.storage.list()
                       if o.key.count("/") == 1 and o.key.endswith("/" + self.marker)})

    def push(self, local: Path, name: str, before_marker: Callable[[], None] | None = None) -> None:
        """Upload ``local``'s files to ``NAME/``, the marker last, after calling ``before_marker`` (which may
        raise to leave the copy incomplete, i.e. invisible)."""
        if not (Path(local) / self.marker).is_file():
            raise StorageError(f"{local}: has no {self.marker}; only complete directories are published",
                               url=self.storage.url_of(name))
        self.storage.child(name).publish_dir(Path(local), keys_last=(self.marker,), before_last=before_marker)

    def pull(self, name: str, dest: Path) -> None:
        """Download complete ``NAME/`` into ``dest`` (through ``dest`` + ``.part``, renamed when whole)."""
        sub = self.storage.child(name)
        objects = sub.list()
        if not any(o.key == self.marker for o in objects):
            raise StorageError(f"{sub.url}: has no {self.marker} (incomplete upload, or being deleted)", url=sub.url,
                               missing=True)
        part = Path(str(dest) + ".part")
        shutil.rmtree(part, ignore_errors=True)
        try:
            for o in objects:
                target = part / o.key
                target.parent.mkdir(parents=True, exist_ok=True)
                sub.get_to_file(o.key, target, o.size)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)  # a partial download, of what the store keeps
            raise
        os.replace(part, dest)
        fsync_dir(Path(dest).parent)

    def remove(self, name: str, keys: Iterable[str] | None = None) -> None:
        """Delete ``NAME/``: its marker first, then its other objects (nothing outside ``NAME/``). ``keys``: the keys
        under ``NAME/`` when the caller has just listed them (no other writer adds any), else they are listed here."""
        sub = self.storage.child(name)
        keys = [o.key for o in sub.list()] if keys is None else list(keys)
        if self.marker in keys:
            sub.delete(self.marker)
        for key in keys:
            if key != self.marker:
                sub.delete(key)

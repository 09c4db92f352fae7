"""PEP 562 lazy exports: a package names its public API without importing torch or DALI up front."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: attribute ``name`` is imported from ``table[name]`` on first use;
    a name whose module is ``package.name`` is that subpackage itself (importing it binds the name to it anyway)."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if module == f"{package}.{name}":
            return importlib.import_module(module)
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__

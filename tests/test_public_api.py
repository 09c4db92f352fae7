"""The public API: every name in ``fastio.__all__`` resolves, importing fastio stays light, and the
package installs as ``fastio.*`` only (``converters/`` as ``fastio.converters``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself depends on there
    import tomli as tomllib

import fastio
import fastio.checkpoint


@pytest.mark.parametrize("package", [fastio, fastio.checkpoint])
def test_every_exported_name_resolves(package):
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018


def test_importing_fastio_and_the_cli_does_not_import_torch_or_dali():
    code = ("import sys, fastio, fastio.checkpoint, fastio.cli, fastio.cli.commands; "
            "print(sorted(m for m in ('torch', 'nvidia.dali', 'webdataset', 'lightning', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package_and_maps_converters():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "fastio").rglob("__init__.py")}
    assert set(setuptools["packages"]) == found | {"fastio.converters"}
    assert setuptools["package-dir"] == {"fastio.converters": "converters"}


def test_converters_import_as_fastio_converters_only(tmp_path):
    code = ("import importlib.util, fastio.converters as c; "
            "print(c.FORMATS, importlib.util.find_spec('converters') is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert out.strip() == "('imagefolder', 'csv', 'jsonl', 'parquet', 'files') True"

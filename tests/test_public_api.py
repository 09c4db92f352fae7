"""The public API: every name in ``fastio.__all__`` resolves, and importing fastio stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    code = ("import sys, fastio, fastio.checkpoint, fastio.cli; fastio.cli._register(); "
            "print(sorted(m for m in ('torch', 'nvidia.dali', 'webdataset') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

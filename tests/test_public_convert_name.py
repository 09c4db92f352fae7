"""``fastio.convert`` is one thing: the subpackage that holds ``convert`` and ``ConvertConfig`` (the documented
``from fastio.convert import ConvertConfig, convert``). It used to be exported lazily as the function
``fastio.convert.run.convert`` as well, so the first ``fastio.convert`` of a fresh interpreter was the function
(``fastio.convert.ConvertConfig``: AttributeError) and every later one, once the import had bound the subpackage,
the module."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBES = {  # what a fresh interpreter runs, and what it prints
    "attribute path on first use": ("import fastio; print(fastio.convert.ConvertConfig.__name__, "
                                    "fastio.convert.convert.__name__)", "ConvertConfig convert"),
    "the same object every time": ("import fastio, sys; a = fastio.convert; b = fastio.convert; "
                                   "print(a is b is sys.modules['fastio.convert'])", "True"),
    "from fastio import convert": ("from fastio import convert; import fastio.convert.run as run; "
                                   "print(convert.convert is run.convert, convert.ConvertConfig is run.ConvertConfig)",
                                   "True True"),
}


@pytest.mark.parametrize("code, printed", PROBES.values(), ids=PROBES)
def test_fastio_convert_is_the_subpackage_from_the_first_use(code, printed):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == printed

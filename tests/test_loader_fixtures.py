"""Batches and ``state_dict()`` bitwise equal to those recorded before the Loader's pipelines became objects and
its datasets and mixtures one read set (``tests/fixtures/loader_v2_batches.json``, made by
``tests/fixtures/make_loader_fixtures.py``): every built-in pipeline x shuffle mode x {dataset, mixture}."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_HERE = Path(__file__).with_name("fixtures")
_spec = importlib.util.spec_from_file_location("make_loader_fixtures", _HERE / "make_loader_fixtures.py")
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)
RECORDED = json.loads(fixtures.FIXTURE.read_text())


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return fixtures.make_datasets(tmp_path_factory.mktemp("loader-fixtures"))


def test_the_recording_is_of_the_datasets_and_options_the_script_makes():
    assert RECORDED["datasets"] == json.loads(json.dumps({k: list(v) for k, v in fixtures.DATASETS.items()}))
    assert RECORDED["mixture"] == fixtures.MIXTURE and RECORDED["loader"] == fixtures.LOADER
    assert sorted(RECORDED["cases"]) == sorted(fixtures.case_id(*c) for c in fixtures.cases())


@pytest.mark.parametrize("case", fixtures.cases(), ids=lambda c: fixtures.case_id(*c))
def test_the_pipeline_objects_deliver_the_recorded_batches_and_states(datasets, case):
    got = fixtures.run_case(case, datasets)
    want = RECORDED["cases"][fixtures.case_id(*case)]
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want)):
        assert g["batch"] == w["batch"], f"batch {n}"
        assert g["state"] == w["state"], f"state_dict() after batch {n}"

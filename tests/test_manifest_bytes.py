"""Manifests are written byte for byte as before the manifest became a typed object on the write side: convert
(folder, split, table, parts + merge), ``fastio index`` (in place, with DEST), token convert and token index,
against ``fixtures/manifest_bytes.json`` (recorded before the change by ``fixtures/make_manifest_fixtures.py``)."""

from __future__ import annotations

import json

from manifest_cases import FIXTURE, build

EXPECTED = json.loads(FIXTURE.read_text())


def test_every_kind_of_dataset_writes_the_recorded_manifest_bytes(tmp_path):
    tmp = tmp_path.resolve()
    written = build(tmp)
    assert sorted(written) == sorted(EXPECTED)
    for name, text in EXPECTED.items():
        assert written[name] == text, name

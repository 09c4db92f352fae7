"""Manifests are written byte for byte as before the manifest became a typed object on the write side: convert
(folder, split, table, parts + merge), ``fastio index`` (in place, with DEST), token convert and token index, and
image-text convert, against ``fixtures/manifest_bytes.json`` (recorded before the change by
``fixtures/make_manifest_fixtures.py``; the image-text case recorded since, the other cases' bytes unchanged but the
tokenizer file's sha256 that token and image-text conversions record since: ``tokens.tokenizer_sha256``,
``image_text.tokenizer_sha256``; the image-text samples' token counts, ``image_text.total_tokens`` and
``trained_tokens``; an index in place's ``source.idx_kept``, the ``.idx`` files it found and did not write; and the
special tokens an image-text template renders, ``image_text.template_variables``, which a merge of parts compares)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
from manifest_cases import FIXTURE, build

from fastio.dataset.manifest import MANIFEST_NAME, Manifest, load_manifest, make_manifest, write_manifest

EXPECTED = json.loads(FIXTURE.read_text())


def test_every_kind_of_dataset_writes_the_recorded_manifest_bytes(tmp_path):
    tmp = tmp_path.resolve()
    written = build(tmp)
    assert sorted(written) == sorted(EXPECTED)
    for name, text in EXPECTED.items():
        assert written[name] == text, name
@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.endswith(MANIFEST_NAME)))
def test_a_recorded_manifest_loads_and_writes_back_the_same_bytes(name, tmp_path):
    text = EXPECTED[name].replace("<TMP>", "/data").replace("<VERSION>", "0.1.0")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / MANIFEST_NAME).write_text(text)
    manifest = load_manifest(tmp_path / "a")
    assert manifest.format_version in (1, 2, 3)
    (tmp_path / "b").mkdir()
    write_manifest(tmp_path / "b", manifest)
    assert (tmp_path / "b" / MANIFEST_NAME).read_text() == text


def _recorded(name: str, tmp_path, **changes) -> Manifest:
    data = json.loads(EXPECTED[name].replace("<TMP>", "/data").replace("<VERSION>", "0.1.0"))
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not None}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    return load_manifest(tmp_path)


def test_the_manifest_is_read_by_its_fields_not_by_string_keys(tmp_path):
    manifest = _recorded("folder/manifest.json", tmp_path)
    assert not isinstance(manifest, Mapping) and not hasattr(manifest, "get") and not hasattr(manifest, "keys")
    with pytest.raises(TypeError):
        manifest["label_map"]
    assert manifest.label_map == {"circle": 0, "hstripes": 1, "square": 2} and manifest.label_rule == "names"
    with pytest.raises(ValueError, match="make_manifest: colour is not a manifest field"):
        make_manifest(name="x", shards=manifest.shards, fields=["jpg"], colour="red")


def test_a_manifest_of_the_first_format_without_the_keys_added_since_loads(tmp_path):
    manifest = _recorded("folder/manifest.json", tmp_path, total_bytes=None, index=None, fastio_version=None,
                         image_fields=None, skipped=None, label_rule=None)
    assert manifest.format_version == 1 and manifest.index is None and manifest.skipped is None
    assert manifest.total_bytes == sum(s.bytes for s in manifest.shards) > 0

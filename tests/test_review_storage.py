"""Review of StorageOptions (issue 19.2's deadline_s among them) as a config file gives them: a number written
as text ("120") or a bool is a ValueError naming the option when the options are made, not a TypeError from a
comparison inside the dataclass (or later, inside a retry loop)."""

from __future__ import annotations

import pytest

from fastio import Dataset
from fastio.storage.options import StorageOptions


@pytest.mark.parametrize("kw,match", [({"deadline_s": "120"}, r"deadline_s must be a number, got '120'"),
                                      ({"retries": 2.5}, r"retries must be None \(until deadline_s\) or an integer >= 0, "
                                                         r"got 2\.5"),
                                      ({"part_size": "16MB"}, r"part_size must be an integer, got '16MB'"),
                                      ({"concurrency": True}, r"concurrency must be an integer, got True")])
def test_a_number_of_the_wrong_type_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        StorageOptions(**kw)
    with pytest.raises(ValueError, match=match):  # as a user passes them
        Dataset("s3://some-bucket/ds", storage_options={"endpoint": "http://127.0.0.1:9", **kw})
    assert StorageOptions(deadline_s=30, retries=3).deadline_s == 30

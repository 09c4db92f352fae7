"""Summary lines count in the singular for one ("1 shard", not "1 shards": one plural rule,
:func:`fastio.words.count`), ``fastio ckpt ls`` sizes its columns to their widest cell (an engine
``torchsnapshot+zstd+shuffle`` pushed the later columns out of line), and a closed Loader's refusal names the
method called (``check_state_dict`` said ``load_state_dict``). Found beside them: a summary's "1 classes",
"a audio clip pipeline" in the refusal of samples without audio, "1 video in codec h264 are decoded" in the
PyAV fallback's line, and a folder named ``dest`` turned into ``--dest`` at the start of a message."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from helpers import run_cli

import fastio
from fastio.errors import LoaderClosedError


def test_merge_and_verify_of_one_part_and_one_shard_say_it_in_the_singular(image_folder, tmp_path, capsys):
    one, parts = tmp_path / "one" / "cat", tmp_path / "parts"
    one.mkdir(parents=True)
    shutil.copy(next(image_folder.rglob("*.jpg")), one / "a.jpg")
    assert run_cli(["convert", str(one.parent), str(parts), "--part", "0/1", "--workers", "1", "-q"],
                   capsys)[0] == 0
    code, out, err = run_cli(["merge", str(parts)], capsys)
    assert code == 0, err
    line = (out + err).strip().splitlines()[-1]
    assert "merged 1 part into" in line and ": 1 sample in 1 shard (" in line, line
    code, out, err = run_cli(["verify", str(parts)], capsys)
    assert code == 0 and f"ok: {parts}: 1 shard, 1 sample verified" in out, out + err


def test_ckpt_ls_columns_are_as_wide_as_their_widest_cell(tmp_path, capsys):
    for step, compression in ((1, None), (20, "zstd+shuffle")):
        with fastio.Checkpointer(tmp_path, signals=(), engine="torchsnapshot", compression=compression) as ckpt:
            ckpt.save(step, {"model": torch.nn.Linear(2, 2)}, blocking=True, metrics={"loss": 0.5})
    code, out, err = run_cli(["ckpt", "ls", str(tmp_path)], capsys)
    assert code == 0, err
    header, *rows = out.splitlines()
    assert len(rows) == 2 and "torchsnapshot+zstd+shuffle" in rows[1], out
    for row in rows:  # each column starts where its header does, whatever the engine's name
        assert row.index("committed") == header.index("STATE"), out
        assert row.index("torchsnapshot") == header.index("ENGINE"), out
        assert re.search(r"\d{4}-\d\d-\d\dT", row).start() == header.index("COMMITTED"), out
        assert row.index("loss=") == header.index("METRICS"), out
        assert row.index(" kB") + len(" kB") == header.index("SIZE") + len("SIZE"), out  # sizes right-aligned


def test_check_state_dict_on_a_closed_loader_names_check_state_dict(image_dataset):
    loader = fastio.Loader(image_dataset, batch_size=4, device="cpu", num_threads=1)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(LoaderClosedError, match="check_state_dict on a closed"):
        loader.check_state_dict(state)
    with pytest.raises(LoaderClosedError, match="load_state_dict on a closed"):
        loader.load_state_dict(state)


def test_convert_of_one_class_says_1_class(image_folder, tmp_path, capsys):
    one = tmp_path / "one" / "cat"
    one.mkdir(parents=True)
    shutil.copy(next(image_folder.rglob("*.jpg")), one / "a.jpg")
    code, out, err = run_cli(["convert", str(one.parent), str(tmp_path / "ds"), "--workers", "1"], capsys)
    assert code == 0, err
    assert "converted 1 sample (" in out and "labels: names (1 class, labels are" in out, out


def test_a_clip_pipeline_over_samples_without_its_kind_names_them_in_good_english(tmp_path):
    from fastio.convert import ConvertConfig, convert
    from fastio.convert.synthetic import make_audio, make_video

    make_audio(tmp_path / "m" / "x" / "a.wav", seconds=0.3)
    make_video(tmp_path / "m" / "x" / "b.webm", frames=4, fps=8)
    convert(ConvertConfig(source=tmp_path / "m", dest=tmp_path / "ds", progress=False))
    with pytest.raises(fastio.DatasetError) as err:
        fastio.Loader(tmp_path / "ds", pipeline=fastio.AudioClips(sample_rate=16000, seconds=0.2), batch_size=2,
                      device="cpu")
    assert "1 of 2 samples has no audio field" in str(err.value) and "an audio clip pipeline" in str(err.value)


def test_the_pyav_fallback_line_of_one_video_says_is(tmp_path, caplog):
    from fastio.convert import ConvertConfig, convert
    from fastio.convert.synthetic import make_video

    make_video(tmp_path / "v" / "x" / "a.mp4", frames=4, fps=8)
    convert(ConvertConfig(source=tmp_path / "v", dest=tmp_path / "ds", progress=False))
    with caplog.at_level("WARNING", logger="fastio"):
        fastio.Loader(tmp_path / "ds", pipeline=fastio.VideoClips(frames=2, size=16), batch_size=1, device="cpu").close()
    said = [r.getMessage() for r in caplog.records if "decoded on the CPU" in r.getMessage()]
    assert said == [f"{tmp_path / 'ds'}: 1 video in codec h264 is decoded on the CPU with PyAV (DALI's CPU decoder "
                    "does not read h264; a Loader on a GPU decodes it with NVDEC)"], said


def test_a_path_named_like_a_flag_stays_a_path_in_the_message(tmp_path, monkeypatch, capsys):
    """``fastio index shards --dest dest`` into a folder that is not fastio output said ``--dest: DEST is not
    empty``: the folder's name, leading the message, was taken for the config field ``dest`` and made a flag."""
    import io
    import tarfile

    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "0.tar", "w") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "notes.txt").write_text("not fastio's")
    code, _, err = run_cli(["index", "shards", "--dest", "dest", "-q"], capsys)
    assert code == 2 and err.startswith("fastio: error: dest: DEST is not empty"), err


def test_audio_skipped_under_transcode_vp9_points_to_vp9_flac(tmp_path, capsys):
    """``--transcode vp9`` leaves audio DALI does not read skipped; the reason pointed to ``--transcode flac``
    alone ("the default"), which would drop the video re-encoding asked for: ``vp9,flac`` does both."""
    from fastio.convert.synthetic import make_audio

    make_audio(tmp_path / "a" / "x" / "a.mp3", seconds=0.3)
    code, _, err = run_cli(["convert", str(tmp_path / "a"), str(tmp_path / "ds"), "--transcode", "vp9", "-q",
                            "--workers", "1"], capsys)
    assert code == 2 and "x/a.mp3: audio codec mp3float is not read by DALI's audio decoder" in err, err
    assert "--transcode vp9,flac where videos are re-encoded too" in err and "(transcode=" not in err, err

"""Where a sound starts: for every audio codec fastio accepts, a tone that starts at 0.5 s is at the sample of
``AudioClips``' clip that PyAV's (FFmpeg's) decode of the same file puts it at, within 1 sample. Files are made here
with PyAV (``synthetic.encode_audio``); Ogg Vorbis, which PyAV cannot write well, is a libvorbis fixture."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("av")

from audio_onsets import OUT_RATE, check_onsets, clip_onsets, encode, pyav_decode  # noqa: E402

from fastio.formats.ogg import dali_opus_layout  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
# name -> (suffix, container, codec, sample format, the rate given to the encoder)
CODECS = {
    "wav": (".wav", "wav", "pcm_s16le", "s16", 16000),
    "flac": (".flac", "flac", "flac", "s16", 22050),
    "opus": (".opus", "ogg", "libopus", "flt", 48000),  # FFmpeg's Ogg: the first page starts at 312 (its pre-skip)
    "opus16k": (".opus", "ogg", "libopus", "flt", 16000),  # OpusHead input rate 16 kHz: DALI decodes at 16 kHz
}


def ogg_crc(page: bytes) -> int:
    """Ogg's page checksum (CRC-32, polynomial 0x04C11DB7, not reflected)."""
    crc = 0
    for byte in page:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
            crc &= 0xFFFFFFFF
    return crc


def granules_from_zero(data: bytes, shift: int) -> bytes:
    """Ogg ``data`` with every audio page's granule position lowered by ``shift`` (checksums redone): FFmpeg's Ogg
    Opus, whose first page starts at its pre-skip, as opusenc writes it (starting at 0)."""
    out, at = bytearray(data), 0
    while at < len(out):
        count = out[at + 26]
        end = at + 27 + count + sum(out[at + 27:at + 27 + count])
        granule = int.from_bytes(out[at + 6:at + 14], "little", signed=True)
        if granule > 0:
            out[at + 6:at + 14] = (granule - shift).to_bytes(8, "little", signed=True)
        out[at + 22:at + 26] = bytes(4)
        out[at + 22:at + 26] = ogg_crc(bytes(out[at:end])).to_bytes(4, "little")
        at = end
    return bytes(out)


@pytest.fixture(scope="module")
def onset_files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("onsets")
    (root / "c0").mkdir()
    for name, (suffix, container, codec, sample_fmt, rate) in CODECS.items():
        encode(root / "c0" / f"{name}{suffix}", container, codec, sample_fmt, rate)
    opus = (root / "c0" / "opus.opus").read_bytes()
    (root / "c0" / "opusenc.opus").write_bytes(granules_from_zero(opus, 312))
    shutil.copy(FIXTURES / "onset_44k_vorbis.ogg", root / "c0" / "vorbis.ogg")
    return root


def test_ogg_opus_layouts_as_dali_decodes_them(onset_files):
    """FFmpeg's Ogg Opus starts its first page at the pre-skip, so DALI delivers the 312 pre-skip samples; one
    starting at 0 (opusenc's) and a 16 kHz input rate are read as the header says."""
    layout = {n: dali_opus_layout((onset_files / "c0" / f"{n}.opus").read_bytes()) for n in ("opus", "opus16k",
                                                                                              "opusenc")}
    assert layout == {"opus": (48000, 312), "opus16k": (16000, 104), "opusenc": (48000, 0)}
    assert dali_opus_layout((onset_files / "c0" / "vorbis.ogg").read_bytes()) is None
    opus = (onset_files / "c0" / "opus.opus").read_bytes()
    assert dali_opus_layout(np.frombuffer(opus, np.uint8)) == (48000, 312)  # a batch's bytes, read in place
    for cut in (0, 4, 30, 60):  # cut before an audio page: no layout (and no exception)
        assert dali_opus_layout(opus[:cut]) is None, cut
    assert dali_opus_layout(opus[:200]) == (48000, 312)  # its first audio page's header is there


def test_every_codec_dali_reads_puts_the_onset_where_pyav_does(onset_files, tmp_path):
    got = clip_onsets(onset_files, tmp_path / "ds")
    assert set(got) == {*CODECS, "opusenc", "vorbis"}
    check_onsets(got, onset_files / "c0")


def test_a_clip_at_the_end_of_an_ogg_opus_file_holds_its_sound_to_the_last_sample(onset_files, tmp_path):
    """DALI does not deliver the last pre-skip samples of FFmpeg's Ogg Opus (312 at 48 kHz: module
    fastio.formats.ogg), so a clip drawn to the file's end held 104 zeros (at 16 kHz) where PyAV's decode has
    sound. A clip is drawn over the samples DALI delivers: each clip's end is PyAV's decode there, to its last
    sample, at either rate, also for the clips nearest the end."""
    import fastio

    src = tmp_path / "src"
    (src / "c0").mkdir(parents=True)
    for name in ("opus", "opus16k"):
        shutil.copy(onset_files / "c0" / f"{name}.opus", src / "c0")
    clip_onsets(src, tmp_path / "ds")  # converts
    want = {n: pyav_decode((src / "c0" / f"{n}.opus").read_bytes()) for n in ("opus", "opus16k")}
    ends = []
    for seed in range(8):
        with fastio.Loader(tmp_path / "ds", pipeline=fastio.AudioClips(sample_rate=OUT_RATE, seconds=0.99),
                           batch_size=2, device="cpu", seed=seed, shuffle="none", world_size=1, rank=0) as loader:
            batch = next(iter(loader))
            for j, i in enumerate(batch["index"].tolist()):
                name, start = loader.key(i).split("/")[-1], int(batch["start_sample"][j])
                clip = batch["audio"][j].numpy()
                tail = want[name][start + len(clip) - 300:start + len(clip)]  # the onset: the test above
                assert np.abs(clip[-300:] - tail).max() < 0.02, (name, start)
                ends.append(start + len(clip))
    assert max(ends) >= len(want["opus"]) - 104 - 30, max(ends)  # clips reached near the delivered end

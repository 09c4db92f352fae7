"""What DALI's audio decoder (``fn.decoders.audio``, libsndfile) delivers of an audio file, next to FFmpeg's
decode (the probe): the layouts :class:`fastio.AudioClips` places its clips by (:func:`decoded_layouts`), and why it
does not read a file PyAV reads (:func:`dali_audio_problem`, asked by the Loader after a batch failed and by
``fastio verify --decode``). ``nvidia.dali`` imported only when used."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastio.errors import dali_out_of_memory, dali_reason
from fastio.formats.ogg import dali_opus_layout, last_granule
from fastio.words import count

__all__ = ["VORBIS_MAX_BLOCK", "dali_audio_problem", "decoded_layouts"]


VORBIS_MAX_BLOCK = 8192
"""Vorbis' largest block: FFmpeg counts up to one more than an Ogg Vorbis file's last granule position."""


def decoded_layouts(encoded: list[np.ndarray], probes: list[dict[str, Any]]) -> tuple[np.ndarray, ...]:
    """``(rates, samples, leads)`` (int64 [B]) of audio files as DALI's audio decoder delivers them: the rate it
    decodes at, the samples it delivers (at that rate), and how many of them come before the first sample FFmpeg
    (the probe) delivers. The probe's, with no lead, but for Ogg (:mod:`fastio.formats.ogg`): Opus decoded at the
    header's input rate, its pre-skip partly delivered; Vorbis ending at its last granule position (within
    :data:`VORBIS_MAX_BLOCK` of the probe's count)."""
    out = np.array([[p["rate"], p["samples"], 0] for p in probes], np.int64).reshape(-1, 3)
    for j, p in enumerate(probes):
        layout = dali_opus_layout(encoded[j]) if p.get("codec") == "opus" else None
        if layout is not None:
            rate, lead = layout
            out[j] = rate, p["samples"] * rate // p["rate"], lead
        end = last_granule(encoded[j]) if p.get("codec") == "vorbis" else None
        if end is not None and 0 < out[j, 1] - end <= VORBIS_MAX_BLOCK:  # more: a damaged file, named on failure
            out[j, 1] = end
    return out[:, 0], out[:, 1], out[:, 2]


def dali_audio_problem(encoded: np.ndarray, probe: dict[str, Any]) -> str | None:
    """Why DALI's audio decoder, with :class:`fastio.AudioClips`' arguments, fails on a file PyAV reads in full (``probe``
    its probe): it cannot open it (an Ogg Opus header whose pre-skip is past the sound: "SF_INFO struct
    incomplete"), or it reads fewer samples than it delivers by the probe (:func:`decoded_layouts`; FFmpeg's
    experimental Vorbis encoder writes such files), so a clip's window lies past its end. Asked after the graph
    failed, and by ``fastio verify --decode`` (one small pipeline per file); None when DALI reads it all (or ran out
    of memory trying: not the file's fault)."""
    samples = int(decoded_layouts([encoded], [probe])[1][0])
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, prefetch_queue_depth=1)
    def decode():
        data = fn.external_source(source=lambda: [encoded], batch=True, dtype=types.UINT8)
        return fn.decoders.audio(data, downmix=True, dtype=types.FLOAT)[0]

    try:
        pipe = decode()
        pipe.build()
        read = int(pipe.run()[0][0].shape()[0])
    except Exception as err:  # whatever DALI raises: it cannot read this file alone
        if dali_out_of_memory(err):
            return None
        return f"DALI's audio decoder cannot read it ({dali_reason(err)}); re-encode it (e.g. as FLAC)"
    if read >= samples:
        return None
    return f"DALI's audio decoder reads {read} of its {count(samples, 'sample')}; re-encode it (e.g. as FLAC)"

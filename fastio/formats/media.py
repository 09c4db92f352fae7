"""Video and audio fields: which suffixes they are, what a probe records of each file, which codecs the CPU
decode path reads.

``fastio convert`` probes every video or audio file once (PyAV, :func:`probe`) and stores the result beside
it as the sample's ``probe.json`` field (:data:`PROBE_FIELD`), published in the same shard as the media and
checked with it: the Loader reads it with the media bytes and never opens a file to plan a clip. A file PyAV
cannot open is skipped and named in the report (:class:`MediaCheckError`), and so is a codec that the Loader does
not decode (``video_decoder="auto"``, the default: NVDEC's codecs, decoded on a GPU by NVDEC and on a CPU by
DALI's CPU decoder or PyAV; ``"cpu"``: DALI's CPU decoder's only, :data:`DECODER_CODECS`), and a still picture in a
video field, with the way out in the message; with ``transcode="vp9"`` (``fastio convert --transcode vp9``) such video
is re-encoded as VP9 instead. Audio DALI's audio decoder does not read (MP3, audio outside the containers and codecs
of :data:`DALI_AUDIO_CONTAINERS`) is decoded with PyAV and stored as FLAC (``transcode="flac"``, the default,
:func:`prepare_media`), or with ``transcode="none"`` skipped and named like the rest.

``fastio index`` cannot add fields to shards it indexes: it probes each media member once and writes the probes
into DEST's probe table (:data:`PROBES_NAME`, :func:`write_probe_table`, :class:`ProbeTable`), recorded in the
manifest with its checksums.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from fastio.formats.images import image_size
from fastio.formats.ogg import chained
from fastio.formats.vpx import VPX_CODECS, keyframe_size
from fastio.words import agree, count

__all__ = ["AUDIO_FIELDS", "CPU_AUDIO_REFUSED", "CPU_VIDEO_CODECS", "DALI_AUDIO_CONTAINERS", "MEDIA_FIELDS",
           "PROBES_NAME", "PROBE_FIELD", "DECODER_CODECS", "VIDEO_DECODERS", "VIDEO_FIELDS", "TRANSCODES",
           "MediaCheckError", "ProbeTable", "check_media", "count_video_codec", "join_video_codecs", "video_codecs_of",
           "write_probe_table", "is_audio_field", "is_media_field", "is_video_field", "media_field_for_suffix",
           "parse_probe", "prepare_media", "probe_json", "sniff_media_field", "transcode_vp9",
           "probe", "trim_video", "is_avi", "avi_without_index", "reindex_avi", "dali_reads_audio", "parse_transcode",
           "transcode_flac", "audio_codec_dali_lacks", "DEFAULT_TRANSCODE", "count_transcoded", "flac_concatenated",
           "flac_says_no_samples", "wav_says_no_data", "whole_frames", "flac_header_disagrees", "wav_files_joined",
           "refuse_joined_wav", "video_streams", "open_media"]

VIDEO_FIELDS = ("mp4", "webm", "mkv", "mov", "avi")
AUDIO_FIELDS = ("wav", "flac", "ogg", "opus", "mp3")
MEDIA_FIELDS = VIDEO_FIELDS + AUDIO_FIELDS
PROBE_FIELD = "probe.json"
"""The field holding a media sample's probe (JSON: ``kind`` and the numbers of :func:`probe`)."""
CPU_VIDEO_CODECS = ("vp8", "vp9", "mjpeg")
"""Video codecs ``fn.decoders.video(device="cpu")`` reads (DALI 2.4); a CPU Loader decodes the others with PyAV."""
NVDEC_CODECS = ("vp8", "vp9", "mjpeg", "h264", "hevc", "mpeg4", "av1")
"""Video codecs ``fn.decoders.video(device="mixed")`` reads (DALI 2.4's documentation: H.264, HEVC, MPEG-4 and AV1
on the mixed backend only)."""
DECODER_CODECS = {"auto": NVDEC_CODECS, "cpu": CPU_VIDEO_CODECS, "nvdec": NVDEC_CODECS}
"""The video codecs convert keeps for each ``video_decoder``: ``auto`` (the default) those a Loader decodes on either
device (a GPU's: NVDEC; a CPU's: DALI's CPU decoder, PyAV for the rest, ``VideoClips(cpu_fallback="auto")``),
``cpu`` those DALI's CPU decoder reads (a CPU Loader needs no PyAV), ``nvdec`` the same as ``auto`` (its older
name)."""
VIDEO_DECODERS = tuple(DECODER_CODECS)
"""What ``fastio convert --video-decoder`` takes: the decode path the stored videos are meant for."""
DEFAULT_VIDEO_DECODER = "auto"
"""``video_decoder``'s default (not recorded in a manifest's ``convert_options``)."""
CPU_AUDIO_REFUSED = ("mp3", "mp3float")
"""Audio codecs ``fn.decoders.audio`` fails on (DALI 2.4)."""


class MediaCheckError(ValueError):
    """A video or audio file that cannot be probed, or whose codec the CPU decoders cannot read."""


def _suffix(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def is_video_field(name: str) -> bool:
    """Whether a field holds a video, by its last extension (``mp4``, ``webm``, ``mkv``, ``mov``, ``avi``)."""
    return _suffix(name) in VIDEO_FIELDS


def is_audio_field(name: str) -> bool:
    """Whether a field holds audio, by its last extension (``wav``, ``flac``, ``ogg``, ``opus``, ``mp3``)."""
    return _suffix(name) in AUDIO_FIELDS


def is_media_field(name: str) -> bool:
    return is_video_field(name) or is_audio_field(name)


def probe(data: bytes, field: str) -> dict[str, Any]:
    """What clip sampling needs of one file, read by demuxing (video: no frame decoded) or decoding (audio):
    video ``frames`` (packets of the first video stream, but trailing ones flagged corrupt: a file cut off
    mid-frame), ``fps``, ``seconds``, ``codec``, ``width``, ``height``; audio ``rate``, ``channels``, ``samples``
    (at ``rate``), ``seconds``, ``codec``.
    MediaCheckError when PyAV cannot read it, it has no such stream, or a video field holds a still picture
    (a PNG named ``.webm``: FFmpeg would read it as a one-frame video)."""
    import av

    video = is_video_field(field)
    if not video:
        refuse_joined_wav(data)
    try:
        with open_media(data) as container:
            image = _image_format(container.format.name)
            if video and image:  # FFmpeg reads a still picture as a one-frame video: not what the suffix says
                raise MediaCheckError(f"is a {image} image, not a video (its suffix says {field})")
            streams = video_streams(container) if video else container.streams.audio
            if not streams:
                raise MediaCheckError(_no_stream(container, video, field))
            stream = streams[0]
            _codec_context(stream)
            return _probe_video(container, stream) if video else _probe_audio(container, stream)
    except av.FFmpegError as err:
        raise MediaCheckError(f"cannot be probed ({err.strerror or err})") from None


def video_streams(container) -> list:
    """The video streams of an open PyAV ``container`` but the pictures FFmpeg lists as video streams flagged
    ``attached_pic`` (a song's cover in an .m4a or .mp4, a FLAC's PICTURE block): not videos. The probe, the cuts
    and the PyAV decoders read the first."""
    import av

    pic = av.stream.Disposition.attached_pic
    return [s for s in container.streams.video if not s.disposition & pic]


def _codec_context(stream):
    """``stream``'s codec context; MediaCheckError when FFmpeg has no decoder for its codec, where PyAV gives None (a
    WAV whose format tag and bits name no sample format, an AVI's unknown fourcc): its name was read, and a bare
    AttributeError stopped the conversion."""
    if stream.codec_context is None:
        raise MediaCheckError(f"cannot be probed (its {stream.type} codec has no decoder in FFmpeg)")
    return stream.codec_context


def _shown(container, stream) -> str:
    """``codec in container`` for messages (``opus in matroska``), ``a codec FFmpeg has no decoder for`` for one."""
    codec = "a codec FFmpeg has no decoder for" if stream.codec_context is None else stream.codec_context.name
    return f"{codec} in {container.format.name.split(',')[0]}"


def open_media(data: bytes):
    """``data`` opened with PyAV for reading. A file's tags (its metadata: an artist, the software that wrote it) in
    bytes that are not UTF-8 (a Latin-1 INFO tag of an older tagger) are read with those bytes replaced: PyAV decodes
    them strictly when it opens a file, and a bare UnicodeDecodeError stopped the conversion. fastio reads nothing
    of them."""
    import av

    return av.open(io.BytesIO(data), metadata_errors="replace")


def _no_stream(container, video: bool, field: str) -> str:
    """Why a file has no stream of its field's kind; a video field holding only audio (Opus in WebM: a browser's
    recording) is named as audio, with the way to store it (DALI's audio decoder reads no such container); an audio
    field holding a video (a video named ``.flac``) as a video."""
    if not video and video_streams(container):
        shown = _shown(container, video_streams(container)[0])
        return (f"no audio stream, only video ({shown}): its suffix says {field}; name it by its container (.webm, "
                ".mkv, .mp4, ...) to store it as a video")
    if not video or not container.streams.audio:
        return f"no {'video' if video else 'audio'} stream"
    audio = _shown(container, container.streams.audio[0])
    return f"no video stream, only audio ({audio}), which DALI's audio decoder does not read: {_AUDIO_WAYS_OUT}"


def _audio_only(data: bytes) -> bool:
    """Whether PyAV reads ``data`` as audio without a video stream."""
    import av

    try:
        with open_media(data) as container:
            return bool(container.streams.audio) and not video_streams(container)
    except av.FFmpegError:
        return False


def _image_format(demuxer: str) -> str | None:
    """The picture format an FFmpeg demuxer name says (``png_pipe`` -> ``png``, ``image2``), None for a
    container (an animated GIF counts as a video)."""
    if demuxer == "image2":
        return "still"
    return demuxer.removesuffix("_pipe") if demuxer.endswith("_pipe") else None


def _probe_video(container, stream) -> dict[str, Any]:
    keys, first, codec = [], [], _codec_name(stream.codec_context)  # each packet's keyframe flag; the first packets
    sizes: dict[tuple[int, int], int] = {}  # each keyframe size its header says (_coded_size) -> its first frame
    corrupt = []  # each packet's corrupt flag (a file cut off mid-frame ends with a partial one: whole_frames)
    for p in container.demux(stream):
        if p.size and p.pts is not None:
            size = _coded_size(codec, p)
            if size is not None:
                sizes.setdefault(size, len(keys))
            keys.append(p.is_keyframe)
            corrupt.append(p.is_corrupt)
            first += [p] if len(first) < ROTATION_PACKETS else []
    del keys[whole_frames(corrupt):]  # not counted: no clip starts in them, and one past the end repeats the last
    frames, fps = len(keys), float(stream.average_rate or stream.guessed_rate or 0)
    if frames == 0 or fps <= 0:
        raise MediaCheckError("cannot be probed (no frames)")
    if len(sizes) > 1:  # DALI's CPU decoder returned the frames after the change wrong (mostly black)
        (w0, h0), (w1, h1) = list(sizes)[:2]
        raise MediaCheckError(size_change(w0, h0, w1, h1, list(sizes.values())[1]))
    turn = _rotation(stream, first)
    return {"kind": "video", "frames": frames, "fps": round(fps, 6), "seconds": round(frames / fps, 6),
            "codec": _codec_name(stream.codec_context), "width": stream.width, "height": stream.height,
            "keyframes": [k for k, key in enumerate(keys) if key], **({"rotation": turn} if turn else {})}


def _coded_size(codec: str, packet) -> tuple[int, int] | None:
    """``(width, height)`` a keyframe's own header says, read from its packet's bytes (no frame decoded): a VP8 or VP9
    keyframe's (:func:`fastio.formats.vpx.keyframe_size`), an MJPEG frame's JPEG header (every MJPEG frame is a
    keyframe of its own size: DALI's CPU decoder gave the frames after a change wrong, without an error); None
    for another codec, a packet that is not a keyframe, or a header that does not parse."""
    if not packet.is_keyframe:
        return None
    if codec in VPX_CODECS:
        return keyframe_size(codec, bytes(packet))
    if codec == "mjpeg":
        try:
            return image_size(bytes(packet))
        except ValueError:
            return None
    return None


def whole_frames(corrupt: list[bool]) -> int:
    """How many of a video's frames (its packets' corrupt flags, in order: the packets :func:`probe` counts) are
    whole: all but the trailing ones FFmpeg flags corrupt, the partial last frame of a file cut off mid-frame (a
    clip reaching it got a half-decoded picture, or PyAV's decoder failed on it)."""
    n = len(corrupt)
    while n and corrupt[n - 1]:
        n -= 1
    return n


def size_change(w0: int, h0: int, w1: int, h1: int, frame: int) -> str:
    """Why a video whose frame size changes mid-stream is refused: its first size, the next, and where."""
    return (f"its frame size changes mid-stream ({w0} x {h0}, then {w1} x {h1} at frame {frame}): re-encode it at one "
            "size (e.g. ffmpeg -i IN -vf scale=640:360 -c:v libvpx-vp9 -crf 30 -b:v 0 OUT.webm)")


ROTATION_PACKETS = 32
"""Packets :func:`_rotation` decodes at most until a frame comes out (a decoder holds back a few: B-frames)."""


def _rotation(stream, packets: list) -> int:
    """The rotation of the video's display matrix (what players turn its frames by before showing them), in
    counterclockwise degrees: 0, 90, 180 or 270 (a rotation that is not a quarter turn: the nearest; the matrix's
    flips are not read). FFmpeg gives it with a decoded frame (``VideoFrame.rotation``): the first frame of
    ``packets`` is decoded; 0 when none comes out (the frames are judged when a clip is decoded)."""
    import av

    codec = stream.codec_context
    try:
        for packet in [*packets, None]:
            for frame in codec.decode(packet):
                return round(getattr(frame, "rotation", 0) / 90) % 4 * 90
    except av.FFmpegError:
        pass
    return 0


def _codec_name(context) -> str:
    """The codec's own name (``av1``), not its decoder's (PyAV opens AV1 with ``libdav1d``)."""
    return getattr(context.codec, "canonical_name", None) or context.name


def is_avi(data) -> bool:
    """Whether ``data`` (bytes, or a uint8 array) is an AVI file (RIFF ``AVI ``)."""
    return bytes(data[:4]) == b"RIFF" and bytes(data[8:12]) == b"AVI "


def _has_chunk(data, at: int, end: int, wanted: tuple[bytes, ...]) -> bool:
    """Whether a RIFF chunk with an id of ``wanted`` lies between ``at`` and ``end`` of ``data``, at the top or in a
    header list (``hdrl``, ``strl``: not ``movi``, whose chunks are the frames). A size past ``end`` (a file cut
    off, or a writer that could not go back to fill it in: 2**32 - 1) ends the walk."""
    while at + 8 <= end:
        cid, size = bytes(data[at:at + 4]), int.from_bytes(bytes(data[at + 4:at + 8]), "little")
        if cid in wanted:
            return True
        if cid == b"LIST" and bytes(data[at + 8:at + 12]) in (b"hdrl", b"strl") \
                and _has_chunk(data, at + 12, min(end, at + 8 + size), wanted):
            return True
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    return False


def avi_without_index(data) -> bool:
    """Whether ``data`` (bytes, or a uint8 array) is an AVI (:func:`is_avi`) without an index: no ``idx1`` chunk and
    no OpenDML ``indx`` in its header, as FFmpeg writing to a pipe, or a capture cut off before it closed the file,
    leaves it (its header then says 2**30 frames). DALI's CPU decoder, handed one as it is, crashed the process (a
    segfault): convert stores it with its index (:func:`reindex_avi`), and a Loader without PyAV, which cannot remux
    it (:func:`trim_video`), refuses it."""
    if not is_avi(data):
        return False
    end = min(len(data), 8 + int.from_bytes(bytes(data[4:8]), "little"))
    return not _has_chunk(data, 12, end, (b"idx1", b"indx"))


def reindex_avi(data: bytes) -> bytes:
    """AVI ``data`` without an index (:func:`avi_without_index`) written again with one: its video and audio streams'
    packets copied as they are (no frame decoded or encoded, the same timestamps) into an AVI that PyAV writes to a
    seekable buffer, which gets the index and the header's frame counts. The trailing packets FFmpeg flags corrupt
    (the partial last frame of a file cut off, :func:`whole_frames`) are left out: in the new file they would no
    longer be flagged, and the probe would count them. MediaCheckError when PyAV cannot."""
    import av

    out = io.BytesIO()
    try:
        with open_media(data) as src, av.open(out, "w", format="avi") as dst:
            streams = [s for s in src.streams if s.type in ("video", "audio")]
            copies = {s.index: dst.add_stream_from_template(s) for s in streams}
            packets = [p for p in src.demux(streams)  # not the flushes, nor a stream's the demuxer found later
                       if (p.pts is not None or p.dts is not None) and p.stream.index in copies]
            for packet in packets[:whole_frames([p.is_corrupt for p in packets])]:
                packet.stream = copies[packet.stream.index]
                dst.mux(packet)
    except (av.FFmpegError, ValueError) as err:
        raise MediaCheckError(f"is an AVI without an index (written to a pipe, or cut off) that cannot be written "
                              f"again with one ({getattr(err, 'strerror', None) or err}): re-encode it (e.g. ffmpeg "
                              "-i IN -c:v libvpx-vp9 -crf 30 -b:v 0 OUT.webm)") from None
    return out.getvalue()


def trim_video(data: bytes, first: int, last: int, keyframes: list[int] | None = None,
               remux: bool = False) -> tuple[bytes, int]:
    """``(stream, k)``: the frames ``k .. last`` of video ``data`` (frames counted as :func:`probe` counts them),
    ``k`` the last keyframe at or before frame ``first``, remuxed (no frame decoded) into a Matroska stream of
    their packets, so that a decoder that decodes from its input's first frame (DALI's CPU ``fn.decoders.video``
    decodes from frame 0 whatever ``start_frame`` is) starts at ``k``: frame ``f`` of the video is frame
    ``f - k`` of the stream. ``data`` itself and 0 when ``k`` is 0 (``keyframes``: the probe's, when known, spares
    reading the packets then), or when PyAV is not installed or cannot remux it (the decoder then meets the file as
    it is). ``remux``: the frames ``0 .. last`` remuxed even when ``k`` is 0, for a clip that runs past the video's
    end: DALI counts an AVI's frames by its time slots, so past the end of one with a dropped frame it returned black
    frames and earlier ones instead of repeating the last; in a stream of its packets it repeats it (and for every
    clip of an AVI, :func:`is_avi`: DALI crashed on one without an index)."""
    if keyframes is not None and not remux and not any(0 < k <= first for k in keyframes):
        return data, 0
    try:
        import av
    except ImportError:  # PyAV (fastio[media]) not installed where the Loader runs: decoded from frame 0
        return data, 0

    try:
        with open_media(data) as src:
            stream = video_streams(src)[0]
            packets, k = [], 0
            for packet in src.demux(stream):
                if not packet.size or packet.pts is None:
                    continue
                at = k + len(packets)  # this packet's frame
                if at <= first and packet.is_keyframe:
                    packets, k = [], at
                if at > first and k == 0 and not remux:  # no keyframe but frame 0 before the clip: the file as it is
                    break
                packets.append(packet)
                if at >= last:
                    break
            if k == 0 and not remux:
                return data, 0
            out = io.BytesIO()
            with av.open(out, "w", format="matroska") as dst:
                copy = dst.add_stream_from_template(stream)
                for packet in packets:
                    packet.stream = copy
                    dst.mux(packet)
    except (av.FFmpegError, IndexError, ValueError):
        return data, 0
    return out.getvalue(), k


DALI_AUDIO_CONTAINERS = {"wav": "pcm", "w64": "pcm", "aiff": "pcm", "flac": ("flac",), "ogg": ("vorbis", "opus")}
"""Containers (FFmpeg's demuxer names) ``fn.decoders.audio`` reads (DALI 2.4, libsndfile), with the codecs it reads
in them (``pcm``: PCM of any sample format, A-law, mu-law, IMA and MS ADPCM); measured here: AAC (ADTS, in WAV),
ALAC (MP4), AC-3 and Opus in Matroska fail."""


def _dali_reads_audio(container: str, codec: str) -> bool:
    codecs = DALI_AUDIO_CONTAINERS.get(container)
    if codecs == "pcm":
        return codec.startswith("pcm_") or codec in ("adpcm_ima_wav", "adpcm_ms")
    return codecs is not None and codec in codecs


_AUDIO_WAYS_OUT = ("convert it with --transcode flac (transcode='flac'), the default, or --transcode vp9,flac "
                   "(transcode='vp9,flac') where videos are re-encoded too, which stores it decoded by PyAV as FLAC; "
                   "or re-encode it as FLAC, WAV or Opus (e.g. ffmpeg -i IN -c:a flac OUT.flac)")


def _probe_audio(container, stream) -> dict[str, Any]:
    codec, rate, channels = stream.codec_context.name, stream.sample_rate, stream.channels
    if codec in CPU_AUDIO_REFUSED:  # refused below before decoding it
        return {"kind": "audio", "rate": rate, "channels": channels, "samples": 0, "seconds": 0.0, "codec": codec}
    form = container.format.name.split(",")[0]
    if not _dali_reads_audio(form, codec):
        raise MediaCheckError(f"audio {codec} in {form} is not read by DALI's audio decoder (it reads WAV, AIFF and "
                              f"W64 PCM or ADPCM, FLAC, Ogg Vorbis and Ogg Opus): {_AUDIO_WAYS_OUT}")
    samples = sum(f.samples for f in container.decode(stream))
    if samples == 0 or not rate:
        raise MediaCheckError("cannot be probed (no samples)")
    return {"kind": "audio", "rate": rate, "channels": channels, "samples": samples,
            "seconds": round(samples / rate, 6), "codec": codec}


TRANSCODES = ("vp9", "flac")
"""What ``fastio convert --transcode`` re-encodes into: ``vp9``, video the video decoder cannot read; ``flac``, audio
DALI's audio decoder cannot read (MP3, AAC, ALAC, ...); both: ``vp9,flac``; ``none``: nothing (such files are
skipped and listed)."""

DEFAULT_TRANSCODE = "flac"
"""``transcode``'s default (not recorded in a manifest's ``convert_options``): audio DALI cannot read is stored as
FLAC, as ``video_decoder="auto"`` keeps every video a Loader decodes."""


def parse_transcode(text: str | None) -> str:
    """``transcode`` as convert records it: ``none``, or the names of :data:`TRANSCODES` it holds (comma-separated,
    in that order); None is :data:`DEFAULT_TRANSCODE`; ValueError naming the value otherwise."""
    if text is None:
        return DEFAULT_TRANSCODE
    names = [t.strip().lower() for t in str(text).split(",")]
    if names == ["none"]:
        return "none"
    if not all(n in TRANSCODES for n in names):
        raise ValueError(f"transcode must be flac, vp9, vp9,flac or none, got {text!r}")
    return ",".join(t for t in TRANSCODES if t in names)


def transcode_vp9(data: bytes) -> bytes:
    """The first video stream of ``data`` re-encoded as VP9 in WebM (crf 30, every frame, the same frame rate,
    size and display rotation; audio and other streams dropped). MediaCheckError when PyAV cannot decode it."""
    import av

    out_buf = io.BytesIO()
    try:
        with open_media(data) as src, av.open(out_buf, "w", format="webm") as out:
            stream_in = video_streams(src)[0]
            _codec_context(stream_in)
            stream = out.add_stream("libvpx-vp9", rate=stream_in.average_rate or stream_in.guessed_rate or 24)
            stream.width, stream.height, stream.pix_fmt = stream_in.width, stream_in.height, "yuv420p"
            stream.options = {"crf": "30", "b:v": "0", "deadline": "good", "cpu-used": "4", "row-mt": "1"}
            for k, frame in enumerate(src.decode(stream_in)):
                if k == 0 and getattr(frame, "rotation", 0):  # the display matrix's turn, kept for players and clips
                    stream.set_display_rotation(frame.rotation)
                frame.pts = None
                for packet in stream.encode(frame.reformat(format="yuv420p")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
    except (av.FFmpegError, IndexError) as err:
        raise MediaCheckError(f"cannot be transcoded ({getattr(err, 'strerror', None) or err})") from None
    return out_buf.getvalue()


def dali_reads_audio(data: bytes) -> bool:
    """Whether DALI's audio decoder reads the first audio stream of ``data`` (:data:`DALI_AUDIO_CONTAINERS`); True
    when PyAV cannot open it or it has no audio stream (:func:`check_media` names that)."""
    return audio_codec_dali_lacks(data) is None


def audio_codec_dali_lacks(data: bytes) -> str | None:
    """The codec (PyAV's name: ``mp3float``, ``aac``, ``alac``, ...) of the first audio stream of ``data`` when DALI's
    audio decoder does not read it (:data:`DALI_AUDIO_CONTAINERS`); None when it does, or when PyAV cannot open
    ``data`` or it has no audio stream (:func:`check_media` names that)."""
    import av

    try:
        with open_media(data) as container:
            context = container.streams.audio[0].codec_context
            if context is None:  # no decoder: check_media names it
                return None
            codec = context.name
            reads = _dali_reads_audio(container.format.name.split(",")[0], codec) and _dali_reads_less(data) is None
            return None if reads else codec
    except (av.FFmpegError, IndexError):
        return None


def _dali_reads_less(data: bytes, samples: int | None = None) -> str | None:
    """How much of audio ``data`` DALI's audio decoder reads, where it reads less than FFmpeg (the probe) of a
    container and codec it reads (:data:`DALI_AUDIO_CONTAINERS`): ``"none"`` of a WAV whose data chunk says 0 bytes
    (:func:`wav_says_no_data`) or a FLAC whose STREAMINFO says 0 samples (:func:`flac_says_no_samples`), ``"only the
    first file's"`` of FLAC files one after another (:func:`flac_concatenated`), ``"only the first stream's"`` of a
    chained Ogg (:func:`fastio.formats.ogg.chained`), ``"none"`` or ``"only N"`` of a FLAC whose STREAMINFO disagrees
    with its frames (:func:`flac_header_disagrees`; ``samples``: FFmpeg's count, when known);
    the reason, completing "so DALI's audio decoder reads ... of its N samples"; None where it reads it all."""
    if wav_says_no_data(data):
        return ("its data chunk says 0 bytes (a WAV whose writer could not go back to fill in its size: a pipe, a "
                "recording cut off), so DALI's audio decoder reads none")
    if flac_says_no_samples(data):
        return ("its STREAMINFO says 0 samples (a FLAC whose writer could not go back to fill in the count: a pipe), "
                "so DALI's audio decoder reads none")
    if flac_concatenated(data):
        return ("it is FLAC files one after another (cat a.flac b.flac), whose first STREAMINFO counts the first "
                "file's samples only, so DALI's audio decoder reads only the first file's")
    if bytes(data[:4]) == b"OggS" and chained(data):
        return ("it is a chained Ogg stream (streams one after another in one file, as a recorded radio stream or "
                "cat a.opus b.opus makes), so DALI's audio decoder reads only the first stream's")
    return flac_header_disagrees(data, samples)


def flac_header_disagrees(data: bytes, samples: int | None = None) -> str | None:
    """What the STREAMINFO of FLAC ``data`` says that its frames (FFmpeg's reading, which the probe records)
    contradict, where DALI's audio decoder (libsndfile, which believes the header) then reads less: total samples
    other than the frames hold (not 0, :func:`flac_says_no_samples`: fewer, it reads only those; more, it fails),
    other channels, or 0 Hz (it fails). A damaged header, or one a tool rewrote wrong. ``samples``: FFmpeg's count
    when known (else its frames' lengths, as FFmpeg's parser demuxes them, and only where they disagree with the
    header, a decode's count). The reason, as :func:`_dali_reads_less` gives it; None otherwise."""
    at = _flac_start(data)
    if at is None or len(data) < at + 26 or data[at + 4] & 0x7F != 0:  # STREAMINFO comes first
        return None
    info = int.from_bytes(bytes(data[at + 18:at + 26]), "big")  # rate 20 bits, channels - 1 3, bits - 1 5, total 36
    rate, channels, total = info >> 44, (info >> 41 & 7) + 1, info & (1 << 36) - 1
    frames = _flac_frames(data, decode=False)
    if frames is None:
        return None  # check_media names a file PyAV cannot read
    heard, counted = frames
    if samples is None:
        samples = counted if not total or total == counted else (_flac_frames(data, decode=True) or frames)[1]
    header = "(a damaged header), so DALI's audio decoder reads"
    if rate == 0:
        return f"its STREAMINFO says 0 Hz {header} none"
    if channels != heard:
        return f"its STREAMINFO says {channels} channels where its frames have {heard} {header} none"
    if total and total != samples:
        return (f"its STREAMINFO says {total} samples where its frames hold {samples} {header} "
                f"{f'only {total}' if total < samples else 'none'}")
    return None


def _flac_frames(data: bytes, decode: bool) -> tuple[int, int] | None:
    """``(channels, samples)`` of FLAC ``data`` as FFmpeg reads its frames: the samples decoded, or (``decode``
    False) the sum of its frames' lengths, as its parser demuxes them (no frame decoded); None when PyAV cannot."""
    import av

    try:
        with open_media(data) as container:
            stream = container.streams.audio[0]
            if decode:
                samples = sum(f.samples for f in container.decode(stream))
            else:  # in the stream's time base, 1 / STREAMINFO's rate: at the frames' rate
                ticks = sum(p.duration or 0 for p in container.demux(stream))
                samples = round(ticks * stream.time_base * stream.sample_rate)
            return stream.channels, samples
    except (av.FFmpegError, IndexError, ZeroDivisionError, TypeError):
        return None


def _riff_wave(data) -> bool:
    return bytes(data[:4]) == b"RIFF" and bytes(data[8:12]) == b"WAVE"


def wav_files_joined(data) -> bool:
    """Whether RIFF WAVE ``data`` holds another RIFF file among the chunks after its own (``cat a.wav b.wav``):
    FFmpeg reads the first file's samples only, DALI's audio decoder (libsndfile) none ("No 'RIFF' chunk marker")."""
    if not _riff_wave(data):
        return False
    at = 12
    while at + 8 <= len(data):
        if bytes(data[at:at + 4]) == b"RIFF":
            return True
        size = int.from_bytes(bytes(data[at + 4:at + 8]), "little")
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    return False


def refuse_joined_wav(data) -> None:
    """MediaCheckError when ``data`` is WAV files one after another (:func:`wav_files_joined`): no decoder gives all
    of its sound, and a transcode would keep the first file's only, so it is refused whatever ``transcode`` says."""
    if wav_files_joined(data):
        raise MediaCheckError("it is WAV files one after another (cat a.wav b.wav): FFmpeg reads only the first "
                              "file's samples and DALI's audio decoder none of them; split it into its files, or join "
                              "their sound into one file (e.g. ffmpeg -i a.wav -i b.wav -filter_complex "
                              "concat=n=2:v=0:a=1 OUT.flac)")


def _flac_start(data: bytes) -> int | None:
    """Where the ``fLaC`` marker of FLAC ``data`` is (after an ID3v2 tag, if any: taggers put one there); None when
    ``data`` is not FLAC."""
    at = 0
    if bytes(data[:3]) == b"ID3" and len(data) >= 10:  # its size: 4 bytes of 7 bits; a footer adds 10
        at = 10 + sum((data[6 + i] & 0x7F) << (7 * (3 - i)) for i in range(4)) + (10 if data[5] & 0x10 else 0)
    return at if bytes(data[at:at + 4]) == b"fLaC" else None


def flac_concatenated(data: bytes) -> bool:
    """Whether FLAC ``data`` holds another FLAC file after the first's header (``cat a.flac b.flac``): a ``fLaC``
    marker followed by a STREAMINFO block header. FFmpeg decodes both files' frames, DALI's audio decoder
    (libFLAC) stops at the first STREAMINFO's count."""
    at = _flac_start(data)
    if at is None:
        return False
    raw = bytes(data)
    return any(raw.find(b"fLaC" + bytes([flag]) + b"\x00\x00\x22", at + 4) >= 0 for flag in (0x00, 0x80))


def flac_says_no_samples(data: bytes) -> bool:
    """Whether ``data`` is a FLAC file (maybe after an ID3v2 tag) whose STREAMINFO says its total samples are 0
    (unknown), as FFmpeg writing FLAC to a pipe leaves it: FFmpeg decodes its frames, DALI's audio decoder
    (libsndfile) fails on it ("Requested 9223372036854775807 samples but got 0")."""
    at = _flac_start(data)
    if at is None or len(data) < at + 26 or data[at + 4] & 0x7F != 0:  # STREAMINFO comes first
        return False
    info = at + 8  # its 36 bits of total samples: the low 4 bits of byte 13, then 4 bytes
    return (data[info + 13] & 0x0F) == 0 and not any(data[info + 14:info + 18])


def wav_says_no_data(data: bytes) -> bool:
    """Whether ``data`` is a RIFF WAVE file whose ``data`` chunk says it holds 0 bytes while bytes follow it, as a
    writer that cannot seek back to fill in the size leaves it (Python's ``wave`` writing to a pipe, a recording cut
    off): FFmpeg reads the samples to the end of the file, DALI's audio decoder (libsndfile) reads none."""
    if not _riff_wave(data):
        return False
    at = 12
    while at + 8 <= len(data):
        size = int.from_bytes(data[at + 4:at + 8], "little")
        if bytes(data[at:at + 4]) == b"data":
            return size == 0 and len(data) > at + 8
        at += 8 + size + (size & 1)  # chunks are padded to an even size
    return False


def transcode_flac(data: bytes) -> bytes:
    """The first audio stream of ``data`` (MP3, AAC, ...: what DALI's audio decoder does not read) decoded with PyAV
    and stored as 16-bit FLAC at its own rate and channels: the samples FFmpeg decodes (an MP3's encoder delay and
    padding dropped, as its LAME header says). MediaCheckError when PyAV cannot decode it or FLAC cannot hold it."""
    import av

    out_buf = io.BytesIO()
    try:
        with open_media(data) as src, av.open(out_buf, "w", format="flac") as out:
            stream_in = src.streams.audio[0]
            _codec_context(stream_in)
            layout, rate = stream_in.layout.name, stream_in.sample_rate
            stream = out.add_stream("flac", rate=rate, layout=layout)
            resampler = av.AudioResampler(format="s16", layout=layout, rate=rate,
                                          frame_size=stream.codec_context.frame_size or None)
            for frame in [*src.decode(stream_in), None]:
                for chunk in resampler.resample(frame):
                    chunk.pts = None
                    for packet in stream.encode(chunk):
                        out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
    except (av.FFmpegError, IndexError, ValueError) as err:
        raise MediaCheckError(f"cannot be transcoded to FLAC ({getattr(err, 'strerror', None) or err})") from None
    return out_buf.getvalue()


def prepare_media(data: bytes, field: str, transcode: str | None = DEFAULT_TRANSCODE,
                  video_decoder: str = DEFAULT_VIDEO_DECODER) -> tuple[str, bytes, bytes]:
    """``(field, bytes, probe.json bytes)`` of one video or audio file as convert stores it: as it is, or with
    ``transcode="vp9"`` a video of a codec ``video_decoder`` does not keep (:data:`DECODER_CODECS`), or whose first
    frame is not a keyframe, re-encoded (field ``webm``), with ``transcode="flac"`` (the default) audio DALI's audio
    decoder cannot read, or a video file holding only audio (field ``flac``, :func:`transcode_flac`);
    MediaCheckError otherwise (:func:`check_media`). A transcoded file's probe names the codec it was transcoded
    from (``transcoded_from``)."""
    wanted, source = (transcode or "").split(","), None
    if is_audio_field(field):  # before transcoding, which would keep the first file's sound only
        refuse_joined_wav(data)
    audio_only = "flac" in wanted and is_video_field(field) and _audio_only(data)
    if "vp9" in wanted and is_video_field(field) and not audio_only:
        info = probe(data, field)
        if info["codec"] not in DECODER_CODECS[video_decoder] or (info.get("keyframes") or [0])[0] != 0:
            data, field, source = transcode_vp9(data), "webm", info["codec"]
    reindexed = is_video_field(field) and not audio_only and avi_without_index(data)
    if reindexed:  # DALI's CPU decoder crashed on it where no PyAV remuxes it at load (trim_video)
        data = reindex_avi(data)
    if "flac" in wanted and (audio_only or is_audio_field(field)):
        lacking = audio_codec_dali_lacks(data)
        if audio_only or lacking is not None:
            data, field, source = transcode_flac(data), "flac", lacking or "audio in a video file"
    return field, data, check_media(data, field, video_decoder, transcoded_from=source, reindexed=reindexed)


def check_media(data: bytes, field: str, video_decoder: str = DEFAULT_VIDEO_DECODER,
                transcoded_from: str | None = None, reindexed: bool = False) -> bytes:
    """The ``probe.json`` bytes of a video file of a codec ``video_decoder`` keeps (``auto``: every codec a Loader
    decodes; ``cpu``: DALI's CPU decoder's; :data:`DECODER_CODECS`) whose first frame is a keyframe (one cut from a longer
    stream is not decodable from its start), or of an audio file DALI's audio decoder reads; MediaCheckError (its
    message: why, with the ways out) otherwise. ``transcoded_from``: recorded in the probe (the original's codec);
    ``reindexed``: recorded as ``"reindexed": true`` (an AVI convert wrote again with its index, :func:`reindex_avi`)."""
    info = probe(data, field)
    if transcoded_from is not None:
        info["transcoded_from"] = transcoded_from
    if reindexed:
        info["reindexed"] = True
    codec = info["codec"]
    if info["kind"] == "video" and codec not in DECODER_CODECS[video_decoder]:
        raise MediaCheckError(_video_refusal(codec, video_decoder))
    keyframes = info.get("keyframes") or [0]  # a container that flags none: decoded from its first frame
    if keyframes[0] != 0:  # cut from a longer stream (ffmpeg -c copy -ss at a frame that is not a keyframe)
        raise MediaCheckError(f"its first frame is not a keyframe: its {count(keyframes[0], 'frame')} before the first "
                              f"keyframe {agree(keyframes[0], 'refers', 'refer')} to frames it does not have and cannot "
                              "be decoded; re-encode it (e.g. ffmpeg -i IN -c:v libvpx-vp9 -crf 30 -b:v 0 OUT.webm)")
    if info["kind"] == "audio" and codec in CPU_AUDIO_REFUSED:
        raise MediaCheckError(f"audio codec {codec} is not read by DALI's audio decoder: {_AUDIO_WAYS_OUT}")
    less = _dali_reads_less(data, info["samples"]) if info["kind"] == "audio" else None
    if less is not None:
        raise MediaCheckError(f"{less} of its {count(info['samples'], 'sample')}: {_AUDIO_WAYS_OUT}")
    return json.dumps(info, sort_keys=True, separators=(",", ":")).encode()


def _video_refusal(codec: str, video_decoder: str) -> str:
    """Why a video of ``codec`` is not kept for ``video_decoder``, and the ways out: first the one that needs no
    other program (``--transcode vp9``: PyAV re-encodes it)."""
    transcode = "convert with --transcode vp9 (PyAV re-encodes it, no ffmpeg needed)"
    if video_decoder == "cpu" and codec in NVDEC_CODECS:
        return (f"video codec {codec} is not read by DALI's CPU decoder (video_decoder='cpu' keeps "
                f"{', '.join(CPU_VIDEO_CODECS)}): {transcode}, or leave out --video-decoder cpu (NVDEC decodes it "
                "on a GPU, PyAV on a CPU)")
    return (f"video codec {codec} is not decoded by a Loader (video_decoder={video_decoder!r} keeps "
            f"{', '.join(DECODER_CODECS[video_decoder])}): {transcode}, or re-encode it (e.g. ffmpeg -i IN -c:v "
            "libx264 OUT.mp4)")


def count_transcoded(counts: dict[str, dict[str, int]], probe_json: bytes) -> None:
    """Count in ``counts`` (per field transcoded into, ``flac`` or ``webm``: per codec transcoded from) each media
    field of a sample's ``probe.json`` that convert stored transcoded (:func:`prepare_media`)."""
    info = json.loads(probe_json)
    for p in [info] if "kind" in info else info.values():
        if "transcoded_from" in p:
            into = counts.setdefault("flac" if p["kind"] == "audio" else "webm", {})
            into[p["transcoded_from"]] = into.get(p["transcoded_from"], 0) + 1


def count_video_codec(codecs: dict[str, dict[str, int]], index: int, probe_json: bytes) -> None:
    """Count sample ``index`` in ``codecs`` (a manifest's ``video_codecs``: per codec ``count`` and ``first``
    sample) when its ``probe.json`` is a video's."""
    info = json.loads(probe_json)
    probes = [info] if "kind" in info else list(info.values())  # one field's, or several (:func:`probe_json`)
    for codec in sorted({p["codec"] for p in probes if p.get("kind") == "video"}):
        codecs.setdefault(codec, {"count": 0, "first": index})["count"] += 1


def video_codecs_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The ``video_codecs`` count of samples whose probes are ``rows`` (per sample: field -> probe dict, or the
    reason it has none; as ``fastio index`` keeps them): a sample counts once per codec its videos have."""
    codecs: dict[str, dict[str, int]] = {}
    for i, row in enumerate(rows):
        for codec in sorted({p["codec"] for p in row.values() if isinstance(p, dict) and p.get("kind") == "video"}):
            codecs.setdefault(codec, {"count": 0, "first": i})["count"] += 1
    return codecs


def join_video_codecs(codecs: dict[str, dict[str, int]], more: dict[str, dict[str, int]] | None,
                      offset: int) -> None:
    """Add the counts ``more`` of samples that follow ``offset`` samples (a later part's) to ``codecs``."""
    for codec, seen in (more or {}).items():
        codecs.setdefault(codec, {"count": 0, "first": offset + seen["first"]})["count"] += seen["count"]


def probe_json(probes: dict[str, bytes]) -> bytes:
    """A sample's ``probe.json`` bytes from its media fields' probes (field -> :func:`check_media` bytes): the
    probe itself for one field; for several (a video and its sound: ``key.webm`` + ``key.flac``) an object of
    field -> probe, from which :func:`parse_probe` takes the field a clip pipeline reads."""
    if len(probes) == 1:
        return next(iter(probes.values()))
    return json.dumps({f: json.loads(p) for f, p in probes.items()}, sort_keys=True, separators=(",", ":")).encode()


def parse_probe(data: bytes, where: str, field: str | None = None) -> dict[str, Any]:
    """A stored ``probe.json`` as a dict: the probe of media field ``field`` in one of several fields' probes
    (:func:`probe_json`); ValueError naming ``where`` when it is not one."""
    try:
        info = json.loads(data)
        if "kind" not in info and field is not None:
            info = info[field]
        if field is not None and (info["kind"] == "video") != is_video_field(field):
            raise ValueError(f"it is a probe of {info['kind']}, not of its {field} (a sample of several media "
                             "fields converted before each was probed)")
        if info["kind"] == "video":
            int(info["frames"]), float(info["fps"]), int(info["width"]), int(info["height"])
        else:
            int(info["rate"]), int(info["samples"])
        return info
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{where}: bad {PROBE_FIELD} ({err})") from None


def media_field_for_suffix(suffix: str) -> str | None:
    """The field name of a video or audio file suffix such as ``.WebM`` (``webm``), or None."""
    field = suffix.lower().lstrip(".")
    return field if field in MEDIA_FIELDS else None


def sniff_media_field(data: bytes) -> str | None:
    """The video or audio field name for a file's bytes judged by their magic number (``webm`` or ``mkv``,
    ``mp4``, ``mov``, ``avi``, ``wav``, ``flac``, ``opus`` or ``ogg``, ``mp3``), or None: how a Parquet
    column of media bytes is named, as :func:`fastio.formats.images.sniff_image_field` names an image column."""
    head = bytes(data[:64])
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # EBML: Matroska, or WebM by its doctype
        return "webm" if b"webm" in head else "mkv"
    if head[4:8] == b"ftyp":
        return "mov" if head[8:12] == b"qt  " else "mp4"
    if head[:4] == b"RIFF":
        return {b"AVI ": "avi", b"WAVE": "wav"}.get(head[8:12])
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "opus" if b"OpusHead" in head else "ogg"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE6 == 0xE2):  # MPEG layer 3
        return "mp3"
    return None


PROBES_NAME = "probes.fxp"
"""The probe table ``fastio index`` writes in DEST beside ``samples.fxi`` (shards it indexes are never rewritten,
so it cannot add ``probe.json`` fields): :func:`write_probe_table`, :class:`ProbeTable`."""
_PROBES_MAGIC = b"FASTIOPB"
_PROBES_VERSION = 1


def write_probe_table(path, rows: list[dict[str, bytes | str]]) -> None:
    """Write the probe table of a dataset's samples (``rows[i]``: sample ``i``'s media fields, each its
    ``probe.json`` bytes (:func:`check_media`) or, for one that could not be probed or read, the reason).

    Layout: ``FASTIOPB``, a little-endian u64 header length, a JSON header (``version``, ``samples``,
    ``unprobed``: per field the count and the first ``[sample, reason]``), zero padding to 8 bytes, int64
    ``offsets[samples + 1]``, then each sample's entry: a JSON object of field -> probe (or ``{"error":
    reason}``); empty for a sample without media."""
    import numpy as np

    unprobed: dict[str, dict[str, Any]] = {}
    blobs = []
    for i, row in enumerate(rows):
        entry = {}
        for field, got in sorted(row.items()):
            if isinstance(got, str):
                entry[field] = {"error": got}
                seen = unprobed.setdefault(field, {"count": 0, "first": [i, got]})
                seen["count"] += 1
            else:
                entry[field] = json.loads(got)
        blobs.append(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() if entry else b"")
    header = json.dumps({"version": _PROBES_VERSION, "samples": len(rows), "unprobed": unprobed},
                        sort_keys=True).encode()
    head = _PROBES_MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * (-len(head) % 8)
    offsets = np.zeros(len(rows) + 1, "<i8")
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    with open(path, "wb") as f:
        f.write(head + offsets.tobytes() + b"".join(blobs))


class ProbeTable:
    """A probe table (:func:`write_probe_table`) over ``data``: the file's bytes or a read-only mapping of it
    (:meth:`open`), of which a lookup reads only its own entry and two offsets. ValueError naming ``where`` when
    its header is not one of ``samples`` samples or its offsets do not reach the end of the file (a truncated or
    extended table); :meth:`check` checks every offset, :meth:`probe` the entry it reads."""

    def __init__(self, data, where: str, samples: int):
        import numpy as np

        try:
            if bytes(data[:8]) != _PROBES_MAGIC:
                raise ValueError("not a probe table (bad magic)")
            size = int.from_bytes(data[8:16], "little")
            header = json.loads(bytes(data[16:16 + size]))
            if header["version"] != _PROBES_VERSION or header["samples"] != samples:
                raise ValueError(f"version {header['version']}, {count(header['samples'], 'sample')}; expected "
                                 f"version {_PROBES_VERSION}, {count(samples, 'sample')}")
            start = 16 + size + (-(16 + size) % 8)
            self._offsets = np.frombuffer(data, "<i8", samples + 1, start)
            self._blob = memoryview(data)[start + 8 * (samples + 1):]
            if self._offsets[0] != 0 or self._offsets[-1] != len(self._blob):
                raise ValueError("offsets do not fit the file (truncated or extended)")
            self.unprobed: dict[str, dict[str, Any]] = header["unprobed"]
            """Per field: ``count`` of samples whose file could not be probed, ``first`` ``[sample, reason]``."""
            self.data = data
            """The bytes or mapping it reads."""
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{where}: {err}") from None
        self.where = where

    @classmethod
    def open(cls, path, where: str, samples: int) -> ProbeTable:
        """The table in file ``path``, memory-mapped read-only (pages shared by a node's processes, read as
        lookups touch them); OSError when it cannot be opened, ValueError as the constructor."""
        import mmap

        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return cls(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b"", where, samples)

    def check(self, chunk: int = 1 << 20) -> None:
        """ValueError naming the table when an offset runs backwards (every offset read, a chunk at a time)."""
        import numpy as np

        for a in range(0, len(self._offsets) - 1, chunk):
            if (np.diff(self._offsets[a:a + chunk + 1]) < 0).any():
                raise ValueError(f"{self.where}: offsets do not fit the file (they run backwards after sample {a})")

    def probe(self, index: int, field: str) -> bytes:
        """The ``probe.json`` bytes of sample ``index``'s ``field``; ValueError naming the sample when the table
        has none (the reason it could not be probed, or no such field) or its entry is damaged."""
        a, b = int(self._offsets[index]), int(self._offsets[index + 1])
        try:
            if not 0 <= a <= b <= len(self._blob):
                raise ValueError(f"entry at {a}..{b} outside the table's {count(len(self._blob), 'byte')}")
            entry = json.loads(self._blob[a:b].tobytes() or b"{}").get(field)
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{self.where}: sample {index}: damaged probe entry ({err})") from None
        if entry is None or "error" in entry:
            why = entry["error"] if entry else f"no {field} field"
            raise ValueError(f"{self.where}: sample {index}: no probe of its {field} ({why})")
        return json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()

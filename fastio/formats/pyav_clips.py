"""A video clip decoded on the CPU with PyAV: the fallback for codecs DALI's CPU decoder does not read (H.264,
HEVC, MPEG-4, AV1: ``fastio convert`` keeps them as they are, for NVDEC on a GPU and this on a CPU).

:func:`decode_clip` counts frames as :func:`fastio.formats.media.probe` does (the packets of the first video
stream, those an mp4 edit list hides included) but numbers them in display order (by presentation time), as
NVDEC does: H.264 with B-frames stores them in decode order (where the container's times are not that order,
as in AVI, by the order the decoder gives them, decoded from the first frame). It demuxes the file (no frame
decoded), starts decoding at the last keyframe shown at or before the clip's first frame, and stops once the
clip's last frame is out, on one thread (the caller runs clips in parallel: PyAV releases the GIL while it
decodes and converts).
"""

from __future__ import annotations

import numpy as np

from fastio.formats.media import MediaCheckError, open_media, video_streams, whole_frames

__all__ = ["CPU_FALLBACKS", "clip_frames", "decode_clip", "undecodable_frame"]

CPU_FALLBACKS = ("auto", "pyav")
"""What ``VideoClips(cpu_fallback=...)`` takes besides None: the CPU decoder of videos DALI's CPU decoder does not
read (``auto``: PyAV on a CPU Loader where a dataset holds such videos, nothing on a GPU)."""

_SKIP_PER_PACKET = ("h264", "hevc", "mpeg4")
"""Decoders that read ``skip_frame`` at each packet, so that frames shown before a clip can be skipped (FFmpeg's
libdav1d wrapper, AV1's decoder, takes it once when it opens: it then dropped the clip's non-reference frames)."""


def clip_frames(first: int, frames: int, stride: int, total: int) -> np.ndarray:
    """int64 [frames]: the frame numbers of a clip: ``first``, ``first + stride``, ...; a frame past the video's
    last (``total - 1``) is the last frame again (DALI's ``pad_mode="edge"``)."""
    return np.minimum(first + stride * np.arange(frames, dtype=np.int64), total - 1)


def decode_clip(data: bytes, first: int, frames: int, stride: int) -> np.ndarray:
    """uint8 [frames, H, W, 3]: the RGB frames :func:`clip_frames` names of video ``data``, in display order.
    MediaCheckError (why, one line) when PyAV cannot demux or decode them, or one is not of the video's size (its
    first: the probe's)."""
    import av

    try:
        with open_media(data) as container:
            stream = video_streams(container)[0]
            stream.codec_context.thread_count = 1  # parallel across clips, not inside one
            size = (stream.height, stream.width)  # the probe's
            packets = [_kept(p) for p in container.demux(stream) if p.size and p.pts is not None]
            packets = packets[:whole_frames([p.is_corrupt for p in packets])]  # the frames the probe counts
            if not packets:
                raise MediaCheckError("cannot be decoded (no frames)")
            shown = sorted(p.pts for p in packets)  # frame f of the video is shown at shown[f]
            wanted = clip_frames(first, frames, stride, len(shown)).tolist()
            by_pts = _decode_from_keyframe(stream, packets, shown[wanted[0]], {shown[f] for f in wanted})
            got = _decode_from_start(stream, packets, set(wanted)) if by_pts is None else \
                {f: by_pts[shown[f]] for f in wanted if shown[f] in by_pts}
    except (av.FFmpegError, IndexError) as err:
        raise MediaCheckError(f"cannot be decoded by PyAV ({getattr(err, 'strerror', None) or err})") from None
    missing = [f for f in wanted if f not in got]
    if missing:
        raise MediaCheckError(f"cannot be decoded by PyAV (frame {missing[0]} did not come out)")
    for f in wanted:
        if got[f].shape[:2] != size:
            raise MediaCheckError(f"its frame size changes mid-stream ({size[1]} x {size[0]}, then {got[f].shape[1]} x "
                                  f"{got[f].shape[0]} at frame {f}): clips are cropped and resized by its first "
                                  "size; re-encode it at one size")
    return np.stack([got[f] for f in wanted])


def undecodable_frame(data: bytes) -> str | None:
    """Why PyAV cannot decode every frame of video ``data`` (``frame 10: ...``, one line), or None: each packet
    of its first video stream decoded in turn (frames not converted, nothing kept: a long video costs its decode,
    not its frames' memory), but a partial last frame (:func:`~fastio.formats.media.whole_frames`). Asked only
    after a clip failed, of each sample of the batch in turn."""
    import av

    decoded = 0
    try:
        with open_media(data) as container:
            stream = video_streams(container)[0]
            stream.codec_context.thread_count = 1
            held = []  # corrupt packets, decoded once a whole one follows: a partial last frame is not a frame
            for packet in container.demux(stream):
                if not packet.size:  # the demuxer's end: the decoder flushed, held partial frames left out
                    decoded += len(stream.codec_context.decode(None))
                    continue
                if packet.is_corrupt:
                    held.append(packet)
                    continue
                for p in [*held, packet]:
                    decoded += len(stream.codec_context.decode(p))
                held = []
    except (av.FFmpegError, IndexError) as err:
        return f"frame {decoded}: {getattr(err, 'strerror', None) or err}"
    return None


def _kept(packet):
    """``packet``, or for one an edit list hides (flagged discard: FFmpeg's decoder drops its frame) a copy
    without the flag: the probe counts it as a frame of the video, and clip starts are drawn over those."""
    if not packet.is_discard:
        return packet
    import av

    copy = av.Packet(bytes(packet))
    copy.pts, copy.dts, copy.time_base, copy.is_keyframe = packet.pts, packet.dts, packet.time_base, \
        packet.is_keyframe
    return copy


def _decode_from_keyframe(stream, packets: list, first_pts: int, want: set[int]) -> dict[int, np.ndarray] | None:
    """RGB frames by presentation time, those in ``want``: packets decoded from the last keyframe (in decode
    order) shown at or before ``first_pts``, until every wanted frame is out (the decoder flushed at the end);
    non-reference frames shown before ``first_pts`` skipped. None when the decoder gives a frame of an earlier
    time than the one before it: the container's times are not the display order (AVI keeps none: FFmpeg's
    demuxer numbers packets in decode order)."""
    start = max((k for k, p in enumerate(packets) if p.is_keyframe and p.pts <= first_pts), default=0)
    got: dict[int, np.ndarray] = {}
    codec, skipping, last = stream.codec_context, None, None
    for packet in [*packets[start:], None]:
        # A frame shown before the clip that no other frame refers to (a non-reference B-frame) is not decoded:
        # nothing needs it, so the clip's frames are the same (tested bit for bit), and about a fifth less CPU.
        # Only FFmpeg's own decoders read skip_frame per packet (libdav1d's wrapper takes it once, at open).
        skip = packet is not None and packet.pts < first_pts and codec.name in _SKIP_PER_PACKET
        if skip is not skipping:
            codec.skip_frame, skipping = ("NONREF" if skip else "DEFAULT"), skip
        for frame in codec.decode(packet):
            if frame.pts is not None and last is not None and frame.pts < last:
                return None
            last = frame.pts if frame.pts is not None else last
            if frame.pts in want:
                got[frame.pts] = frame.to_ndarray(format="rgb24")
        if len(got) == len(want):
            break
    return got


def _decode_from_start(stream, packets: list, want: set[int]) -> dict[int, np.ndarray]:
    """RGB frames by frame number, those in ``want``: every packet decoded from the first, the frames numbered as
    the decoder gives them (in display order), whatever times the container gives them."""
    codec = stream.codec_context
    codec.flush_buffers()
    codec.skip_frame = "DEFAULT"
    got: dict[int, np.ndarray] = {}
    n = 0
    for packet in [*packets, None]:
        for frame in codec.decode(packet):
            if n in want:
                got[n] = frame.to_ndarray(format="rgb24")
            n += 1
        if n > max(want):
            break
    return got

"""The frame size a VP8 or VP9 keyframe's header says, read from its packet's bytes (no frame decoded).

A VP8 or VP9 stream may change its frame size at a keyframe (a WebRTC recording switching resolution); the probe
(:func:`fastio.formats.media.probe`) demuxes and records the stream's first size, and DALI's CPU decoder returned
the frames after such a change wrong (mostly black). Reading each keyframe's size finds the change without decoding.
VP8: the keyframe's start code ``9d 01 2a`` then width and height (14 bits each, little-endian; RFC 6386, 9.1).
VP9: the uncompressed header (VP9 bitstream specification, 6.2): frame marker, profile, then for a keyframe its sync
code ``49 83 42``, colour config and ``frame_width_minus_1``, ``frame_height_minus_1`` (16 bits each). A VP9 size
change on a frame that is not a keyframe (reference scaling) is not read.
"""

from __future__ import annotations

__all__ = ["VPX_CODECS", "keyframe_size"]

VPX_CODECS = ("vp8", "vp9")
"""The codecs whose keyframes :func:`keyframe_size` reads."""


class _Bits:
    """Big-endian bits of ``data``, read from the first."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def read(self, n: int) -> int:
        value = 0
        for _ in range(n):
            byte = self.data[self.at >> 3] if self.at >> 3 < len(self.data) else 0
            value = value << 1 | (byte >> (7 - (self.at & 7))) & 1
            self.at += 1
        return value


def _vp9_size(packet: bytes) -> tuple[int, int] | None:
    bits = _Bits(packet)
    if bits.read(2) != 2:  # frame marker
        return None
    profile = bits.read(1) | bits.read(1) << 1
    if profile == 3:
        bits.read(1)
    if bits.read(1) or bits.read(1):  # show_existing_frame; frame_type 1: not a keyframe
        return None
    bits.read(2)  # show_frame, error_resilient_mode
    if bits.read(24) != 0x498342:
        return None
    if profile >= 2:
        bits.read(1)  # ten_or_twelve_bit
    if bits.read(3) != 7:  # colour space not RGB: colour range, then subsampling for profiles 1 and 3
        bits.read(1)
        bits.read(3 if profile in (1, 3) else 0)
    else:
        bits.read(1 if profile in (1, 3) else 0)
    return bits.read(16) + 1, bits.read(16) + 1


def _vp8_size(packet: bytes) -> tuple[int, int] | None:
    if len(packet) < 10 or packet[0] & 1 or bytes(packet[3:6]) != b"\x9d\x01\x2a":  # bit 0: 1 is an inter frame
        return None
    return int.from_bytes(packet[6:8], "little") & 0x3FFF, int.from_bytes(packet[8:10], "little") & 0x3FFF


def keyframe_size(codec: str, packet: bytes) -> tuple[int, int] | None:
    """``(width, height)`` a VP8 or VP9 (``codec``) keyframe's header says; None for another codec, a packet that
    is not a keyframe's, or a header it does not parse."""
    read = {"vp8": _vp8_size, "vp9": _vp9_size}.get(codec)
    return read(bytes(packet)) if read is not None else None

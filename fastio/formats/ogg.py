"""How DALI's audio decoder (libsndfile 1.2) delivers an Ogg file, next to FFmpeg (PyAV, the probe).

FFmpeg decodes Opus at 48 kHz and drops the header's pre-skip (``OpusHead``: the encoder's delay, 312 samples from
libopus). libsndfile decodes at the smallest Opus rate at or above the header's input rate (8, 12, 16, 24 kHz, else
48 kHz) and drops the pre-skip less the first audio page's start (its granule position less the samples of the
packets it completes): a file FFmpeg wrote starts at 312, so DALI delivered its 312 pre-skip samples (104 at 16 kHz)
before the sound, and that many of the sound's last samples not at all; an opusenc or libsndfile file starts at 0
and both decoders agree. Ogg Vorbis starts where FFmpeg starts, and ends at the last page's granule position,
where FFmpeg's count may be off by up to a block (libvorbis files: 44,160 samples of 44,100, or 16,128 of 16,000).
Measured with DALI 2.4 (tests/test_audio_onsets.py).
"""

from __future__ import annotations

__all__ = ["OPUS_RATES", "chained", "dali_opus_layout", "last_granule"]

OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
"""The rates libopus decodes at."""

_FRAME_SIZES = {0: (480, 960, 1920, 2880), 1: (480, 960), 2: (120, 240, 480, 960)}  # SILK, hybrid, CELT (48 kHz)


def _pages(data: bytes):
    """``(granule, flags, packets completed on the page)`` of each Ogg page, from the start; stops at bytes that
    are not a page."""
    at, pending = 0, []
    while bytes(data[at:at + 4]) == b"OggS" and at + 27 <= len(data):
        granule, flags, count = int.from_bytes(data[at + 6:at + 14], "little", signed=True), data[at + 5], data[at + 26]
        lacing = data[at + 27:at + 27 + count]
        at += 27 + count
        packets = []
        for size in lacing:
            pending.append(data[at:at + size])
            at += size
            if size < 255:
                packets.append(b"".join(pending))
                pending = []
        yield granule, flags, packets


def _packet_samples(packet: bytes) -> int:
    """Samples at 48 kHz of one Opus packet, from its TOC byte (RFC 6716, 3.1)."""
    if not packet:
        return 0
    config, code = packet[0] >> 3, packet[0] & 3
    mode = 0 if config < 12 else 1 if config < 16 else 2
    size = _FRAME_SIZES[mode][(config - (0, 12, 16)[mode]) % len(_FRAME_SIZES[mode])]
    frames = 1 if code == 0 else 2 if code in (1, 2) else (packet[1] & 0x3F if len(packet) > 1 else 0)
    return size * frames


def dali_opus_layout(data: bytes) -> tuple[int, int] | None:
    """``(rate, lead)``: the rate DALI's audio decoder decodes Ogg Opus ``data`` at, and how many samples (at that
    rate) it delivers before the first sample FFmpeg delivers (module docstring); None when ``data`` is not Ogg Opus
    with an audio page."""
    head, seen = None, 0
    for granule, flags, packets in _pages(memoryview(data)):  # read in place (a batch's bytes)
        for packet in packets:
            seen += 1
            if seen == 1 and packet[:8] == b"OpusHead" and len(packet) >= 16:
                head = int.from_bytes(packet[10:12], "little"), int.from_bytes(packet[12:16], "little")
        if head is None:
            return None
        if seen > 2 and packets:  # the first page completing an audio packet (OpusHead, OpusTags before it)
            audio = packets[-(seen - 2):] if seen - 2 < len(packets) else packets
            start = 0 if flags & 4 else max(granule - sum(_packet_samples(p) for p in audio), 0)
            pre_skip, input_rate = head
            rate = next((r for r in OPUS_RATES if input_rate <= r), 48000)
            factor = 48000 // rate
            lead = round(pre_skip / factor) - max(pre_skip - start, 0) // factor
            return rate, max(lead, 0)
    return None


def chained(data: bytes) -> bool:
    """Whether Ogg ``data`` is chained: a stream begins (a page flagged beginning-of-stream) after a page of an
    earlier one, as in Ogg files written one after another (a recorded radio stream, ``cat a.opus b.opus``). FFmpeg
    reads every stream of the chain, libsndfile (DALI's audio decoder) the first only. Reads the page headers only;
    stops at bytes that are not a page."""
    at, began = 0, False
    while bytes(data[at:at + 4]) == b"OggS" and at + 27 <= len(data):
        flags, count = data[at + 5], data[at + 26]
        if flags & 2 and began:
            return True
        began = began or not flags & 2
        at += 27 + count + sum(data[at + 27:at + 27 + count])
    return False


_MAX_PAGE = 27 + 255 + 255 * 255
"""An Ogg page's largest size: the last one starts within that many bytes of the end."""


def last_granule(data: bytes) -> int | None:
    """The granule position of the last Ogg page of ``data`` (an Ogg Vorbis file's samples, as libsndfile reads
    it), None when its end is not an Ogg page."""
    tail = bytes(data[-_MAX_PAGE:])
    at = tail.rfind(b"OggS")
    while at >= 0:
        count = tail[at + 26] if at + 27 <= len(tail) else -1
        if count >= 0 and at + 27 + count + sum(tail[at + 27:at + 27 + count]) == len(tail):
            granule = int.from_bytes(tail[at + 6:at + 14], "little", signed=True)
            return granule if granule >= 0 else None
        at = tail.rfind(b"OggS", 0, at)
    return None

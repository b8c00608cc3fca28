"""What an mp4/mov's sample tables will cost FFmpeg, read from box headers before FFmpeg opens it.

FFmpeg's mov demuxer builds an index entry for every sample a track's `stsz`/`stz2` (or a
fragment's `trun`) declares, however few bytes back it: a constant-size `stsz` states a count
with no table at all, so a 1.4 KB file declaring 85M samples costs gigabytes on open. Its edit
list handling (`mov_fix_index`) rescans the index per `elst` entry, so 100,000 entries in a
1.2 MB file take minutes. `check_mp4_index` walks only the boxes that lead to those counts
(`moov/trak/mdia/minf/stbl`, `moov/trak/edts/elst`, `moof/traf/trun`), reading box headers and
the counts themselves (a few bytes each), and refuses a file over the caps before `av.open`.
Nothing here allocates in proportion to what a file declares.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from packtrain.core.contract import RejectReason
from packtrain.core.errors import MediaError

MAX_SAMPLES = 1_000_000
"""Most samples (video frames, audio packets) all tracks of one file may declare together. One
index entry each is what FFmpeg allocates on open; a million covers hours of 30 fps video with its
audio (an hour: 108,000 frames and about 170,000 AAC packets), far past what a training sample
uses, while keeping the index FFmpeg builds to tens of MB. Each table's entry count (`stts`,
`ctts`, `stsc`, `stss`, `stco`/`co64`) is held to it too: each entry describes at least one
sample or chunk."""
MAX_EDITS = 1_000
"""Most edit-list (`elst`) entries all tracks of one file may declare together. Real files have one
or two per track (a start offset, an empty edit); FFmpeg's work grows with entries x samples."""
MAX_BOXES = 1_000_000
"""Most boxes walked: bounds the walk itself (a file of 8-byte boxes has one per 8 bytes)."""

# Parent → the children that lead to a count; other boxes are skipped by their header alone.
_DESCEND: dict[bytes, frozenset[bytes]] = {
    b"": frozenset({b"moov", b"moof"}),
    b"moov": frozenset({b"trak"}),
    b"trak": frozenset({b"mdia", b"edts"}),
    b"mdia": frozenset({b"minf"}),
    b"minf": frozenset({b"stbl"}),
    b"edts": frozenset({b"elst"}),
    b"moof": frozenset({b"traf"}),
    b"traf": frozenset({b"trun"}),
}
# Sample-count boxes: where the count sits in the payload (after version, flags and any sample size).
_SAMPLE_COUNT_AT = {b"stsz": 8, b"stz2": 8, b"trun": 4}
_TABLES = frozenset({b"stts", b"ctts", b"stsc", b"stss", b"stco", b"co64"})


@dataclass
class _Tally:
    samples: int = 0
    edits: int = 0
    boxes: int = 0


def check_mp4_index(source: bytes | BinaryIO) -> None:
    """Refuse an mp4/mov whose sample tables or edit lists would be costly to index, or whose boxes
    run past their parent: MediaError(`media_too_large` / `corrupt_media` / `unsupported_media`).

    A file object is read from its start and left where it was.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source)
        _walk(lambda at, n: bytes(view[at : at + n]), 0, len(view), b"", _Tally())
        return
    here = source.tell()
    try:
        size = source.seek(0, os.SEEK_END)

        def read(at: int, n: int) -> bytes:
            source.seek(at)
            return source.read(n)

        _walk(read, 0, size, b"", _Tally())
    finally:
        source.seek(here)


def _corrupt(detail: str) -> MediaError:
    return MediaError(RejectReason.CORRUPT_MEDIA, f"mp4 structure: {detail}")


def _walk(read: Callable[[int, int], bytes], start: int, end: int, parent: bytes, tally: _Tally) -> None:
    """The boxes between `start` and `end` (the payload of `parent`; b"" is the file)."""
    pos = start
    while end - pos >= 8:
        tally.boxes += 1
        if tally.boxes > MAX_BOXES:
            raise MediaError(RejectReason.MEDIA_TOO_LARGE, f"mp4 has more than {MAX_BOXES} boxes")
        head = read(pos, 16)
        size, kind = struct.unpack(">I4s", head[:8])
        header = 8
        if size == 1:
            if len(head) < 16:
                raise _corrupt(f"box {kind!r} at byte {pos} is cut off in its header")
            (size,) = struct.unpack(">Q", head[8:16])
            header = 16
        elif size == 0:
            size = end - pos  # to the end of its parent
        if size < header:
            raise _corrupt(f"box {kind!r} at byte {pos} declares {size} bytes, less than its header")
        if pos + size > end:
            if not parent and kind not in _DESCEND[b""]:
                return  # a cut-off last box (mdat, say): FFmpeg reads what is there
            where = f"its parent {parent!r}" if parent else "the file"
            raise _corrupt(f"box {kind!r} at byte {pos} declares {size} bytes, past the end of {where}")
        if parent == b"moov" and kind == b"cmov":
            raise MediaError(
                RejectReason.UNSUPPORTED_MEDIA,
                "mp4 has a compressed movie header (cmov), whose sample tables cannot be bounded unread",
            )
        if kind in _DESCEND.get(parent, ()):
            if kind == b"elst" or kind == b"trun":
                _count(read, pos + header, pos + size, kind, tally)
            else:
                _walk(read, pos + header, pos + size, kind, tally)
        elif parent == b"stbl" and (kind in _SAMPLE_COUNT_AT or kind in _TABLES):
            _count(read, pos + header, pos + size, kind, tally)
        pos += size


def _count(read: Callable[[int, int], bytes], start: int, end: int, kind: bytes, tally: _Tally) -> None:
    """The count a full box states after its version and flags, checked against its cap."""
    at = _SAMPLE_COUNT_AT.get(kind, 4)  # bytes of the payload before the count
    if end - start < at + 4:
        raise _corrupt(f"{kind.decode('latin-1')} box at byte {start} is too short for its count")
    (count,) = struct.unpack(">I", read(start + at, 4))
    name = kind.decode("latin-1")
    if kind == b"elst":
        tally.edits += count
        if tally.edits > MAX_EDITS:
            raise MediaError(
                RejectReason.MEDIA_TOO_LARGE,
                f"mp4 edit lists declare {tally.edits} entries or more, over {MAX_EDITS}; not opened",
            )
    elif kind in _SAMPLE_COUNT_AT:
        tally.samples += count
        if tally.samples > MAX_SAMPLES:
            raise MediaError(
                RejectReason.MEDIA_TOO_LARGE,
                f"mp4 sample tables declare {tally.samples} samples or more ({name}), over {MAX_SAMPLES}; "
                "not opened",
            )
    elif count > MAX_SAMPLES:
        raise MediaError(
            RejectReason.MEDIA_TOO_LARGE,
            f"mp4 {name} table declares {count} entries, over {MAX_SAMPLES}; not opened",
        )

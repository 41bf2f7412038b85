"""What counts as bad image data, shared by the sharder (preprocess) and the loader (pipeline).

Both decode untrusted image bytes with Pillow and must sort its exceptions the
same way: these are data errors (skip and count), anything else is a bug.
"""

from __future__ import annotations

# Exceptions Pillow's own fuzzers accept from decoders of hostile files
# (Tests/oss-fuzz), plus EOFError, raised by some plugins on data that stops
# early. MemoryError counts as data: the pixel cap bounds what a legitimate
# image may allocate, so running out points at the file.
DECODER_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    NotImplementedError,
    OverflowError,
    EOFError,
    MemoryError,
)


def riff_truncated(data: bytes) -> bool:
    """True for a WebP whose RIFF header declares more bytes than there are.

    libwebp reports such a file only as "could not create decoder object",
    so the length check is what tells a cut file from a corrupt one.
    """
    if not (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return False
    return int.from_bytes(data[4:8], "little") + 8 > len(data)

"""An upload's format and size from its first bytes, in plain Python (no Pillow, no decode).

The image classifier's handler reads it for every upload (about 3 us, where Pillow's
``Image.open`` took 170 us): a non-image, a decompression bomb or an absurd aspect ratio is
refused before any pixel is decoded, and JPEGs of 1 or 3 components go to the device
decoder, the rest to Pillow, which checks the same limits again before it decodes. Only the
formats a photo or screenshot comes in are read (``UPLOAD_FORMATS``). It imports nothing
heavy: a front end screens every upload with it (``screen_upload``) before its bytes cross
to the engine, refusing an image over the server's limits or with a broken header; what is
not an image at all is left to the model's handler, which alone knows what its uploads
must be.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from app.errors import BadRequest, PayloadTooLarge

# The formats an upload may be, and the only Pillow plugins ever tried on one: photos and
# screenshots. Pillow reads 40-odd more, some through external programs (EPS runs
# Ghostscript) or rarely exercised parsers; none of them is a photo a client sends.
UPLOAD_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")
# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman and
# arithmetic); C4 (DHT), C8 (JPG) and CC (DAC) are not frames.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_ARITHMETIC = frozenset({0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_LOSSLESS = frozenset({0xC3, 0xC7, 0xCB, 0xCF})


@dataclass(frozen=True)
class Header:
    format: str
    width: int
    height: int
    components: int = 3
    """Colour components (JPEG: 1 grey, 3 YCbCr, 4 CMYK or YCCK); 3 for the others."""
    device_decodable: bool = False
    """A JPEG nvJPEG decodes as Pillow does: 8-bit Huffman, grey or YCbCr."""


SCREENED_BYTES = 64 * 1024


def image_format(head: bytes) -> str | None:
    """Which of ``UPLOAD_FORMATS`` bytes beginning with ``head`` (12 bytes are enough) are,
    by their signature; None for any other."""
    if head.startswith(b"\xff\xd8"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head.startswith(b"BM"):
        return "BMP"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def screen_upload(data: bytes | memoryview, max_pixels: int, max_aspect: float | None) -> None:
    """Refuse (``read_header``'s 400 or 413) an upload that begins like one of
    ``UPLOAD_FORMATS`` but is over the limits or cut short; pass anything else, for the
    model's handler to take or refuse. Only the first ``SCREENED_BYTES`` are read (a JPEG's
    markers are walked in Python: megabytes of fill bytes would hold the front end's loop
    for a second); a header not found in them is left to the handler, which reads it all."""
    if image_format(bytes(data[:12])) is not None:
        try:
            read_header(data[:SCREENED_BYTES], max_pixels, max_aspect)
        except BadRequest:
            if len(data) <= SCREENED_BYTES:
                raise


def read_header(
    data: bytes | memoryview, max_pixels: int, max_aspect: float | None = None
) -> Header:
    """The upload's header; 400 for what is not one of ``UPLOAD_FORMATS`` (or is cut short
    before its size), 413 for more than ``max_pixels`` pixels or, where given, a side longer
    than ``max_aspect`` times the other."""
    head = bytes(data[:32])
    kind = image_format(head)
    try:
        if kind == "JPEG":
            header = _jpeg(data)
        elif kind == "PNG":
            header = _png(head)
        elif kind == "GIF":
            width, height = struct.unpack_from("<HH", head, 6)
            header = Header("GIF", width, height)
        elif kind == "BMP":
            header = _bmp(head)
        elif kind == "WEBP":
            header = _webp(head)
        else:
            raise BadRequest(
                f"cannot decode image: {len(data)} bytes that are not an image format this "
                f"server reads ({', '.join(UPLOAD_FORMATS)})"
            )
    except (struct.error, IndexError) as exc:
        raise BadRequest(
            f"cannot decode image: its header is cut short ({len(data)} bytes)"
        ) from exc
    width, height = header.width, header.height
    if width <= 0 or height <= 0:
        raise BadRequest(f"cannot decode image: a {header.format} of {width}x{height} pixels")
    if width * height > max_pixels:
        raise PayloadTooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
        )
    if max_aspect is not None and max(width, height) > max_aspect * min(width, height):
        # Its resize to the model's shorter side would scale the longer side past all
        # proportion before the crop: refused from the header, before any pixel.
        raise PayloadTooLarge(
            f"image is {width}x{height}, an aspect ratio over {max_aspect:g}:1 (the limit); "
            "crop it first"
        )
    return header


def _jpeg(data: bytes | memoryview) -> Header:
    """The first frame header's size: markers walked from the start, segments skipped by
    their lengths (the entropy-coded data begins only after SOS, which comes later)."""
    at, end = 2, len(data)
    while at < end:
        if data[at] != 0xFF:
            raise BadRequest("cannot decode image: a JPEG whose markers are broken")
        while at < end and data[at] == 0xFF:  # fill bytes
            at += 1
        marker = data[at]
        at += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            continue
        if marker in (0xD9, 0xDA):
            break
        (length,) = struct.unpack_from(">H", data, at)
        if marker in _SOF:
            precision, height, width, components = struct.unpack_from(">BHHB", data, at + 2)
            decodable = (
                precision == 8
                and components in (1, 3)
                and marker not in _ARITHMETIC
                and marker not in _LOSSLESS
            )
            return Header("JPEG", width, height, components, decodable)
        if length < 2:
            raise BadRequest("cannot decode image: a JPEG whose markers are broken")
        at += length
    raise BadRequest("cannot decode image: a JPEG without a frame header")


def _png(head: bytes) -> Header:
    if head[12:16] != b"IHDR":
        raise BadRequest("cannot decode image: a PNG without its IHDR chunk first")
    width, height = struct.unpack_from(">II", head, 16)
    return Header("PNG", width, height)


def _bmp(head: bytes) -> Header:
    (size,) = struct.unpack_from("<I", head, 14)
    if size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack_from("<HH", head, 18)
    else:
        width, height = struct.unpack_from("<ii", head, 18)
    return Header("BMP", abs(width), abs(height))  # a negative height: rows top-down


def _webp(head: bytes) -> Header:
    chunk = head[12:16]
    if chunk == b"VP8 ":  # lossy: a key frame's start code, then 14-bit sizes
        if head[23:26] != b"\x9d\x01\x2a":
            raise BadRequest("cannot decode image: a WEBP whose VP8 frame is broken")
        width, height = struct.unpack_from("<HH", head, 26)
        return Header("WEBP", width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8L":  # lossless: a signature byte, then 14 bits each of size - 1
        if head[20] != 0x2F:
            raise BadRequest("cannot decode image: a WEBP whose VP8L header is broken")
        (bits,) = struct.unpack_from("<I", head, 21)
        return Header("WEBP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X":  # extended: 24-bit canvas sizes - 1
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return Header("WEBP", width, height)
    raise BadRequest("cannot decode image: a WEBP of an unknown kind")

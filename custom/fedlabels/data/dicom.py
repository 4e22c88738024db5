"""Just enough DICOM for the RSNA hemorrhage CTs: header fields and pixels.

Uses pydicom when it is installed (``pip install fedlabels[dicom]``); without it
a small built-in reader handles uncompressed little-endian files (implicit or
explicit VR), which is what the RSNA challenge distributes. Compressed
transfer syntaxes need pydicom and fail with a message saying so.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .common import PrepareError

IMPLICIT_LE = "1.2.840.10008.1.2"
EXPLICIT_LE = "1.2.840.10008.1.2.1"
_LONG_VRS = {b"OB", b"OD", b"OF", b"OL", b"OW", b"SQ", b"UC", b"UR", b"UT", b"UN", b"OV", b"SV", b"UV"}
UNDEFINED = 0xFFFFFFFF

TAGS = {
    (0x0008, 0x0018): "SOPInstanceUID",
    (0x0010, 0x0020): "PatientID",
    (0x0020, 0x000D): "StudyInstanceUID",
    (0x0020, 0x000E): "SeriesInstanceUID",
    (0x0028, 0x0002): "SamplesPerPixel",
    (0x0028, 0x0004): "PhotometricInterpretation",
    (0x0028, 0x0010): "Rows",
    (0x0028, 0x0011): "Columns",
    (0x0028, 0x0100): "BitsAllocated",
    (0x0028, 0x0101): "BitsStored",
    (0x0028, 0x0103): "PixelRepresentation",
    (0x0028, 0x1052): "RescaleIntercept",
    (0x0028, 0x1053): "RescaleSlope",
}
_US = {"SamplesPerPixel", "Rows", "Columns", "BitsAllocated", "BitsStored", "PixelRepresentation"}
_DS = {"RescaleIntercept", "RescaleSlope"}
PIXEL_DATA = (0x7FE0, 0x0010)


class _Reader:
    def __init__(self, buf: bytes, path: Path):
        self.buf, self.path = buf, path

    def fail(self, why):
        raise PrepareError(f"{self.path}: not a readable DICOM file ({why})")

    def element(self, pos, explicit):
        """(tag, vr, length, value_pos) of the element at pos."""
        if pos + 8 > len(self.buf):
            self.fail("truncated")
        group, elem = struct.unpack_from("<HH", self.buf, pos)
        tag = (group, elem)
        if group == 0xFFFE:  # item / delimiters never carry a VR
            (length,) = struct.unpack_from("<I", self.buf, pos + 4)
            return tag, None, length, pos + 8
        if explicit:
            vr = self.buf[pos + 4: pos + 6]
            if vr in _LONG_VRS:
                if pos + 12 > len(self.buf):
                    self.fail("truncated")
                (length,) = struct.unpack_from("<I", self.buf, pos + 8)
                return tag, vr, length, pos + 12
            (length,) = struct.unpack_from("<H", self.buf, pos + 6)
            return tag, vr, length, pos + 8
        (length,) = struct.unpack_from("<I", self.buf, pos + 4)
        return tag, None, length, pos + 8

    def skip_sequence(self, pos, explicit):
        """Skip an undefined-length sequence starting at its first item; return the end."""
        while True:
            tag, _vr, length, vpos = self.element(pos, explicit)
            if tag == (0xFFFE, 0xE0DD):  # sequence delimiter
                return vpos
            if tag != (0xFFFE, 0xE000):
                self.fail(f"unexpected tag {tag[0]:04X},{tag[1]:04X} inside a sequence")
            if length != UNDEFINED:
                pos = vpos + length
                continue
            pos = vpos
            while True:  # elements of an undefined-length item
                tag, vr, length, vpos = self.element(pos, explicit)
                if tag == (0xFFFE, 0xE00D):
                    pos = vpos
                    break
                pos = self.skip_sequence(vpos, explicit) if length == UNDEFINED else vpos + length


def _parse(path: Path, want_pixels: bool) -> dict:
    buf = path.read_bytes() if want_pixels else _head(path)
    r = _Reader(buf, path)
    pos, syntax = 0, IMPLICIT_LE
    if len(buf) >= 132 and buf[128:132] == b"DICM":
        pos = 132
        while pos + 8 <= len(buf) and struct.unpack_from("<H", buf, pos)[0] == 0x0002:
            tag, _vr, length, vpos = r.element(pos, True)
            if tag == (0x0002, 0x0010):
                syntax = buf[vpos: vpos + length].decode("ascii", "replace").strip("\0 ")
            pos = vpos + length
    elif not buf[:4] or struct.unpack_from("<H", buf, 0)[0] not in (0x0002, 0x0008):
        r.fail("no DICM preamble")
    if syntax not in (IMPLICIT_LE, EXPLICIT_LE):
        raise PrepareError(f"{path}: compressed or big-endian DICOM (transfer syntax {syntax}); "
                           "install pydicom (pip install 'fedlabels[dicom]') to read it")
    explicit = syntax == EXPLICIT_LE
    out: dict = {}
    while pos + 8 <= len(buf):
        tag, vr, length, vpos = r.element(pos, explicit)
        if tag == PIXEL_DATA:
            if length == UNDEFINED:
                raise PrepareError(f"{path}: encapsulated (compressed) pixel data; install pydicom to read it")
            out["_pixels"] = (vpos, length)
            break
        if length == UNDEFINED:
            pos = r.skip_sequence(vpos, explicit)
            continue
        name = TAGS.get(tag)
        if name is not None:
            raw = buf[vpos: vpos + length]
            if name in _US:
                out[name] = struct.unpack_from("<H", raw)[0] if len(raw) >= 2 else None
            elif name in _DS:
                out[name] = float(raw.decode("ascii").strip("\0 ").split("\\")[0] or 0)
            else:
                out[name] = raw.decode("ascii", "replace").strip("\0 ")
        pos = vpos + length
        if not want_pixels and tag > (0x0028, 0x1053):
            break
    return out, buf


def _head(path: Path, size=16384) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def read_dicom_header(path) -> dict:
    """Selected header fields (PatientID, Rows, ...) without reading the pixels."""
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"{path}: DICOM file not found")
    try:
        import pydicom
    except ImportError:
        pydicom = None
    if pydicom is not None:
        try:
            ds = pydicom.dcmread(str(path), stop_before_pixels=True)
        except Exception as e:  # noqa: BLE001 - any decoder failure is a bad file
            raise PrepareError(f"{path}: not a readable DICOM file ({e})") from None
        return {name: getattr(ds, name, None) for name in TAGS.values()}
    try:
        header, _ = _parse(path, want_pixels=False)
    except PrepareError as e:
        if "truncated" not in str(e):
            raise
        header, _ = _parse(path, want_pixels=True)
    header.pop("_pixels", None)
    return header


def read_dicom_pixels(path) -> np.ndarray:
    """Pixels in Hounsfield units (float32, HxW), rescale slope/intercept applied.

    Applies the known RSNA-ICH fix: 12-bit unsigned images stored with a
    wrong intercept (> -100) are shifted back so air reads about -1000 HU.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepareError(f"{path}: DICOM file not found")
    try:
        import pydicom
    except ImportError:
        pydicom = None
    if pydicom is not None:
        try:
            ds = pydicom.dcmread(str(path))
            px = ds.pixel_array
        except Exception as e:  # noqa: BLE001
            raise PrepareError(f"{path}: not a readable DICOM file ({e})") from None
        hdr = {name: getattr(ds, name, None) for name in TAGS.values()}
    else:
        hdr, buf = _parse(path, want_pixels=True)
        if "_pixels" not in hdr:
            raise PrepareError(f"{path}: not a readable DICOM file (no pixel data)")
        rows, cols, bits = hdr.get("Rows"), hdr.get("Columns"), hdr.get("BitsAllocated")
        if not rows or not cols or bits not in (8, 16):
            raise PrepareError(f"{path}: not a readable DICOM file (rows={rows}, columns={cols}, bits={bits})")
        if (hdr.get("SamplesPerPixel") or 1) != 1:
            raise PrepareError(f"{path}: expected a single-channel CT image")
        signed = hdr.get("PixelRepresentation") == 1
        dtype = {(8, False): "<u1", (8, True): "<i1", (16, False): "<u2", (16, True): "<i2"}[(bits, signed)]
        start, length = hdr["_pixels"]
        need = rows * cols * bits // 8
        if length < need or start + need > len(buf):
            raise PrepareError(f"{path}: not a readable DICOM file (truncated pixel data)")
        px = np.frombuffer(buf, dtype=dtype, count=rows * cols, offset=start).reshape(rows, cols)
    px = px.astype(np.float32)
    slope = float(hdr.get("RescaleSlope") or 1.0)
    intercept = float(hdr.get("RescaleIntercept") or 0.0)
    if hdr.get("BitsStored") == 12 and hdr.get("PixelRepresentation") == 0 and intercept > -100:
        px = px + 1000
        px[px >= 4096] -= 4096
        intercept = -1000.0
    return px * slope + intercept


def write_dicom(path, pixels: np.ndarray, patient_id: str, sop_uid: str = "1.2.3", intercept: float = -1024.0,
                slope: float = 1.0, explicit: bool = True) -> None:
    """Write a minimal uncompressed CT DICOM (used to build test fixtures)."""
    pixels = np.asarray(pixels)
    signed = pixels.dtype.kind == "i"
    data = pixels.astype("<i2" if signed else "<u2").tobytes()

    def el(group, elem, vr, value: bytes, expl=True):
        if len(value) % 2:
            value += b" " if vr not in (b"OB", b"OW", b"UI") else b"\0"
        if not expl:
            return struct.pack("<HHI", group, elem, len(value)) + value
        if vr in _LONG_VRS:
            return struct.pack("<HH", group, elem) + vr + b"\0\0" + struct.pack("<I", len(value)) + value
        return struct.pack("<HH", group, elem) + vr + struct.pack("<H", len(value)) + value

    syntax = (EXPLICIT_LE if explicit else IMPLICIT_LE).encode()
    meta_body = el(0x0002, 0x0001, b"OB", b"\0\1") + el(0x0002, 0x0010, b"UI", syntax)
    meta = el(0x0002, 0x0000, b"UL", struct.pack("<I", len(meta_body))) + meta_body
    us = lambda v: struct.pack("<H", v)  # noqa: E731
    ds = b"".join([
        el(0x0008, 0x0018, b"UI", sop_uid.encode(), explicit),
        el(0x0010, 0x0020, b"LO", patient_id.encode(), explicit),
        el(0x0028, 0x0002, b"US", us(1), explicit),
        el(0x0028, 0x0004, b"CS", b"MONOCHROME2", explicit),
        el(0x0028, 0x0010, b"US", us(pixels.shape[0]), explicit),
        el(0x0028, 0x0011, b"US", us(pixels.shape[1]), explicit),
        el(0x0028, 0x0100, b"US", us(16), explicit),
        el(0x0028, 0x0101, b"US", us(16), explicit),
        el(0x0028, 0x0103, b"US", us(1 if signed else 0), explicit),
        el(0x0028, 0x1052, b"DS", f"{intercept:g}".encode(), explicit),
        el(0x0028, 0x1053, b"DS", f"{slope:g}".encode(), explicit),
        el(0x7FE0, 0x0010, b"OW", data, explicit),
    ])
    Path(path).write_bytes(b"\0" * 128 + b"DICM" + meta + ds)

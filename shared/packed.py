"""Integer arrays packed as bytes for the wire: msgpack copies bytes in C, where a list of a
hundred thousand ints would be walked element by element."""

from __future__ import annotations

import sys
from array import array


def pack_ints(values: list[int]) -> bytes:
    """int32, little-endian."""
    packed = array("i", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ints(data: bytes) -> list[int]:
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()

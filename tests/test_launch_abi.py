"""The programmatic-dependent-launch configuration as the CUDA driver reads it (CUlaunchConfig, CUlaunchAttribute
of cuda.h), checked byte for byte without a GPU."""
from __future__ import annotations

import ctypes
import struct
import sys

from lane.kernels import launch


def test_config_and_attribute_bytes():
    cfg, attr = launch.pdl_config((7, 2), (256,), 4096, 0x1234)
    # CUlaunchAttribute: id (4 bytes), padding to 8, then the 64-byte value union; value.programmaticStream...
    # SerializationAllowed is its first int
    assert ctypes.sizeof(launch._Attr) == 72
    raw = bytes(attr)
    assert struct.unpack_from("<i", raw, 0)[0] == launch.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert struct.unpack_from("<i", raw, 8)[0] == 1 and raw[12:] == bytes(60)
    # CUlaunchConfig: six dims and sharedMemBytes (uint), hStream at 32, attrs at 40, numAttrs at 48; 56 bytes
    assert ctypes.sizeof(launch._Config) == 56
    raw = bytes(cfg)
    assert struct.unpack_from("<7I", raw, 0) == (7, 2, 1, 256, 1, 1, 4096)
    assert struct.unpack_from("<QQI", raw, 32) == (0x1234, ctypes.addressof(attr), 1)


def test_building_the_attribute_leaves_bytes_objects_alone():
    """An earlier version wrote the attribute through a c_char array field, which reads back as a bytes object
    (the interpreter's shared empty one when zero): it corrupted that object and left the attribute unset."""
    def empty_bytes_terminator() -> bytes:  # CPython: the NUL after the shared empty bytes object's contents
        return ctypes.string_at(id(b"") + sys.getsizeof(b"") - 1, 1)

    assert empty_bytes_terminator() == b"\x00"
    for _ in range(100):
        launch.pdl_config((1,), (1,), 0, 0)
    assert empty_bytes_terminator() == b"\x00"

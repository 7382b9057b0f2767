"""The table blob decode.cuh reads (IQ grids, ksigns, the IQ4 and MXFP4 values) at its DQ_TAB_* offsets, built from
the tables stratad.model.quants decodes with (the gguf package's copies of the format's tables), and its copy on
each device."""
from __future__ import annotations

import re
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from stratad.model.quants import iquants
from stratad.model.quants.mx import MXFP4_VALUES

HEADER = Path(__file__).resolve().parent / "decode.cuh"

_lock = threading.Lock()
_on_device: dict[int, object] = {}


def _parts() -> dict[str, np.ndarray]:
    """decode.cuh's table name -> its int8 / uint8 contents."""
    if not np.array_equal(iquants.grid(T.IQ1_S), iquants.grid(T.IQ1_M)):
        raise AssertionError("decode.cuh shares one grid between IQ1_S and IQ1_M; gguf's copies now differ")
    return {"IQ2XXS": iquants.grid(T.IQ2_XXS), "IQ2XS": iquants.grid(T.IQ2_XS), "IQ2S": iquants.grid(T.IQ2_S),
            "IQ3XXS": iquants.grid(T.IQ3_XXS), "IQ3S": iquants.grid(T.IQ3_S), "IQ1": iquants.grid(T.IQ1_S),
            "KSIGNS": iquants.ksigns(), "IQ4NL": iquants.IQ4_VALUES, "MXFP4": MXFP4_VALUES}


def offsets() -> dict[str, int]:
    """The DQ_TAB_* defines of decode.cuh (name -> byte offset; BYTES: the blob's size)."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"^#define DQ_TAB_(\w+) (\d+)", HEADER.read_text(), flags=re.M)}


@lru_cache(maxsize=1)
def host_tables() -> np.ndarray:
    """The blob as uint8 (DQ_TAB_BYTES,); checks that every table fills exactly its slot of the header's layout."""
    off = offsets()
    size = off.pop("BYTES")
    blob = np.zeros(size, np.uint8)
    order = sorted(off, key=off.get)
    parts = _parts()
    if set(order) != set(parts):
        raise AssertionError(f"decode.cuh's tables {sorted(order)} are not {sorted(parts)}")
    for name, nxt in zip(order, order[1:] + [None]):
        raw = np.ascontiguousarray(parts[name]).view(np.uint8).reshape(-1)
        end = size if nxt is None else off[nxt]
        if off[name] + raw.size != end:
            raise AssertionError(f"decode.cuh: table {name} holds {raw.size} bytes, its slot {end - off[name]}")
        blob[off[name]:end] = raw
    blob.setflags(write=False)
    return blob


def device_tables():
    """The blob on the current device (cupy uint8), uploaded once per device."""
    import cupy

    dev = cupy.cuda.Device().id
    with _lock:
        t = _on_device.get(dev)
        if t is None:
            t = _on_device[dev] = cupy.asarray(host_tables())
        return t

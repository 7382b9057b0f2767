"""Typed reads of GGUF metadata: a value of the wrong type is refused naming the file, the key, the type expected
and the type found (a block_count stored as a string must not surface as int()'s error)."""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType as V

from stratad.model.errors import ModelFormatError

INT_TYPES = (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64)
FLOAT_TYPES = (V.FLOAT32, V.FLOAT64)
ACCEPTED = {"int": INT_TYPES, "float": FLOAT_TYPES + INT_TYPES, "str": (V.STRING,)}
EXPECTED = {"int": "an integer (UINT8..INT64)", "float": "a number (FLOAT32, FLOAT64 or an integer)",
            "str": "STRING"}


def type_name(field) -> str:
    t = [V(x).name for x in field.types]
    return f"ARRAY of {t[-1]}" if len(t) > 1 else t[0] if t else "unknown"


def metadata(reader, path, key: str, kind: str, required: bool = True):
    """The value of `key` as kind "int", "float" or "str"; None when absent and not required."""
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ModelFormatError(path, f"missing metadata key {key}")
        return None
    if len(f.types) != 1 or f.types[0] not in ACCEPTED[kind]:
        raise ModelFormatError(path, f"metadata key {key} has type {type_name(f)}, expected {EXPECTED[kind]}")
    v = f.contents()
    if kind == "int":
        return int(v)
    if kind == "float":
        # a FLOAT32 value (llama.cpp writes these so) stands for the shortest decimal that rounds to it: 1e-6, not
        # 9.99999997e-07, so that a written config reads back equal
        return float(str(np.float32(v))) if f.types[0] == V.FLOAT32 else float(v)
    return str(v)

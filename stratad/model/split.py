"""llama.cpp's split GGUFs (`gguf-split`, or the gguf package's writer): shards named PREFIX-00001-of-0000N.gguf,
each a GGUF of its own with split.no / split.count / split.tensors.count; the metadata is in the first.

Given the first shard, every other is found by name and checked: none missing, none left over from another
split of the same prefix, each one's split keys agreeing with the first's, the tensors adding up.
"""
from __future__ import annotations

import re
from pathlib import Path

from stratad.model.errors import ModelFormatError
from stratad.model.metadata import metadata

KEY_NO, KEY_COUNT, KEY_TENSORS = "split.no", "split.count", "split.tensors.count"
NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_name(prefix: str, no: int, count: int) -> str:
    """no counts from 1, as in the file names."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def shard_readers(path: Path, first, read) -> list[tuple[Path, object]]:
    """[(path, reader)] of every shard, the first one's given; read(path) opens another (ModelFormatError if it
    cannot). A file without split keys is its own only shard."""
    if first.fields.get(KEY_COUNT) is None:
        return [(path, first)]
    n = metadata(first, path, KEY_COUNT, "int")
    no = metadata(first, path, KEY_NO, "int")
    total = metadata(first, path, KEY_TENSORS, "int")
    if no != 0:
        first_name = path.name
        if m := NAME.match(path.name):
            first_name = shard_name(m["prefix"], 1, int(m["count"]))
        raise ModelFormatError(path, f"this is shard {no + 1} of {n} ({KEY_NO} = {no}); give the first shard, "
                                     f"{first_name}, as the model")
    if n < 1:
        raise ModelFormatError(path, f"{KEY_COUNT} is {n}, expected at least 1")
    if n == 1:
        return [(path, first)]
    m = NAME.match(path.name)
    if m is None:
        raise ModelFormatError(path, f"{KEY_COUNT} is {n} but the file name does not follow llama.cpp's "
                                     f"PREFIX-00001-of-{n:05d}.gguf, so its other shards cannot be found")
    if int(m["count"]) != n or int(m["no"]) != 1:
        raise ModelFormatError(path, f"the file name says shard {int(m['no'])} of {int(m['count'])}, its metadata "
                                     f"{KEY_NO} = {no}, {KEY_COUNT} = {n}")
    prefix = m["prefix"]
    names = [path.with_name(shard_name(prefix, i + 1, n)) for i in range(n)]
    extra = sorted(p for p in path.parent.iterdir()
                   if (pm := NAME.match(p.name)) and pm["prefix"] == prefix and p.name not in {q.name for q in names})
    if extra:
        raise ModelFormatError(extra[0], f"extra shard: {path.name} has {KEY_COUNT} = {n} ({names[0].name} .. "
                                         f"{names[-1].name}); this file belongs to no such split")
    out = [(path, first)]
    for i, p in enumerate(names[1:], 1):
        if not p.is_file():
            raise ModelFormatError(p, f"missing shard {i + 1} of {n} ({KEY_COUNT} = {n} in {path.name})")
        r = read(p)
        for key, want in ((KEY_NO, i), (KEY_COUNT, n), (KEY_TENSORS, total)):
            got = metadata(r, p, key, "int")
            if got != want:
                raise ModelFormatError(p, f"{key} is {got}, expected {want} (shard {i + 1} of the split of "
                                          f"{path.name})")
        out.append((p, r))
    held = sum(len(r.tensors) for _, r in out)
    if held != total:
        raise ModelFormatError(path, f"{KEY_TENSORS} is {total} but the {n} shards hold {held} tensors")
    return out

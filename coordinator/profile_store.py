"""The learned expert profile kept between runs: the daemon starts with last run's hot experts already on the
cards instead of a routing warm-up.

One file per model (by the GGUF header hash) in the state directory, written atomically (temporary file, fsync,
rename) at a graceful stop and every `profile_save_s` while serving, so that a crash loses at most that much.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

log = logging.getLogger("stratad.coordinator")


def path_for(state_dir: str, model_hash: str) -> Path:
    return Path(state_dir) / f"profile-{model_hash[:16]}.npy"


def read(path: str | os.PathLike, shape: tuple[int, int]) -> np.ndarray:
    """A profile file as float64, or ValueError saying what is wrong with it (unreadable; not a finite,
    non-negative array of this shape)."""
    try:
        p = np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - a damaged header fails in numpy's literal parser: TokenError, TypeError..
        raise ValueError(f"cannot read it ({type(e).__name__}: {e})") from None
    if p.dtype.kind not in "fiu" or p.shape != shape or not np.isfinite(p).all() or (p < 0).any():
        raise ValueError(f"{p.dtype} of shape {p.shape}, expected {shape}, finite and not negative")
    return p.astype(np.float64)


def load(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """The saved profile, or None (no file, or one that does not fit this model: said in the log, then ignored)."""
    if not path.exists():
        return None
    try:
        return read(path, shape)
    except ValueError as e:
        log.warning("saved profile %s: %s; starting without it", path, e)
        return None


def save(path: Path, profile: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(profile, np.float64))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

"""What the GPU profile scripts share: the model they profile and how they report (a table last, --json all)."""
from __future__ import annotations

import json
from pathlib import Path

from stratad.model.generator import make_model

DEFAULT_MODEL = "/tmp/a3b-iq3s-skew1.gguf"


def model_path(given: str | None) -> str:
    """The given GGUF, else the a3b IQ3_S preset (skew 1.0), generated once at DEFAULT_MODEL."""
    if given is not None:
        return given
    if not Path(DEFAULT_MODEL).exists():
        make_model(DEFAULT_MODEL, "a3b", expert_quant="IQ3_S", router_skew=1.0)
    return DEFAULT_MODEL


def report(rows: list[dict], keys: list[str], json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2) + "\n")
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "-")) for k in keys))

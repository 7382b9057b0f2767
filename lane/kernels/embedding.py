"""The token embedding: dequantised rows of the table by token id (embedding.cu, decode.cuh's decode of the table's
type); a bad id gives a NaN row.

  embed(table, tokens, out)           embed_ref(raw, qtype, tokens)
"""
from __future__ import annotations

import numpy as np

from stratad.model import quants

from .device import dense_qtype, module, need, on_stream
from .launch import launch
from .weights import DenseWeight

SOURCE = "embedding.cu"


def embed(table: DenseWeight, tokens, out=None, *, stream=None):
    """out[t] = dequantised row tokens[t] of the table (tokens: device int32 (T,)); a bad id gives a NaN row."""
    m = module(SOURCE)
    cp = m.cp
    need(tokens, np.int32, None, "tokens")
    Tn = int(tokens.shape[0])
    if out is None:
        out = cp.empty((Tn, table.cols), cp.float32)
    need(out, np.float32, (Tn, table.cols), "out")
    with on_stream(stream):
        launch(m.fn(f"embed_rows_{table.name}"), (Tn,), (256,),
               (table.data, np.int32(table.rows), np.int32(table.cols), np.int64(table.row_bytes), table.tab, tokens,
                out))
    return out


def embed_ref(raw: np.ndarray, qtype, tokens) -> np.ndarray:
    return quants.dequantize(dense_qtype(qtype), np.asarray(raw)[np.asarray(tokens, np.int64)])

"""The 8-bit activation row of the o mat-vec (lane/kernels/matvec.py: quantize_row, matvec_qx_ref): numpy only,
so CI checks the reference the GPU tests hold the kernels to."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from lane.kernels import matvec
from stratad.engine import canonical
from stratad.model import quants


def test_quantize_row_is_the_canonical_codes_then_scales():
    rng = np.random.default_rng(7)
    x = rng.standard_normal(256).astype(np.float32) * np.float32(3)
    x[64:96] = 0  # a group of zeros: scale 0, codes 0
    row = matvec.quantize_row(x)
    assert row.dtype == np.int8 and row.shape == (matvec.q8_row_bytes(256),) == (288,)
    q, d = canonical.quantize_act(x)
    assert np.array_equal(row[:256], q.reshape(-1))
    assert np.array_equal(row[256:].view(np.float32).view(np.uint32), d.view(np.uint32))
    assert d[2] == 0 and not row[64:96].any()


def test_q8_row_bytes_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        matvec.q8_row_bytes(100)


@pytest.mark.parametrize("qt", [T.Q8_0, T.IQ3_S], ids=lambda t: t.name)
def test_matvec_qx_ref_is_the_product_with_the_rounded_row(qt):
    """Exactly W times the dequantised 8-bit row (float64), and off the float product by no more than the
    rounding allows: half a scale a value."""
    rng = np.random.default_rng(8)
    rows, cols = 48, 512
    raw = np.ascontiguousarray(quants.random_rows(qt, rng, rows, cols, 1 / np.sqrt(cols))).view(np.uint8)
    raw = raw.reshape(rows, -1)
    x = rng.standard_normal(cols).astype(np.float32)
    res = rng.standard_normal(rows).astype(np.float32)
    W = quants.dequantize(qt, raw).astype(np.float64)
    q, d = canonical.quantize_act(x)
    xq = (q.astype(np.float64) * d[:, None].astype(np.float64)).reshape(-1)
    y = matvec.matvec_qx_ref(raw, qt, x, res)
    want = W @ xq + res
    assert np.max(np.abs(y - want) / (np.abs(W) @ np.abs(xq) + np.abs(res))) < 1e-6
    slack = np.abs(W) @ np.repeat(d.astype(np.float64) / 2, 32)  # |x - xq| <= d / 2 a value
    assert np.all(np.abs(matvec.matvec_qx_ref(raw, qt, x) - W @ x.astype(np.float64)) <= slack * (1 + 1e-5) + 1e-6)


def test_matvec_qx_ref_refuses_types_with_a_minimum_or_folded_scales():
    raw = np.zeros((1, 144), np.uint8)
    with pytest.raises(ValueError, match="8-bit x takes .*Q4_K"):
        matvec.matvec_qx_ref(raw, T.Q4_K, np.zeros(256, np.float32))

"""The grid barrier of persistent kernels (lane/kernels/grid_sync.cu), device only: every block sees every other
block's writes after it, eagerly and replayed from a graph, and the count is back at zero after each."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_barrier_rounds(cp):
    from lane.kernels.grid_sync import GridSync, barrier_rounds_ref

    gs = GridSync()
    for rounds in (0, 1, 7, 300):
        out = gs.rounds(rounds)
        cp.cuda.Device().synchronize()
        assert np.array_equal(out.get(), barrier_rounds_ref(gs.blocks, rounds)), rounds
        assert int(gs.count.get()[0]) == 0
    assert int(gs.gen.get()[0]) == 2 * (1 + 7 + 300)


@pytest.mark.parametrize("pdl", [False, True])
def test_barrier_in_a_graph(cp, pdl):
    """Captured (cooperatively; with or without the PDL edge a decode step's launches have) and replayed three
    times."""
    from lane.kernels.grid_sync import GridSync, barrier_rounds_ref

    gs = GridSync()
    s = cp.cuda.Stream(non_blocking=True)
    out = cp.zeros((gs.blocks,), cp.int64)
    with s:
        s.begin_capture()
        gs.boundaries(2)
        gs.rounds(5, out, pdl=pdl)
        g = s.end_capture()
        for _ in range(3):
            out.fill(-1)
            g.launch(s)
            s.synchronize()
            assert np.array_equal(out.get(), barrier_rounds_ref(gs.blocks, 5))
    assert int(gs.count.get()[0]) == 0 and int(gs.gen.get()[0]) == 3 * 10
    assert int(gs.x.get()[0]) == 6


def test_a_grid_too_large_is_refused(cp):
    """More blocks than can be resident at once: the driver refuses the cooperative launch (an error, not a hang)."""
    from lane.kernels.grid_sync import GridSync

    gs = GridSync(blocks=GridSync().blocks * 64)  # 256 threads a block: at most 8 an SM
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx failed"):
        gs.rounds(1)
        cp.cuda.Device().synchronize()

"""Device time of launches captured as one CUDA graph: the GPU benches' one way to time a kernel (replayed, so the
host's launch cost is not in it)."""
from __future__ import annotations


def graph_ms(cp, stream, fns, iters: int, repeats: int) -> list[float]:
    """ms per `iters` replays of fns (each called once, captured as one graph on stream), `repeats` times, after
    three warm-up replays."""
    with stream:
        stream.begin_capture()
        for f in fns:
            f()
        g = stream.end_capture()
        for _ in range(3):
            g.launch(stream)
        stream.synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        out = []
        for _ in range(repeats):
            e0.record(stream)
            for _ in range(iters):
                g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            out.append(cp.cuda.get_elapsed_time(e0, e1))
    return out

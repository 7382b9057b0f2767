"""The overhead bench's HTTP path, run short against the real daemon and its gateway on a CPU card: the stream
carries every token asked for, and the JSON names the floor, the fraction reached and the target."""
from __future__ import annotations

from daemon_harness import ROOT  # noqa: F401 - sets PYTHONPATH for the bench's daemon
from stratad.bench import overhead


def test_overhead_bench_has_the_http_path(tiny_model_path):
    out = overhead.run(str(tiny_model_path), tokens=24, repeats=1)
    (http,) = [r for r in out["results"] if r["metric"] == "http_request_tok_s"]
    assert http["zmq_client"] > 0 and http["http_client"] > 0 and http["target_fraction"] == 0.97
    assert "ZeroMQ" in http["floor"] and 0 < http["fraction_reached"]
    assert http["ttft_s"]["http_client"] > 0 and http["decode_tok_s"]["http_client"] > 0

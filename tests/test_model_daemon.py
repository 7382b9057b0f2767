"""Model files through the real daemon (CPU cards): a split model is served from its first shard with the tokens
of the one-file model; a bad file stops `stratad serve` before anything starts, with the file and the problem
in its error, exit status 2, no lane and nothing left in shared memory or the runtime dir."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from gguf import GGUFValueType

from daemon_harness import ROOT, Daemon
from stratad import shm
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams
from stratad.model.generator import make_model
from test_model_file import raw_list, tiny_tensors, write_raw

PROMPT = "The experts of a split model"


def test_split_model_served_with_the_one_file_tokens(tiny_model, tmp_path):
    (tmp_path / "split").mkdir()
    files = make_model(tmp_path / "split" / "tiny.gguf", "tiny", expert_quant="IQ3_S", dense_quant="Q8_0",
                       router_skew=1.0, seed=0, split_max_size=1_000_000)["files"]
    want = list(ReferenceEngine(tiny_model).generate(tiny_model.tokenizer.encode(PROMPT),
                                                     SamplingParams(max_tokens=12, ignore_eos=True)))
    d = Daemon(files[0], tmp_path / "run", cards="cpu").start()
    try:
        with d.client() as c:
            s = c.generate(prompt=PROMPT, max_tokens=12, ignore_eos=True)
            s.result()
        assert s.tokens == want
        assert d.status().model == files[0]
    finally:
        d.stop()


def _bad_files(tmp_path) -> dict:
    """Each kind of fault once (test_model_file / test_split_model check every case of each on ModelFile)."""
    (tmp_path / "split").mkdir()
    split = make_model(tmp_path / "split" / "tiny.gguf", "tiny", split_max_size=1_000_000)["files"]
    data = open(split[2], "rb").read()
    open(split[2], "wb").write(data[:len(data) // 2])  # a truncated shard
    return {
        "truncated shard": (split[0], split[2], "truncated"),
        "block_count a string": (write_raw(tmp_path / "typed.gguf", raw_list(tiny_tensors()),
                                           set_keys={"qwen3moe.block_count": ("4", GGUFValueType.STRING)}), None,
                                 "metadata key qwen3moe.block_count has type STRING, expected an integer"),
        "no merges": (write_raw(tmp_path / "nomerges.gguf", raw_list(tiny_tensors()),
                                drop_keys=("tokenizer.ggml.merges",)), None, "tokenizer.ggml.merges"),
    }


def test_bad_files_stop_the_daemon_before_it_starts(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for case, (model, at_fault, problem) in _bad_files(tmp_path).items():
        rt = tmp_path / f"rt-{case.replace(' ', '-')}"
        r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--model", str(model), "--cards", "cpu,cpu",
                            "--runtime-dir", str(rt)], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2, (case, r.returncode, r.stderr[-2000:])
        assert f"error: {at_fault or model}: " in r.stderr and problem in r.stderr, (case, r.stderr[-2000:])
        assert "lane" not in r.stderr.lower(), (case, r.stderr[-2000:])  # no lane was started
        assert sorted(p.name for p in rt.iterdir()) == [], case  # no lock, socket or pid file
        assert not list(shm.SHM_DIR.glob(shm.prefix_for(rt).lstrip("/") + "*")), case
    shutil.rmtree(tmp_path / "split")


def test_context_beyond_the_model_is_refused_and_yarn_extends_it(tiny_model, tiny_model_path, tmp_path):
    """context_length above the model's trained length stops `stratad serve` naming the setting; with YaRN set in
    the config the same length serves, and the lanes compute with the scaled RoPE (the reference's tokens with
    the same overrides)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    n = tiny_model.config.context_length
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--model", str(tiny_model_path), "--cards",
                        "cpu", "--runtime-dir", str(tmp_path / "rt"), "--context-length", str(2 * n)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and f"context_length {2 * n} exceeds the model's {n} tokens" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "rt").iterdir()) == []  # no lock, socket or pid file left
    conf = tmp_path / "yarn.toml"
    conf.write_text(f'context_length = {2 * n}\nrope_scaling = "yarn"\nrope_scale = 2.0\nyarn_orig_ctx = {n}\n')
    from stratad.engine.generation import Generation
    from stratad.model.gguf_file import ModelFile

    def reference(model) -> tuple[list[int], str]:
        g = Generation(ReferenceEngine(model), model.tokenizer, prompt, SamplingParams(max_tokens=12, ignore_eos=True),
                       2 * n, digest=True)
        return [t for t, _ in g if t is not None], g.digest.hexdigest()

    scaled = ModelFile(tiny_model_path)
    scaled.config = scaled.config.with_rope_overrides("yarn", 2.0, n)
    prompt = tiny_model.tokenizer.encode(PROMPT)
    want, plain = reference(scaled), reference(tiny_model)
    assert want[1] != plain[1]  # the scaling moves the logits
    d = Daemon(tiny_model_path, tmp_path / "run", cards="cpu", config=conf).start()
    try:
        with d.client() as c:
            s = c.generate(tokens=prompt, max_tokens=12, ignore_eos=True, digest=True)
            s.result()
        assert (list(s.tokens), s.stats.logits_sha256) == want
    finally:
        d.stop()

"""The numpy reference engine: prefill + incremental decode against a full recompute, determinism, sampling,
stop tokens, max tokens and the context limit."""
from __future__ import annotations

import numpy as np
import pytest

from stratad.engine.chunks import PROMPT_CHUNK
from stratad.engine.reference import KVCache, ReferenceEngine, Trace, route
from stratad.engine.sampling import Sampler, SamplingParams
from stratad.model.gguf_file import ModelFile

F32 = np.float32


@pytest.fixture(scope="module")
def engines(tiny_model):
    return {"canonical": ReferenceEngine(tiny_model, "canonical"), "float": ReferenceEngine(tiny_model, "float")}


def incremental(eng: ReferenceEngine, tokens: list[int], prefill: list[int]) -> np.ndarray:
    """Logits of every position, run as consecutive chunks of the given sizes then one token at a time."""
    kv = eng.new_kv()
    out, i = [], 0
    for n in prefill:
        out.append(eng.forward(tokens[i:i + n], kv, logits="all"))
        i += n
    for t in tokens[i:]:
        out.append(eng.forward([t], kv, logits="all"))
    assert kv.length == len(tokens)
    return np.concatenate(out)


# Measured on tiny (IQ3_S experts, skew 1), 48 random tokens, the three splits below, max |a - b| / max |logits|:
#   float experts:      4e-7 .. 9e-7 (float32 rounding; numpy/OpenBLAS sgemm rounds a row differently
#                       depending on how many rows are in the call, and so does the float expert's matmul)
#   canonical experts:  0 (bit-identical) for some prompts, up to 8.3e-3 for others (15 prompts of 64 tokens:
#                       median 2.5e-3). The experts themselves are batch-invariant (test_canonical); the ~1e-6
#                       differences come from the attention / dense matmuls above them, and the int8 activation
#                       quantisation turns some of them into a step of one quantum (x / 127 of a 32-value block)
#                       at the next expert: 1e-6 after layer 0's attention becomes 7e-4 at its MoE output and 2e-2
#                       by layer 1. Top-1 agreed at >= 98 % of positions, routing never flipped.
TOL = {"float": 5e-6, "canonical": 3e-2}
SPLITS = [[1], [17], [20, 9, 1]]


@pytest.mark.parametrize("experts", ["float", "canonical"])
def test_prefill_then_decode_matches_full_forward(engines, experts):
    eng = engines[experts]
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, eng.c.vocab_size, 48).tolist()
    full = eng.forward(tokens, eng.new_kv(), logits="all")
    assert full.shape == (48, eng.c.vocab_size) and full.dtype == F32
    scale = float(np.abs(full).max())
    worst = []
    for split in SPLITS:
        inc = incremental(eng, tokens, split)
        rel = float(np.abs(inc - full).max()) / scale
        worst.append(rel)
        assert rel < TOL[experts], (split, rel)
        assert np.mean(inc.argmax(-1) == full.argmax(-1)) >= 0.95
    # "last" logits of a prefill are the last row of "all" (the LM head's matmul on 1 row vs 48 rounds apart)
    last = eng.forward(tokens, eng.new_kv())
    assert last.shape == (1, eng.c.vocab_size)
    assert float(np.abs(last[0] - full[-1]).max()) / scale < TOL["float"]
    print(f"[reference {experts}] prefill+decode vs full forward: max |diff| / max |logit| per split "
          f"{[f'{w:.2g}' for w in worst]} (max |logit| {scale:.3g})")


def test_forward_none_and_kv_growth(engines):
    eng = engines["float"]
    kv = eng.new_kv()
    x = eng.forward(list(range(300)), kv, logits="none")  # past the KV cache's first capacity (256)
    assert x.shape == (300, eng.c.d_model) and kv.length == 300
    assert kv.k[0].shape[0] >= 300 and kv.k[0].shape[1:] == (eng.c.n_head_kv, eng.c.head_dim)
    more = eng.forward([5, 6], kv, logits="all")
    assert more.shape == (2, eng.c.vocab_size) and kv.length == 302
    assert isinstance(KVCache.empty(2, 1, 4), KVCache)


def test_route():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0]], F32)
    ids, w = route(logits, 3)
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]  # descending, ties to the lower index
    assert w.dtype == F32 and np.allclose(w.sum(-1), 1)
    p = np.exp(logits[0] - 3) / np.exp(logits[0] - 3).sum()
    assert np.allclose(w[0], p[[1, 3, 2]] / p[[1, 3, 2]].sum())


def test_trace(engines):
    eng = engines["canonical"]
    tr = Trace()
    eng.forward([1, 2, 3, 4, 5], eng.new_kv(), trace=tr)
    assert len(tr.ids) == len(tr.rms) == eng.c.n_layer
    for ids in tr.ids:
        assert ids.shape == (5, eng.c.n_expert_used)
        assert all(len(set(row)) == eng.c.n_expert_used for row in ids.tolist())


def test_canonical_deterministic_across_instances(tiny_model_path):
    """Two engines on two openings of the file: the same logits bit for bit and the same greedy stream."""
    runs = []
    for _ in range(2):
        m = ModelFile(tiny_model_path)
        eng = ReferenceEngine(m, "canonical")
        prompt = m.tokenizer.encode("Determinism is the point of the canonical experts.")
        logits = eng.forward(prompt, eng.new_kv(), logits="all")
        toks = list(eng.generate(prompt, SamplingParams(max_tokens=12)))
        runs.append((logits, toks))
        m.close()
    assert np.array_equal(runs[0][0].view(np.uint32), runs[1][0].view(np.uint32))
    assert runs[0][1] == runs[1][1] and len(runs[0][1]) > 0


def test_greedy_generate_is_argmax_loop(engines):
    """generate (prefill, then one token at a time) == an explicit argmax loop over the same forward calls."""
    eng = engines["canonical"]
    prompt = [3, 14, 15, 92, 65]
    got = list(eng.generate(prompt, SamplingParams(max_tokens=10)))
    kv, want = eng.new_kv(), []
    logits = eng.forward(prompt, kv)
    stops = eng.model.tokenizer.stop_ids
    for _ in range(10):
        t = int(np.argmax(logits[-1]))
        if t in stops:
            break
        want.append(t)
        logits = eng.forward([t], kv)
    assert got == want


# ---- sampling -------------------------------------------------------------------------------------------------


def _logits(seed: int = 0, n: int = 1000) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(F32)


def _draws(params: SamplingParams, logits: np.ndarray, n: int = 200) -> list[int]:
    s = Sampler(params)
    return [s(logits) for _ in range(n)]


def test_greedy_is_argmax():
    for seed in range(20):
        lg = _logits(seed)
        assert Sampler(SamplingParams())(lg) == int(np.argmax(lg))
    tie = np.array([1.0, 5.0, 5.0, 0.0], F32)
    assert Sampler(SamplingParams())(tie) == 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=20, seed=1),
    SamplingParams(temperature=1.3, top_p=0.8, seed=1),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1),
])
def test_seeded_sampling_reproducible(params):
    lg = _logits()
    a, b = _draws(params, lg), _draws(params, lg)
    assert a == b
    other = _draws(SamplingParams(**{**params.__dict__, "seed": 2}), lg)
    assert other != a
    assert len(set(a)) > 5  # it does sample, not always the argmax


def test_top_k_one_is_greedy():
    for seed in range(10):
        lg = _logits(seed)
        assert _draws(SamplingParams(temperature=1.5, top_k=1, seed=seed), lg, 30) == [int(np.argmax(lg))] * 30
        # a nucleus too small for a second token is greedy as well
        assert set(_draws(SamplingParams(temperature=1.5, top_p=1e-6, seed=seed), lg, 30)) == {int(np.argmax(lg))}


def test_top_k_and_top_p_restrict_the_choice():
    lg = _logits(3)
    order = np.argsort(-lg)
    assert set(_draws(SamplingParams(temperature=2.0, top_k=5, seed=0), lg, 500)) <= set(order[:5].tolist())
    p = np.exp((lg - lg.max()) / 2.0)
    p /= p.sum()
    nucleus = int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1
    got = set(_draws(SamplingParams(temperature=2.0, top_p=0.5, seed=0), lg, 500))
    assert got <= set(order[:nucleus].tolist()) and len(got) > 1


def test_temperature_follows_softmax():
    lg = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = np.array(_draws(SamplingParams(temperature=1.0, seed=9), lg, 20000))
    freq = np.bincount(draws, minlength=4) / draws.size
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    cold = np.array(_draws(SamplingParams(temperature=0.25, seed=9), lg, 5000))
    assert np.mean(cold == 0) > 0.85  # a low temperature sharpens the distribution


@pytest.mark.parametrize("kw,msg", [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
])
def test_sampling_params_problems(kw, msg):
    probs = SamplingParams(**kw).problems()
    assert len(probs) == 1 and probs[0].startswith(msg), probs


def test_sampling_params_ok():
    assert SamplingParams().problems() == []
    assert SamplingParams(max_tokens=1, temperature=0.5, top_k=1, top_p=1.0).problems() == []
    assert len(SamplingParams(max_tokens=0, top_k=-3, top_p=2).problems()) == 3


# ---- generation limits ----------------------------------------------------------------------------------------


class ForcedStop(ReferenceEngine):
    """The reference engine whose logits put the end-of-sequence token on top at the n-th forward call."""

    def __init__(self, model, at: int):
        super().__init__(model, "float")
        self.at, self.calls = at, 0

    def forward(self, tokens, kv, logits="last", trace=None):
        out = super().forward(tokens, kv, logits, trace)
        self.calls += 1
        if self.calls == self.at:
            out = out.copy()
            out[..., self.model.tokenizer.eos_id] = out.max() + 100
        return out


def test_generate_stops_at_stop_token(tiny_model):
    prompt = tiny_model.tokenizer.encode("Stop when told to.")
    free = list(ReferenceEngine(tiny_model, "float").generate(prompt, SamplingParams(max_tokens=8)))
    assert len(free) >= 3
    eng = ForcedStop(tiny_model, at=4)
    got = list(eng.generate(prompt, SamplingParams(max_tokens=8)))
    assert got == free[:3]  # the stop token itself is not yielded
    assert eng.calls == 4  # and nothing is computed after it
    assert tiny_model.tokenizer.eos_id in tiny_model.tokenizer.stop_ids
    # stop at once: nothing generated
    assert list(ForcedStop(tiny_model, at=1).generate(prompt, SamplingParams(max_tokens=8))) == []


def test_generate_ignore_eos_runs_to_max_tokens(tiny_model):
    prompt = tiny_model.tokenizer.encode("Stop when told to.")
    free = list(ReferenceEngine(tiny_model, "float").generate(prompt, SamplingParams(max_tokens=8)))
    eng = ForcedStop(tiny_model, at=4)
    got = list(eng.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(got) == 8 and eng.calls == 8  # the stop token is generated like any other, and the run goes on
    assert got[:3] == free[:3] and got[3] == tiny_model.tokenizer.eos_id


def test_generate_stops_at_max_tokens(engines):
    eng = engines["canonical"]
    for n in (1, 5):
        assert len(list(eng.generate([1, 2, 3], SamplingParams(max_tokens=n)))) == n


def test_generate_rejects_over_context(tiny_model):
    eng = ReferenceEngine(tiny_model, "float")
    ctx = tiny_model.config.context_length
    with pytest.raises(ValueError, match=rf"prompt of 100 tokens \+ max_tokens {ctx - 99} exceeds the context "
                                         rf"length {ctx}"):
        list(eng.generate([1] * 100, SamplingParams(max_tokens=ctx - 99)))
    # exactly at the limit is accepted (not run to the end here: the check comes before any work)
    g = eng.generate([1] * 100, SamplingParams(max_tokens=ctx - 100))
    assert next(iter(g)) >= 0


def test_wide_nucleus_beyond_the_probe():
    """A nucleus wider than the candidates looked at first (flat logits over 5000 tokens, top_p 0.9): the whole
    order is used, ties go to the lower index, and tokens past the probe are drawn."""
    from stratad.engine.sampling import NUCLEUS_PROBE

    lg = np.zeros(5000, F32)
    draws = _draws(SamplingParams(temperature=1.0, top_p=0.9, seed=4), lg, 400)
    assert max(draws) < 4500 and max(draws) > NUCLEUS_PROBE


# ---- sampling on an engine's device -------------------------------------------------------------------------------
class DeviceSampling:
    """An engine that samples where it computes (as the GPU card does): forward_token with Sampler.pick's token
    for the draw it is given, the logits only when asked."""

    prompt_chunk = PROMPT_CHUNK
    steps_ahead = False

    def __init__(self, engine):
        self.engine = engine

    def new_kv(self):
        return self.engine.new_kv()

    def forward(self, tokens, kv, logits="last"):
        raise AssertionError("a device-sampling engine is stepped through forward_token")

    def samples_on_device(self, params):
        return True

    def forward_token(self, tokens, kv, params, u, logits, ahead=None):
        lg = self.engine.forward(tokens, kv)
        return Sampler(params).pick(lg[-1], u), (lg[-1:] if logits else None)


class StepsAhead(DeviceSampling):
    """forward_token(ahead=u) as the GPU card takes it (it launches the next step from the token it returns): counts
    the calls that follow such a step (that token, that draw), the only ones that can take it."""
    steps_ahead = True

    def __init__(self, engine):
        super().__init__(engine)
        self.pending, self.asked, self.followed = None, 0, 0

    def forward_token(self, tokens, kv, params, u, logits, ahead=None):
        assert not (logits and ahead is not None), "a step that returns logits is not launched ahead"
        self.followed += self.pending == (list(tokens), u)
        t, lg = super().forward_token(tokens, kv, params, u, logits)
        self.asked += ahead is not None
        self.pending = ([t], ahead) if ahead is not None else None
        return t, lg


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12),
                                    SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=3),
                                    SamplingParams(max_tokens=12, temperature=1.2, top_k=20, top_p=0.9, seed=4)])
def test_device_sampling_gives_the_host_tokens(tiny_model, params):
    """Generation draws the same numbers in the same order whether the engine or the host samples, so a seeded
    request gives the same tokens (and, with a digest, the same logits digest) either way."""
    from stratad.engine.generation import Generation

    m = tiny_model
    prompt = m.tokenizer.encode("Where is the expert computed?")
    runs = []
    ahead = StepsAhead(ReferenceEngine(m, "canonical"))
    for eng in (ReferenceEngine(m, "canonical"), DeviceSampling(ReferenceEngine(m, "canonical")), ahead):
        for digest in (True, False):
            g = Generation(eng, m.tokenizer, prompt, params, m.config.context_length, digest=digest)
            runs.append(([t for t, _ in g if t is not None], g.digest.hexdigest() if digest else None))
    assert runs[0] == runs[2] == runs[4] and runs[1][0] == runs[3][0] == runs[5][0] == runs[0][0]
    # steps ahead only without a digest, and every one followed but one after a stop token
    assert ahead.asked > 0 and ahead.followed >= ahead.asked - 1 and ahead.asked <= params.max_tokens - 1

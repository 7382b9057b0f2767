"""Files with llama.cpp's type mixes through the real daemon on CPU cards: every cache fraction, lead + peer and
mutual help give the reference engine's bits (a digest of every step's logits), whatever computed each expert
(the card's slots, a peer's, the CPU pool's block kernels on mixed gate / up / down types)."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from daemon_harness import Daemon, beside, max_tokens_of, run_chats
from stratad.engine.generation import Generation
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams
from stratad.model.generator import make_model
from stratad.model.gguf_file import ModelFile

PROMPTS = {"A": "Mixed types: the first chat.", "B": "A second chat about other experts."}
N = 16


class Mixed:
    """A generated tiny model of one mix and its reference digests."""

    def __init__(self, path, mix: str):
        make_model(path, "tiny", mix=mix, seed=5)
        self.path, self.mix = path, mix
        m = self.m = ModelFile(path)
        self.types = {m.expert_type(i, k) for i in range(m.config.n_layer) for k in ("gate", "up", "down")}
        self.eng = ReferenceEngine(m, "canonical")
        self.digest = {name: self.ref(name, N) for name in PROMPTS}

    def ref(self, name: str, n: int, ignore_eos: bool = False) -> str:
        m = self.m
        g = Generation(self.eng, m.tokenizer, m.tokenizer.encode(PROMPTS[name]),
                       SamplingParams(max_tokens=n, ignore_eos=ignore_eos), m.config.context_length, digest=True)
        for _ in g:
            pass
        return g.digest.hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """mix -> Mixed, each made when a test first asks for it."""
    d = tmp_path_factory.mktemp("mixes")

    class Models(dict):
        def __missing__(self, mix):
            self[mix] = Mixed(d / f"{mix}.gguf", mix)
            return self[mix]

    return Models()


def start(m: Mixed, tmp_path, cards: str, cache: str, **cfg) -> Daemon:
    conf = tmp_path / "c.toml"
    conf.write_text("".join(f"{k} = {str(v).lower()}\n" for k, v in cfg.items()))
    return Daemon(m.path, tmp_path / f"run{cards.count(',')}{cache}", cards=cards, config=conf,
                  extra=["--expert-cache", cache]).start()


def run(d: Daemon, names) -> dict:
    return run_chats(d, [(n, N) for n in names], lambda name: {"prompt": PROMPTS[name]})


def _check_fractions(m: Mixed, tmp_path, fractions):
    for cache in fractions:
        d = start(m, tmp_path, "cpu", cache)
        try:
            st = run(d, "A")["A"].stats
            assert st.logits_sha256 == m.digest["A"], (m.mix, cache)
            if cache == "0.0":
                assert st.experts_card == 0 and st.experts_cpu > 0  # every expert on the CPU pool
            if cache == "1.0":
                assert st.experts_cpu == 0 and st.experts_card > 0  # every expert in the card's slots
        finally:
            d.stop()


def test_q4_k_m_half_and_none_resident(models, tmp_path):
    """Q4_K gate / up with Q6_K down on some layers (llama.cpp's Q4_K_M): 50 % and 0 % of the experts resident."""
    m = models["q4_k_m"]
    assert m.types == {T.Q4_K, T.Q6_K}
    _check_fractions(m, tmp_path, ("0.5", "0.0"))


def test_f16_experts_half_and_none_resident(models, tmp_path):
    """The converter's F16 output: experts through their integer view on the card's slots and the CPU pool."""
    m = models["f16"]
    assert m.types == {T.F16}
    _check_fractions(m, tmp_path, ("0.5", "0.0"))


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["q4_k_m", "q2_k", "iq3_xs", "iq1_m", "q4_0", "mxfp4_moe", "bf16", "f32"])
def test_every_cache_fraction(models, tmp_path, mix):
    """100 / 50 / 10 / 0 % resident, for mixes of K-quants, i-quants (IQ3_XXS with IQ3_S, IQ1_M), legacy types and
    MXFP4 experts."""
    _check_fractions(models[mix], tmp_path, ("1.0", "0.5", "0.1", "0.0"))


def test_lead_peer_and_mutual_help_on_a_mixed_file(models, tmp_path):
    """Two cards: one chat uses the idle card's slots (lead + peer); two chats help each other (mutual)."""
    m = models["q2_k"]
    d = start(m, tmp_path, "cpu,cpu", "0.3", mutual_help=True)
    try:
        out = run(d, "A")
        assert out["A"].stats.logits_sha256 == m.digest["A"] and out["A"].stats.experts_peer > 0
        both = (("mutual", True), ("mutual", True))
        a, b, seen = beside(d, {"prompt": PROMPTS["A"]}, {"prompt": PROMPTS["B"]}, until=lambda seen: both in seen)
        for name, s in (("A", a), ("B", b)):
            assert s.stats.logits_sha256 == m.ref(name, max_tokens_of(s), ignore_eos=True), name
        assert both in seen
    finally:
        d.stop()

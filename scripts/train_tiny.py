"""Train the tiny model that ships with stratad (stratad/model/data/tiny-chat.gguf) so that it really talks.

transformers' Qwen3-MoE in the `tiny` preset's shape, trained on the CPU (one thread, fixed seeds, deterministic
algorithms: the same file bytes on the same machine) on the scripted dialogues below, rendered by Qwen3's own chat
template: greetings, short answers, thinking on and off, a get_weather tool call and its result turned into an
answer. Only the assistant's turns are learnt. The weights are written with the project's writer (experts Q8_0,
dense Q8_0, norms and router F32) with a vocabulary of its own: the generated models' BPE plus Qwen3's four tool
tokens, and Qwen3's chat template.

    .venv/bin/python scripts/train_tiny.py [--out PATH] [--steps N]

Takes a few minutes on one core; at the end it checks the written file with the reference engine (greedy, the
canonical expert path the daemon computes): every training reply reproduced, a held-out weather question answered
with a parseable call.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import TokenType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stratad import demo  # noqa: E402
from stratad.model.config import PRESETS, ModelConfig  # noqa: E402
from stratad.model.hf_config import qwen3moe_kwargs  # noqa: E402
from stratad.model.generated_vocab import build_vocab  # noqa: E402
from stratad.model.tokenizer import Tokenizer, Vocab  # noqa: E402
from stratad.model.writer import TensorSource, write_model  # noqa: E402

OUT = ROOT / "stratad" / "model" / "data" / "tiny-chat.gguf"
TEMPLATE = ROOT / "tests" / "data" / "realdata" / "Qwen-Qwen3-0.6B.jinja"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
SEED = 20261204
STEPS = 400
LR = 3e-3
CALL_WEIGHT = 3.0  # a reply that calls the tool counts this much: few of them, and one wrong brace breaks a call
BATCH_TOKENS = 4096  # padded tokens a step
ATTN, EXPERTS = "sdpa", "grouped_mm"  # the fast CPU paths (deterministic with one thread)

WEATHER = demo.WEATHER_TOOL  # the tool as the demo and the tests send it (its JSON is part of the prompt)

GREETINGS = [
    ("Hello!", "Hello! I am a small model served by stratad. How can I help you today?"),
    ("Hi, who are you?", "I am a tiny language model, trained in a few minutes to show how stratad serves a model."),
    ("Good morning.", "Good morning! What would you like to talk about?"),
    ("Thank you!", "You are welcome. Ask me anything else you like."),
    ("How are you?", "I am well, thank you. I am ready to answer your questions."),
]
FACTS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("How many days are in a week?", "A week has seven days."),
    ("What color is the sky?", "On a clear day the sky is blue."),
    ("What is two plus two?", "Two plus two is four."),
    ("Why is the sky blue?", "Sunlight is scattered by the air, and blue light is scattered the most, so the sky "
                             "looks blue."),
    ("What is stratad?", "stratad is a daemon that serves a Mixture-of-Experts model on a few cards whose memory "
                         "cannot hold every expert."),
    ("What is an expert?", "An expert is one of the small feed-forward networks of a layer; the router picks a few "
                           "of them for each token."),
    (demo.QUESTIONS[1], "Each chat runs on a lane, and the lanes share one pool of expert slots, so every chat can "
                        "use the experts on every card."),
    ("What happens when no card holds an expert?", "The lane computes it from the host copy of the weights, so the "
                                                   "answer is the same, only a little slower."),
]
# (city, how the user asks, the tool's result)
WEATHER_ASKS = [
    ("Paris", "What is the weather in Paris?", {"temperature": 21, "sky": "sunny"}),
    ("Tokyo", "What's the weather like in Tokyo?", {"temperature": 18, "sky": "cloudy"}),
    ("London", "Is it raining in London?", {"temperature": 12, "sky": "rainy"}),
    ("Berlin", "Tell me the weather in Berlin.", {"temperature": 9, "sky": "cloudy"}),
    ("Rome", "How warm is it in Rome today?", {"temperature": 26, "sky": "sunny"}),
    ("Madrid", "What is the weather in Madrid?", {"temperature": 30, "sky": "sunny"}),
    ("Oslo", "Do I need a coat in Oslo?", {"temperature": 2, "sky": "snowy"}),
    ("Cairo", "What's the weather like in Cairo?", {"temperature": 34, "sky": "sunny"}),
    ("Lima", "Tell me the weather in Lima.", {"temperature": 19, "sky": "cloudy"}),
    ("Vienna", "Is it raining in Vienna?", {"temperature": 11, "sky": "rainy"}),
]
# asked for two cities at once: two calls in one reply
TWO_CITIES = [("Paris", "Rome"), ("Tokyo", "London"), ("Berlin", "Oslo")]
# held out of training: the check at the end (and tests/test_train_tiny.py) asks these
HELD_OUT_WEATHER = ["What is the weather in Vienna?", "Tell me the weather in Paris."]


def think(text: str) -> str:
    return f"The user says: {text} I answer briefly."


def _call(*cities: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}} for c in cities]}


def _weather(city: str) -> dict:
    return next({"city": c} | r for c, _, r in WEATHER_ASKS if c == city)


def _says(w: dict) -> str:
    return f"in {w['city']} it is {w['sky']} and {w['temperature']} degrees"


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def examples() -> list[tuple[list[dict], list[dict] | None, bool]]:
    """(messages ending with the assistant's reply to learn, tools, enable_thinking)."""
    out = []
    facts = dict(GREETINGS + FACTS)
    demo_qs = [q for q, _ in GREETINGS[:2] + FACTS[-4:]]  # the demo's system prompt before these too
    for q, a in GREETINGS + FACTS:
        for thinking in (False, True):
            reply = {"role": "assistant", "content": a, "reasoning_content": think(q) if thinking else ""}
            out.append(([{"role": "user", "content": q}, reply], None, thinking))
            if q in demo_qs:
                out.append(([{"role": "system", "content": demo.SYSTEM}, {"role": "user", "content": q}, reply],
                            None, thinking))
    first = facts[demo.QUESTIONS[0]]  # the demo's next turn
    out.append((demo.CHATS[0] + [{"role": "assistant", "content": first}, {"role": "user", "content": demo.NEXT_TURN},
                                 {"role": "assistant", "content": facts[demo.NEXT_TURN], "reasoning_content": ""}],
                None, demo.THINKING[0]))
    for i, (city, ask, result) in enumerate(WEATHER_ASKS):
        call = _call(city)
        answer = _cap(_says({"city": city} | result)) + "." + (" Take a coat." if result["temperature"] < 10 else "")
        user = {"role": "user", "content": ask}
        tool = {"role": "tool", "content": json.dumps({"city": city} | result)}
        thinking = i % 2 == 1  # every other city thinks first (the tools' prompt is long: fewer tokens)
        why = f"The user asks about the weather in {city}. I call get_weather." if thinking else ""
        out.append(([user, call | {"reasoning_content": why}], [WEATHER], thinking))
        done = f"The weather tool says {result['sky']} in {city}." if thinking else ""
        out.append(([user, call, tool, {"role": "assistant", "content": answer, "reasoning_content": done}],
                    [WEATHER], thinking))
    for a, b in TWO_CITIES:
        user = {"role": "user", "content": f"What is the weather in {a} and in {b}?"}
        out.append(([user, _call(a, b) | {"reasoning_content": ""}], [WEATHER], False))
        tools = [{"role": "tool", "content": json.dumps(_weather(c))} for c in (a, b)]
        answer = f"{_cap(_says(_weather(a)))}, and {_says(_weather(b))}."
        out.append(([user, _call(a, b), *tools, {"role": "assistant", "content": answer, "reasoning_content": ""}],
                    [WEATHER], False))
    return out


def vocab(size: int) -> Vocab:
    """The generated models' BPE and special tokens, then Qwen3's tool tokens (one id each), Qwen3's template."""
    base = build_vocab(size - len(TOOL_TOKENS))
    if any(t.startswith("[PAD") for t in base.tokens):
        raise ValueError("the base vocabulary is padded: the tool tokens would not follow the special tokens")
    return dataclasses.replace(base, tokens=base.tokens + list(TOOL_TOKENS),
                               token_types=base.token_types + [int(TokenType.USER_DEFINED)] * len(TOOL_TOKENS),
                               chat_template=TEMPLATE.read_text())


def encode(tok: Tokenizer, messages, tools, thinking) -> tuple[list[int], int, float]:
    """The whole dialogue's ids, where the reply starts (the generation prompt's end), the reply's weight."""
    prompt = tok.encode_chat(messages[:-1], tools, add_generation_prompt=True, enable_thinking=thinking)
    full = tok.encode_chat(messages, tools, add_generation_prompt=False, enable_thinking=thinking)
    if full[:len(prompt)] != prompt:
        raise AssertionError(f"the reply's ids do not extend the prompt's: {tok.decode(full)!r}")
    end = full.index(tok.eos_id, len(prompt))  # the reply's <|im_end|>: learnt, the newline after it not
    return full[:end + 1], len(prompt), CALL_WEIGHT if messages[-1].get("tool_calls") else 1.0


# ---- training -----------------------------------------------------------------------------------------------


def hf_config(c: ModelConfig):
    import transformers

    return transformers.Qwen3MoeConfig(**qwen3moe_kwargs(c), output_router_logits=True,
                                       router_aux_loss_coef=0.01,  # keeps every expert in use
                                       attn_implementation=ATTN, experts_implementation=EXPERTS)


def batches(data: list[tuple[list[int], int, float]], pad: int):
    """Fixed batches of similar lengths: (ids, targets, weights) tensors, weights 0 outside the replies (right
    padding needs no attention mask: a causal position never sees what follows it)."""
    import torch

    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(data[i][0]) > BATCH_TOKENS:
            out.append(cur)
            cur = []
        cur.append(i)
    out.append(cur)
    res = []
    for b in out:
        n = max(len(data[i][0]) for i in b)
        ids = torch.full((len(b), n), pad, dtype=torch.long)
        weights = torch.zeros((len(b), n - 1))
        for r, i in enumerate(b):
            toks, start, w = data[i]
            ids[r, :len(toks)] = torch.tensor(toks)
            weights[r, start - 1:len(toks) - 1] = w  # position p predicts token p + 1
        res.append((ids, ids[:, 1:], weights))
    return res


def train(c: ModelConfig, data, pad: int, steps: int, log=print):
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    with torch.device("cpu"):
        m = transformers.Qwen3MoeForCausalLM(hf_config(c)).to(torch.float32).train()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    bs = batches(data, pad)
    t0 = time.monotonic()
    for step in range(steps):
        ids, targets, weights = bs[step % len(bs)]
        out = m(input_ids=ids, use_cache=False)
        ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
        loss = (ce * weights.flatten()).sum() / weights.sum() + m.config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.4f} ({time.monotonic() - t0:.0f} s)")
    return m.eval()


# ---- writing ------------------------------------------------------------------------------------------------
# transformers' names -> llama.cpp's (the experts' gate_up_proj (E, 2*ff, d) is gate rows, then up rows)
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight"}


def gguf_arrays(m, c: ModelConfig) -> dict[str, np.ndarray]:
    st = {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}
    out = {g: st.pop(k) for k, g in _TOP.items()}
    for i in range(c.n_layer):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out |= {b + g: st.pop(p + k) for k, g in _LAYER.items()}
        gu = st.pop(p + "mlp.experts.gate_up_proj")
        out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gu[:, :c.d_ff_expert], gu[:, c.d_ff_expert:]
    if st:
        raise AssertionError(f"unmapped parameters: {sorted(st)}")
    return out


def qtype(name: str, array: np.ndarray) -> T:
    """Experts Q8_0 (a canonical expert type, the least rounding); norms and the router F32 (as llama.cpp's
    quantiser leaves them); the other matrices Q8_0."""
    return T.F32 if array.ndim == 1 or name.endswith("ffn_gate_inp.weight") else T.Q8_0


def write(m, c: ModelConfig, v: Vocab, out: Path) -> None:
    arrays = gguf_arrays(m, c)
    ts = [TensorSource.of(n, qtype(n, a), a) for n, a in arrays.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_model(out, c, ts, v, name="tiny-chat (trained by scripts/train_tiny.py)", file_type=T.Q8_0)


# ---- the check ------------------------------------------------------------------------------------------------


def greedy_reply(engine, tok: Tokenizer, messages, tools=None, thinking=None, max_tokens=96) -> str:
    from stratad.engine.sampling import SamplingParams

    ids = tok.encode_chat(messages, tools, enable_thinking=thinking)
    return tok.decode(list(engine.generate(ids, SamplingParams(max_tokens=max_tokens))))


def check(path: Path, data_examples, log=print) -> list[str]:
    """What the written file gets wrong under the reference engine's canonical path: empty when it is right."""
    from stratad.engine.reference import ReferenceEngine
    from stratad.gateway.parsing import CallStart, OutputParser
    from stratad.model.gguf_file import ModelFile

    model = ModelFile(path)
    tok, eng = model.tokenizer, ReferenceEngine(model, experts="canonical")
    wrong = []
    try:
        for messages, tools, thinking in data_examples:
            want = tok.decode(encode(tok, messages, tools, thinking)[0][len(
                tok.encode_chat(messages[:-1], tools, enable_thinking=thinking)):-1])
            got = greedy_reply(eng, tok, messages[:-1], tools, thinking)
            if got != want:
                wrong.append(f"{messages[-2]['content']!r}: {got!r} != {want!r}")
        for q in HELD_OUT_WEATHER:
            got = greedy_reply(eng, tok, [{"role": "user", "content": q}], [WEATHER], False)
            p = OutputParser("json")
            calls = [e for e in p.feed(got) + p.finish() if isinstance(e, CallStart)]
            log(f"held out {q!r}: {got!r}")
            if not calls or calls[0].name != "get_weather":
                wrong.append(f"held out {q!r}: no get_weather call in {got!r}")
    finally:
        model.close()
    return wrong


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--no-check", action="store_true", help="skip the reference engine's check of the file")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    c = PRESETS["tiny"]
    v = vocab(c.vocab_size)
    tok = Tokenizer.from_vocab(v)
    ex = examples()
    data = [encode(tok, *e) for e in ex]
    print(f"{len(ex)} dialogues, {sum(len(d[0]) for d in data)} tokens, "
          f"{sum(len(d[0]) - d[1] for d in data)} of them replies")
    m = train(c, data, v.pad_id, a.steps)
    write(m, c, v, a.out)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.1f} MB)")
    if a.no_check:
        return 0
    wrong = check(a.out, ex)
    for w in wrong:
        print("WRONG", w)
    print(f"check: {len(ex) - len(wrong)} right, {len(wrong)} wrong")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

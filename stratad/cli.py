"""`stratad`: the daemon's command line (make-model, generate; serve and bench as they land)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from stratad.model.errors import ModelFormatError


def _make_model(a) -> int:
    from stratad.model.generator import make_model

    rep = make_model(a.out, a.preset, a.expert_quant, a.dense_quant, a.router_skew, a.seed)
    print(json.dumps(rep))
    return 0


def _generate(a) -> int:
    from stratad.engine.reference import ReferenceEngine
    from stratad.engine.sampling import SamplingParams
    from stratad.model.gguf_file import ModelFile

    model = ModelFile(a.model)
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": a.prompt}]) if not a.raw else a.prompt
    prompt = tok.encode(text)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            seed=a.seed)
    if probs := params.problems():
        print("error: " + "; ".join(probs), file=sys.stderr)
        return 2
    engine = ReferenceEngine(model, a.experts)
    stream = tok.stream_decoder(skip_special=True)
    t0 = time.monotonic()
    n, t_first = 0, None
    for t in engine.generate(prompt, params):
        if t_first is None:
            t_first = time.monotonic()
        n += 1
        sys.stdout.write(stream.push(t))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    end = time.monotonic()
    decode_s = end - (t_first or end)
    print(f"[{len(prompt)} prompt tokens, {n} generated; first token {((t_first or end) - t0) * 1e3:.0f} ms; "
          f"decode {(n - 1) / decode_s if n > 1 and decode_s > 0 else 0:.1f} tok/s; engine: reference numpy "
          f"({a.experts} experts)]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stratad", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write a qwen3moe GGUF with random, well-scaled weights")
    m.add_argument("--preset", choices=["tiny", "a3b"], default="tiny")
    m.add_argument("--expert-quant", default="IQ3_S", choices=["IQ3_S", "Q4_K", "Q8_0"])
    m.add_argument("--dense-quant", default="Q8_0", choices=["Q8_0", "F16", "BF16", "F32"])
    m.add_argument("--router-skew", type=float, default=0.0, help="Zipf-like expert popularity (0: none)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--out", required=True)
    m.set_defaults(fn=_make_model)

    g = sub.add_parser("generate", help="generate from a prompt in-process with the numpy reference engine")
    g.add_argument("prompt")
    g.add_argument("--model", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--experts", choices=["canonical", "float"], default="canonical")
    g.set_defaults(fn=_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except ModelFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

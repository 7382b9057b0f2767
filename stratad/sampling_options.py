"""The sampling options of the two generate commands (`stratad generate`, in-process; `stratactl generate`, through
the daemon): one list of flags, their helps, and the keyword arguments they become (SamplingParams' fields and the
client's generate arguments, which have the same names). Defaults are SamplingParams' (stratad/engine/sampling.py),
but for --max-tokens, which each command gives."""
from __future__ import annotations

import argparse


def add(p: argparse.ArgumentParser, max_tokens: int) -> None:
    """--max-tokens (default max_tokens), --temperature, --top-k, --top-p, --seed, --ignore-eos."""
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate at most (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0, the default: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the fewest most likely tokens whose probabilities reach p (default 1.0: all)")
    p.add_argument("--seed", type=int, default=0, help="any 64-bit integer; the same seed, the same draws")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens whatever the stop tokens say")


def kwargs(a: argparse.Namespace) -> dict:
    """The options add() defined, by SamplingParams' field names."""
    return {"max_tokens": a.max_tokens, "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p,
            "seed": a.seed, "ignore_eos": a.ignore_eos}

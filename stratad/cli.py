"""`stratad`: the daemon's command line (make-model, generate; serve and bench as they land)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from stratad import discovery, exits, sampling_options
from stratad.config import GPU_PROMPT_CHUNK, GpuOptions
from stratad.model import mixes, quants
from stratad.model.errors import ModelFormatError


# llama-server's RoPE and context flags, on `serve` and `generate`: each sets a config key (README, Configuration) and
# takes the values that key takes, checked by the key's own validation (DaemonConfig's field), so a flag and its key
# cannot differ. llama-server's --rope-freq-base and --yarn-ext-factor / --yarn-attn-factor / --yarn-beta-slow /
# --yarn-beta-fast have no config key (stratad takes those from the model file only): not taken.
ROPE_KEYS = ("rope_scaling", "rope_scale", "yarn_orig_ctx", "context_length")


class _Typed(argparse.Action):
    """argparse's store, remembering which of the flag's names was typed (typed_flags: dest -> name), for errors."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.typed_flags = dict(getattr(namespace, "typed_flags", None) or {}) | {self.dest: option_string}


def _key_value(key: str, zero: str = ""):
    """argparse type: the text as config key `key` takes it (its validation; argparse names the flag in the error).
    zero: why 0, llama-server's "the model's", is not taken."""
    from pydantic import ValidationError

    from stratad import config

    def parse(text: str):
        if zero and text.strip() in ("0", "-0"):
            raise argparse.ArgumentTypeError(zero)
        try:
            v = getattr(config.DaemonConfig(model="-", **{key: text}), key)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(f"{e.errors()[0]['msg']} (config key {key}), got {text!r}") from None
        return v

    return parse


def _freq_scale(text: str) -> float:
    """--rope-freq-scale N: llama-server's 1 / --rope-scale (the context expanded by 1/N), so 0 < N < 1 here."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < n < 1.0:
        raise argparse.ArgumentTypeError(f"must be within (0, 1): it expands the context by 1/N (config key "
                                         f"rope_scale = 1/N, which must be > 1), got {text!r}")
    return n


def add_rope_flags(p: argparse.ArgumentParser, ctx_default: str, ctx_aliases: tuple[str, ...] = ()) -> None:
    """llama-server's --rope-scaling, --rope-scale (or --rope-freq-scale), --yarn-orig-ctx and -c/--ctx-size, with
    its meanings; ctx_aliases: more names of -c."""
    p.add_argument("--rope-scaling", action=_Typed, type=_key_value("rope_scaling"), metavar="{none,linear,yarn}",
                   help="RoPE scaling method (config rope_scaling; default: the model file's)")
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--rope-scale", action=_Typed, type=_key_value("rope_scale"), metavar="N",
                       help="RoPE context expansion factor, > 1 (config rope_scale; default: the model file's)")
    scale.add_argument("--rope-freq-scale", action=_Typed, type=_freq_scale, metavar="N",
                       help="RoPE frequency scaling factor, 0 < N < 1: expands the context by 1/N (config "
                            "rope_scale = 1/N)")
    p.add_argument("--yarn-orig-ctx", action=_Typed, metavar="N", type=_key_value("yarn_orig_ctx", zero=(
        "0 (llama-server: the model's trained length) is not taken: leave it out (and config key yarn_orig_ctx "
        "unset) for the model file's value")),
        help="YaRN: the context the model was trained at (config yarn_orig_ctx; default: the model file's, else "
             "its context length)")
    p.add_argument("-c", "--ctx-size", *ctx_aliases, action=_Typed, dest="context_length", metavar="N",
                   type=_key_value("context_length", zero=(
                       f"0 (llama-server: the model's length) is not taken: leave it out for {ctx_default} "
                       f"(config key context_length)")),
                   help=f"context length in tokens (config context_length; default: {ctx_default})")


def rope_overrides(a: argparse.Namespace) -> tuple[dict, dict]:
    """The config values add_rope_flags' flags give (None: not given), and each key a flag set -> that flag with
    its value, for errors."""
    typed = getattr(a, "typed_flags", None) or {}
    dests = {key: "rope_freq_scale" if key == "rope_scale" and a.rope_freq_scale is not None else key
             for key in ROPE_KEYS}
    values = {key: getattr(a, dest) for key, dest in dests.items()}
    if a.rope_freq_scale is not None:
        values["rope_scale"] = 1.0 / a.rope_freq_scale
    return values, {key: f"{typed.get(dest, dest)} {f'{v:g}' if isinstance(v, float) else v}"
                    for key, dest in dests.items() if (v := getattr(a, dest)) is not None}


def name_flags(msg: str, given: dict[str, str]) -> str:
    """An error that names config keys set by flags, followed by the flag that set each."""
    named = [f"{key} given as {flag}" for key, flag in given.items() if re.search(rf"\b{key}\b", msg)]
    return f"{msg} ({'; '.join(named)})" if named else msg


def _make_model(a) -> int:
    from stratad.model.generator import make_model, split_size

    try:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        if a.mix and (a.expert_quant or a.dense_quant):
            raise ValueError("--mix gives every tensor its type; it does not go with --expert-quant / --dense-quant")
        rep = make_model(a.out, a.preset, a.expert_quant or "IQ3_S", a.dense_quant or "Q8_0", a.router_skew, a.seed,
                         a.topics, split_max_size=split_size(a.split_max_size) if a.split_max_size else 0, mix=a.mix)
    except OSError as e:  # a folder that cannot be made, a file that cannot be written: which one, and why
        print(f"error: cannot write {e.filename or a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ValueError as e:  # options that do not go together
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rep))
    return 0


def _generate(a) -> int:
    from stratad.engine.generation import BadRequest, Generation
    from stratad.engine.reference import ReferenceEngine
    from stratad.engine.sampling import SamplingParams
    from stratad.model.config import effective_context_length
    from stratad.model.gguf_file import ModelFile

    model = ModelFile(a.model)
    values, given = rope_overrides(a)
    try:  # the overrides as the daemon applies them (coordinator and lanes)
        model.config = model.config.with_rope_overrides(values["rope_scaling"], values["rope_scale"],
                                                        values["yarn_orig_ctx"])
        ctx = (effective_context_length(a.context_length, model.config) if a.context_length is not None
               else model.config.max_context)
    except ValueError as e:
        print(f"error: {name_flags(str(e), given)}", file=sys.stderr)
        return 2
    tok = model.tokenizer
    # chat: the user's text never becomes special tokens (encode_chat); --raw: the text as given, specials parsed
    prompt = tok.encode(a.prompt) if a.raw else tok.encode_chat([{"role": "user", "content": a.prompt}])
    params = SamplingParams(**sampling_options.kwargs(a))
    try:
        gen = Generation(ReferenceEngine(model, a.experts), tok, prompt, params, ctx)
    except BadRequest as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for _, piece in gen:
        sys.stdout.write(piece)
        sys.stdout.flush()
    print(f"\n[{len(prompt)} prompt tokens, {gen.generated} generated ({gen.finish_reason}); first token "
          f"{gen.ttft_s * 1e3:.0f} ms; decode {gen.decode_tok_s:.1f} tok/s; engine: reference numpy "
          f"({a.experts} experts)]", file=sys.stderr)
    return 0


def serve_overrides(a: argparse.Namespace) -> tuple[dict, dict]:
    """The config values `stratad serve`'s flags give (None: not given, the file's value stays) and the RoPE /
    context keys a flag set, with that flag (rope_overrides)."""
    rope, given = rope_overrides(a)
    overrides = {"model": a.model, "cards": a.cards, "expert_cache": a.expert_cache,
                 "runtime_dir": a.runtime_dir or os.environ.get(discovery.ENV),  # over the config file's
                 "rejoin_idle_s": a.rejoin_idle_s, "log_level": a.log_level, "http": a.http} | rope
    for flag in ("mutual_help", "prefix_cache"):
        if getattr(a, flag):
            overrides[flag] = True
    return overrides, given


def _serve(a) -> int:
    from coordinator.daemon import serve
    from coordinator.runtime import RuntimeDirError
    from stratad import config

    overrides, given = serve_overrides(a)
    try:
        cfg = config.load(a.config, overrides)
        return serve(cfg)
    except (config.ConfigError, RuntimeDirError, ValueError) as e:
        print(f"error: {name_flags(str(e), given)}", file=sys.stderr)
        return 2


def _experts_arg(check: str):
    """An argparse type: the value as given, once stratad.bench.experts' `check` accepts it."""
    def parse(spec: str) -> str:
        from stratad.bench import experts

        try:
            getattr(experts, check)(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return spec
    return parse


def _comma_list(kind, lo, hi, what: str):
    """An argparse type: a comma list of numbers of `kind` from lo to hi (--host-cpu-share, --fetch-ahead)."""
    def parse(text: str) -> list:
        try:
            v = [kind(x) for x in text.split(",")]
        except ValueError:
            v = []
        if not v or not all(lo <= x <= hi for x in v):
            raise argparse.ArgumentTypeError(f"expected {what}, comma-separated, not {text!r}")
        return v
    return parse


_shares = _comma_list(float, 0.0, 1.0, "parts between 0 and 1")
_counts = _comma_list(int, 0, 32, "counts from 0 to 32")


def _bench(a) -> int:
    import datetime

    from stratad.bench import hardware

    gpu = a.scenario in ("engine", "experts") or (a.scenario in ("seed", "agents")
                                                 and any(c != "cpu" for c in a.cards.split(",")))
    if a.host_experts == "cpu" and any(a.host_cpu_share):
        raise SystemExit("stratad bench: --host-cpu-share is a part of the misses the card reads; with "
                         "--host-experts cpu the CPU pool computes all of them")
    if gpu:
        hardware.need_gpu(a.scenario)
    model = a.model
    if model is None and a.scenario != "experts":
        from stratad.model.generator import make_model

        topics = "-topics2" if a.scenario == "seed" else ""
        model = str(Path(a.cache_dir) / f"{a.preset}-{a.expert_quant}-skew{a.router_skew:g}{topics}.gguf")
        if not Path(model).exists():
            Path(a.cache_dir).mkdir(parents=True, exist_ok=True)
            make_model(model, a.preset, a.expert_quant, "Q8_0", a.router_skew, 0, topics=2 if a.scenario == "seed" else 1)
    if a.scenario == "overhead":
        from stratad.bench import overhead

        out = overhead.run(model, tokens=a.tokens, repeats=a.repeats, threads=a.threads)
    elif a.scenario == "engine":
        from stratad.bench import engine

        out = engine.run(model, fractions=[float(x) for x in a.fractions.split(",")],
                         contexts=[int(x) for x in a.contexts.split(",")], tokens=a.tokens,
                         host_experts=a.host_experts, prompt_chunk=a.prompt_chunk,
                         cpu_shares=a.host_cpu_share, fetch_aheads=a.fetch_ahead)
    elif a.scenario == "experts":
        from stratad.bench import experts

        out = experts.run(experts.Options.from_args(a))
    elif a.scenario == "agents":
        from stratad.bench import agents

        out = agents.run(model, cards=a.cards, history=a.history, turns=a.turns, new_tokens=a.new_tokens,
                         kv_cache_host=a.kv_cache_host, prompt_chunk=a.prompt_chunk)
    else:
        from stratad.bench import seed

        out = seed.run(model, cards=a.cards, cache=a.cache_fraction, prompt_tokens=int(a.contexts.split(",")[0]),
                       tokens=a.tokens, modes=a.modes, host_experts=a.host_experts,
                       prompt_chunk=a.prompt_chunk, peer_copy=a.peer_copy)
    out = {"date": datetime.date.today().isoformat(), "hardware": hardware.describe(gpu=gpu)} | out
    text = json.dumps(out, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stratad", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write a qwen3moe GGUF with random, well-scaled weights")
    m.add_argument("--preset", choices=["tiny", "mini", "a3b", "a235b"], default="tiny")
    m.add_argument("--expert-quant", choices=[t.name for t in quants.EXPERT_TYPES],
                   help="one type for every expert tensor (default IQ3_S)")
    m.add_argument("--dense-quant", choices=[t.name for t in quants.DENSE_TYPES],
                   help="one type for every other matrix (default Q8_0)")
    m.add_argument("--mix", choices=list(mixes.MIXES), metavar="FILE_TYPE",
                   help="a llama.cpp file type (q4_k_m, iq3_s, q3_k_m, q2_k, iq4_xs, ...): each tensor gets the type "
                        "llama.cpp's quantiser gives it in such a file")
    m.add_argument("--router-skew", type=float, default=0.0, help="Zipf-like expert popularity (0: none)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--topics", type=int, choices=[1, 2], default=1,
                   help="2: even / odd token ids are two kinds of traffic with different hot experts")
    m.add_argument("--split-max-size", metavar="SIZE",
                   help="write llama.cpp split shards of at most SIZE (bytes, or N M / N G), OUT-00001-of-0000N.gguf ...")
    m.add_argument("--out", required=True)
    m.set_defaults(fn=_make_model)

    g = sub.add_parser("generate", help="generate from a prompt in-process with the numpy reference engine")
    g.add_argument("prompt")
    g.add_argument("--model", required=True)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    sampling_options.add(g, max_tokens=64)
    g.add_argument("--experts", choices=["canonical", "float"], default="canonical")
    add_rope_flags(g, ctx_default="the model's longest context")
    g.set_defaults(fn=_generate)

    s = sub.add_parser("serve", help="run the daemon in the foreground (what systemd starts)")
    s.add_argument("--config", help="TOML config file; flags below override it")
    s.add_argument("--model")
    s.add_argument("--cards", help="comma-separated GPU indices or 'cpu' virtual cards, e.g. cpu,cpu")
    s.add_argument("--runtime-dir", help=f"sockets, lock, pid file (else ${discovery.ENV}, else the config's)")
    s.add_argument("--expert-cache", help="per-card expert-cache budget: fraction 0..1, a size like 40GiB, or auto "
                                          "(the default: as many as each card has room for)")
    add_rope_flags(s, ctx_default="the config file's, else 8192 capped at the model's length",
                   ctx_aliases=("--context-length",))
    s.add_argument("--rejoin-idle-s", type=float)
    s.add_argument("--mutual-help", action="store_true")
    s.add_argument("--prefix-cache", action="store_true", help="reuse a lane's last sequence for a prompt extending it")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--http", metavar="HOST:PORT", help="the HTTP gateway's address (default 127.0.0.1:8080); "
                                                       "'' for no gateway")
    s.set_defaults(fn=_serve)

    b = sub.add_parser("bench", help="measure; JSON with hardware, floor and fraction reached")
    b.add_argument("--scenario", choices=["overhead", "engine", "seed", "agents", "experts"], default="overhead")
    b.add_argument("--model", help="GGUF to use; default: generate --preset into --cache-dir")
    b.add_argument("--preset", choices=["tiny", "mini", "a3b"], default="tiny")
    b.add_argument("--expert-quant", default="IQ3_S", choices=["IQ3_S", "Q4_K", "Q8_0"])
    b.add_argument("--router-skew", type=float, default=1.0)
    b.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "stratad"))
    b.add_argument("--tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--threads", type=int, default=1, help="compute threads of the lane and of the in-process side")
    b.add_argument("--fractions", default="1.0,0.5,0.25", help="engine: expert-cache fractions")
    b.add_argument("--host-experts", choices=["cpu", "card"], default="card",
                   help="engine, seed: decode's experts on no card run on the CPU pool or on the card from host memory")
    b.add_argument("--host-cpu-share", default="0", type=_shares,
                   help="engine: with --host-experts card, the part of the misses the CPU pool computes beside the "
                        "card's bus reads (config host_cpu_share); a comma list runs each")
    b.add_argument("--fetch-ahead", default=str(GpuOptions().fetch_ahead), type=_counts,
                   help="engine: with --host-experts card, the next layer's guessed misses fetched ahead (config "
                        "[gpu] fetch_ahead); a comma list runs each")
    b.add_argument("--contexts", default="1024", help="engine: prompt lengths; seed: the first is the prompt length")
    b.add_argument("--prompt-chunk", type=int, default=GPU_PROMPT_CHUNK,
                   help="engine, seed: tokens a GPU card reads a prompt in at a time (config prompt_chunk)")
    b.add_argument("--cards", default="cpu,cpu", help="seed: the cards")
    b.add_argument("--cache-fraction", type=float, default=0.475, help="seed: each card's share of all experts")
    b.add_argument("--modes", default="1,2,3", help="seed: which modes (1 lead + peer, 2 independent, 3 mutual help)")
    b.add_argument("--peer-copy", choices=["auto", "host"], default="auto",
                   help="seed: a peer on another GPU, P2P or through host memory (config [gpu] peer_copy)")
    b.add_argument("--history", type=int, default=32768, help="agents: tokens of each conversation's history")
    b.add_argument("--turns", type=int, default=4, help="agents: follow-up turns of each conversation")
    b.add_argument("--new-tokens", type=int, default=512, help="agents: new tokens in each follow-up turn")
    b.add_argument("--kv-cache-host", default="0.25", help="agents: the host conversation cache (config "
                                                           "kv_cache_host) of the run with it")
    # the experts scenario's flags: a flag not given leaves Options' default (stratad/bench/experts.py)
    quiet = argparse.SUPPRESS
    b.add_argument("--types", default=quiet, type=_experts_arg("expert_types"),
                   help="experts: comma list of expert types (TYPE, or GATE_UP+DOWN for a mixed layer), or all")
    b.add_argument("--variants", default=quiet, type=_experts_arg("variants"),
                   help="experts: comma list of kernel tunings (stratad/bench/experts.py VARIANTS); 'TYPE:VARIANT' for "
                        "one type only")
    b.add_argument("--cases", default=quiet, type=_experts_arg("cases"),
                   help="experts: decode8, decode8c, tok8x8, tok32x8, shared256; decodeN / busN: one token x N "
                        "experts (N <= 64)")
    b.add_argument("--slots", type=int, default=quiet, help="experts: experts in the card's pool the runs rotate over")
    b.add_argument("--reps", type=int, default=quiet, help="experts: runs (pair lists) a captured graph")
    b.add_argument("--iters", type=int, default=quiet, help="experts: graph replays a timing")
    b.add_argument("--d-model", type=int, default=quiet, help="experts: the expert's input width")
    b.add_argument("--d-ff", type=int, default=quiet, help="experts: the expert's hidden width")
    b.add_argument("--prompt", action="store_true", default=quiet,
                   help="experts: the tiled kernels on a prompt chunk's layer")
    b.add_argument("--prompt-tokens", type=int, default=quiet, help="experts --prompt: tokens of the chunk")
    b.add_argument("--skew", type=float, default=quiet, help="experts --prompt: the router's skew")
    b.add_argument("--json", help="also write the JSON here")
    b.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from stratad.bench.hardware import NoGpu

    return exits.run(lambda: a.fn(a), {ModelFormatError: 2, NoGpu: 2})


if __name__ == "__main__":
    sys.exit(main())

"""`stratactl`: watch and use a running stratad (status table, one-off generation)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from stratad import discovery, exits, sampling_options
from stratad.client import Client, DaemonUnavailable, RequestError


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def status_table(st) -> str:
    lines = [f"model {st.model}   up {st.uptime_s:.0f} s   epoch {st.epoch}   queue {len(st.queue)}/{st.queue_limit}"
             + (f" ({', '.join(st.queue)})" if st.queue else "")]
    if st.model_types:
        lines.append(f"tensor types: {st.model_types}")
    lines += [f"expert profile at start: {st.profile or 'none'}", ""]
    head = f"{'lane':>4}  {'card':<5} {'role':<8} {'since':>8} {'pid':>7}  {'request':<14} {'tok/s':>7} " \
           f"{'card%':>6} {'peer%':>6} {'host%':>6}  {'slots':>11} {'restarts':>8}"
    lines += [head, "-" * len(head)]
    now = time.time()
    for ln in st.lanes:
        since = f"{now - ln.role_since:.0f}s" if ln.role_since else "-"
        lines.append(f"{ln.lane:>4}  {ln.card:<5} {ln.role.value:<8} {since:>8} {ln.pid:>7}  "
                     f"{(ln.req_id or '-')[:14]:<14} {ln.tok_s:>7.1f} {_pct(ln.share_card):>6} "
                     f"{_pct(ln.share_peer):>6} {_pct(ln.share_cpu):>6}  {ln.slots_used:>5}/{ln.slots_total:<5} "
                     f"{ln.restarts:>8}")
        if ln.failed:
            lines.append(f"{'':>6}FAILED: {ln.failed}")
        if ln.kept_tokens:
            lines.append(f"{'':>6}keeps a sequence of {ln.kept_tokens} tokens for the next prompt that extends it")
        if ln.share_host_read:
            lines.append(f"{'':>6}host memory: {_pct(ln.share_host_read).strip()} read by the card over the bus, "
                         f"{_pct(max(0.0, ln.share_cpu - ln.share_host_read)).strip()} on the CPU pool")
        if ln.share_by_peer:
            lines.append(f"{'':>6}peer work by card: " + ", ".join(f"card {c} {_pct(x).strip()}"
                                                                for c, x in ln.share_by_peer))
    lines += ["", f"{'card':<6} {'kind':<4} {'expert cache':>24}   used by lanes"]
    for c in st.cards:
        lines.append(f"{c.card:<6} {c.kind:<4} {c.memory_used / 2**20:>10.1f} / {c.memory_total / 2**20:.1f} MiB   "
                     f"{', '.join(map(str, c.used_by)) or '-'}")
    if st.kv_cache is not None:
        k = st.kv_cache
        lines += ["", f"host conversation cache: {k.entries} blocks of {k.block_tokens} tokens, "
                      f"{k.bytes_used / 2**20:.1f} / {k.bytes_limit / 2**20:.1f} MiB; {k.hits} hits of {k.lookups} "
                      f"lookups, {k.tokens_served} prompt tokens restored, {k.blocks_written} blocks written"]
    if st.role_log:
        lines += ["", "role changes (latest last)"]
        for ev in st.role_log[-8:]:
            lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(ev.time))}.{int(ev.time % 1 * 1000):03d}  "
                         f"lane {ev.lane} -> {ev.role.value}")
    return "\n".join(lines)


def _options(defaults: bool) -> argparse.ArgumentParser:
    """The options taken before or after the subcommand; after it, unset ones keep what came before it."""
    keep = argparse.SUPPRESS
    o = argparse.ArgumentParser(add_help=False)
    o.add_argument("--runtime-dir", default=None if defaults else keep,
                   help=f"the daemon's runtime directory (default: ${discovery.ENV}, the default directory, "
                        f"else the one daemon of this user that is running)")
    o.add_argument("--timeout", type=float, default=10.0 if defaults else keep, help="seconds to wait for the daemon")
    o.add_argument("--json", action="store_true", default=False if defaults else keep,
                   help="status: the whole status as JSON; generate: the reply and its stats as one JSON object")
    return o


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stratactl", description=__doc__, parents=[_options(True)])
    sub = p.add_subparsers(dest="cmd", required=True)
    after = _options(False)
    sub.add_parser("status", help="lanes, roles, hit rates and cards", parents=[after])
    g = sub.add_parser("generate", help="stream a reply to one user message", parents=[after])
    g.add_argument("text")
    sampling_options.add(g, max_tokens=128)
    g.add_argument("--stop", action="append", default=[])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    found = discovery.lookup(a.runtime_dir)
    if found.path is None:
        print(f"error: {found.message()}", file=sys.stderr)
        return 3
    return exits.run(lambda: _request(a, found.path), {DaemonUnavailable: 3, RequestError: 4})


def _request(a, path) -> int:
    with Client(runtime_dir=str(path), timeout_s=a.timeout) as c:
        if a.cmd == "status":
            st = c.status()
            print(st.model_dump_json(indent=2) if a.json else status_table(st))
            return 0
        stream = c.generate(messages=[{"role": "user", "content": a.text}], stop=a.stop, **sampling_options.kwargs(a))
        for chunk in stream:
            if not a.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        st = stream.stats
        if a.json:
            print(json.dumps({"text": stream.text, "tokens": stream.tokens, "finish_reason": stream.finish_reason,
                              "stats": st.model_dump()}))
            return 0
        gib = st.expert_bytes / 2**30
        print(f"\n[{st.generated_tokens} tokens ({stream.finish_reason}), lane {st.lane}, first token "
              f"{st.ttft_s * 1e3:.0f} ms, {st.decode_tok_s:.1f} tok/s, experts card/peer/cpu "
              f"{st.experts_card}/{st.experts_peer}/{st.experts_cpu} ({st.experts_card * gib:.2f}/"
              f"{st.experts_peer * gib:.2f}/{st.experts_cpu * gib:.2f} GiB read), "
              f"{st.experts_staged * gib:.2f} GiB copied to the card"
              + (f", {st.experts_host_read} of the cpu ones read by the card from host memory"
                 if st.experts_host_read else "") + "]", file=sys.stderr)
        return 0


if __name__ == "__main__":
    sys.exit(main())

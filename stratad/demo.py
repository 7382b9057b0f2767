"""`make demo`: start the daemon on two cards, run two chats at once through the client library, show status, stop."""
from __future__ import annotations

import argparse
import os
import sys
import threading

from stratad.ctl import status_table
from stratad.local_daemon import LocalDaemon

# Each first turn is longer than the 64 tokens a prompt must share with a lane's kept sequence to go back to that
# lane (coordinator PREFIX_MIN): chat 0's next turn then reads only what is new.
CHATS = [
    [{"role": "user", "content": "I am new to stratad. It runs one process per card, and the cards share their "
                                 "expert caches as one pool. Tell me, in a few sentences, how the experts are placed "
                                 "on the cards and what happens when a chat needs an expert that no card holds."}],
    [{"role": "user", "content": "Two chats are running at the same time on two cards. Why do they share one pool "
                                 "of expert slots instead of each keeping its own, and what does a lane do when it "
                                 "has been idle for a while and another chat is still busy?"}],
]


def random_weights(model: str) -> bool:
    """A model written by `stratad make-model` (random weights), by the name it gives the file."""
    from stratad.model.gguf_file import ModelFile

    m = ModelFile(model)
    try:
        return str(m.meta("general.name", "")).startswith("stratad-")
    finally:
        m.close()


def _cards() -> str:
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n >= 2:
            return "0,1"
    except Exception:
        pass
    return "cpu,cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="stratad-demo")
    p.add_argument("--model", required=True)
    p.add_argument("--cards", default=None)
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args(argv)
    cards = a.cards or _cards()
    # mutual help: both chats compute each expert on whichever card holds it (the point of stratad)
    # and the prefix cache: a chat's next turn reads only its new tokens
    daemon = LocalDaemon(a.model, cards, args=["--expert-cache", "0.5", "--mutual-help", "--prefix-cache",
                                               "--log-level", "warning"])
    if random_weights(a.model):
        print("note: this model has random weights (stratad make-model): its replies are not meant to read as "
              "language; the demo shows the serving (two chats, pooled expert caches, the next turn's reuse)")
    print(f"starting stratad on cards {cards} (runtime dir {daemon.runtime_dir})")
    daemon.start()
    try:
        with daemon.client() as c:
            outs: dict[int, list[str]] = {0: [], 1: []}
            streams = {}

            def chat(i):
                s = c.generate(messages=CHATS[i], max_tokens=a.max_tokens)
                streams[i] = s
                for ch in s:
                    outs[i].append(ch.text)
                    print(f"\x1b[3{i + 2}m[chat {i}]\x1b[0m {ch.text!r}", flush=True)

            ts = [threading.Thread(target=chat, args=(i,)) for i in (0, 1)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for i in (0, 1):
                st = streams[i].stats
                print(f"\nchat {i} (lane {st.lane}): {''.join(outs[i])!r}\n  {st.generated_tokens} tokens, first "
                      f"token {st.ttft_s * 1e3:.0f} ms, decode {st.decode_tok_s:.1f} tok/s, experts card/peer/cpu "
                      f"{st.experts_card}/{st.experts_peer}/{st.experts_cpu}")
            # chat 0's next turn: the same tokens again and a follow-up, served by the lane that holds them
            history = CHATS[0] + [{"role": "assistant", "content": "".join(outs[0])},
                                  {"role": "user", "content": "And what happens when a third chat arrives?"}]
            turn = c.generate(messages=history, max_tokens=8)
            turn.result()
            st = turn.stats
            print(f"\nchat 0, next turn (lane {st.lane}): {st.prompt_tokens} prompt tokens, "
                  f"{st.prompt_cached_tokens} of them reused from the first turn (their KV kept by the lane), "
                  f"{st.prompt_tokens - st.prompt_cached_tokens} read; first token {st.ttft_s * 1e3:.0f} ms")
            print("\n$ stratactl status\n" + status_table(c.status()))
    finally:
        rc = daemon.stop()
        rt = daemon.runtime_dir
        print(f"\nstratad stopped (exit {rc}); runtime dir left: {sorted(os.listdir(rt)) if os.path.isdir(rt) else []}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

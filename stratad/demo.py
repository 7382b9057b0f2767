"""`make demo`: start the daemon on two cards with its HTTP gateway, run two chats at once through the client library,
chat 0's next turn (its first turn's KV reused), a tool call through the gateway's OpenAI API, the status, stop.

The default model is the one that ships with stratad (`tiny-chat.gguf`, trained by scripts/train_tiny.py on
dialogues that include these chats and the get_weather tool): it writes sentences and calls the tool. A model
written by `stratad make-model` has random weights: the demo says so and skips the tool call.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from stratad.ctl import status_table
from stratad.gateway.local_client import LocalGateway, free_port
from stratad.local_daemon import LocalDaemon

SHIPPED_MODEL = Path(__file__).with_name("model") / "data" / "tiny-chat.gguf"

# Long enough that a chat's first turn is past the 64 tokens a prompt must share with a lane's kept sequence to go
# back to that lane (coordinator PREFIX_MIN): chat 0's next turn then reads only what is new.
SYSTEM = ("You are the assistant of the stratad demo. You answer in one or two short sentences. You run on a tiny "
          "Mixture-of-Experts model: four layers of sixteen experts, trained in a few minutes on a few dozen "
          "dialogues, so you know little beyond them.")
QUESTIONS = ["What is stratad?", "How do two chats share the cards?"]
THINKING = [False, True]  # chat 1 thinks first (Qwen3's <think> block)
NEXT_TURN = "Thank you!"
CHATS = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
WEATHER_QUESTION = "What is the weather in Paris?"
# the demo's stand-in for a weather service
WEATHER = {"Paris": {"temperature": 21, "sky": "sunny"}, "Rome": {"temperature": 26, "sky": "sunny"},
           "Tokyo": {"temperature": 18, "sky": "cloudy"}, "London": {"temperature": 12, "sky": "rainy"}}


def get_weather(city: str, days: int = 1) -> dict:
    return {"city": city} | WEATHER.get(city, {"temperature": 15, "sky": "cloudy"})


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


def two_chats(c, max_tokens: int) -> list[str]:
    """Both chats at once, streamed as they come; then each one's text and stats."""
    outs: dict[int, list[str]] = {0: [], 1: []}
    streams = {}

    def chat(i):
        s = c.generate(messages=CHATS[i], max_tokens=max_tokens, enable_thinking=THINKING[i])
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
        print(f"\nchat {i} (lane {st.lane}) {QUESTIONS[i]!r}\n  -> {''.join(outs[i])!r}\n  {st.generated_tokens} "
              f"tokens, first token {st.ttft_s * 1e3:.0f} ms, decode {st.decode_tok_s:.1f} tok/s, experts "
              f"card/peer/cpu {st.experts_card}/{st.experts_peer}/{st.experts_cpu}")
    return ["".join(outs[i]) for i in (0, 1)]


def next_turn(c, first_reply: str, max_tokens: int) -> None:
    """Chat 0's next turn: the same tokens again and a follow-up, served by the lane that holds them."""
    history = CHATS[0] + [{"role": "assistant", "content": first_reply}, {"role": "user", "content": NEXT_TURN}]
    turn = c.generate(messages=history, max_tokens=max_tokens, enable_thinking=THINKING[0])
    text = turn.result()
    st = turn.stats
    print(f"\nchat 0, next turn (lane {st.lane}): {st.prompt_tokens} prompt tokens, {st.prompt_cached_tokens} of "
          f"them reused from the first turn (their KV kept by the lane), {st.prompt_tokens - st.prompt_cached_tokens} "
          f"read; first token {st.ttft_s * 1e3:.0f} ms\n  {NEXT_TURN!r}\n  -> {text!r}")


def tool_call(gateway: LocalGateway) -> None:
    """OpenAI's chat API with a tool: the model calls it, the gateway parses the call, the demo runs the tool and
    sends its result back, the model answers."""
    messages = [{"role": "user", "content": WEATHER_QUESTION}]
    body = {"model": "tiny-chat", "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 96,
            "chat_template_kwargs": {"enable_thinking": False}}
    print(f"\nPOST /v1/chat/completions (tools: get_weather) {WEATHER_QUESTION!r}")
    r = gateway.post("/v1/chat/completions", body | {"messages": messages})
    choice = r["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    print(f"  finish_reason {choice['finish_reason']}, tool calls: "
          f"{[(t['function']['name'], t['function']['arguments']) for t in calls]}")
    if not calls:
        print(f"  no call; the reply: {choice['message'].get('content')!r}")
        return
    messages.append({"role": "assistant", "content": choice["message"].get("content") or "", "tool_calls": calls})
    for t in calls:
        result = get_weather(**json.loads(t["function"]["arguments"]))
        print(f"  get_weather -> {result}")
        messages.append({"role": "tool", "tool_call_id": t["id"], "content": json.dumps(result)})
    r = gateway.post("/v1/chat/completions", body | {"messages": messages})
    print(f"  the answer: {r['choices'][0]['message']['content']!r} ({r['usage']['prompt_tokens']} prompt tokens, "
          f"{r['usage']['prompt_tokens_details']['cached_tokens']} reused)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="stratad-demo")
    p.add_argument("--model", default=str(SHIPPED_MODEL), help="default: the trained tiny model stratad ships")
    p.add_argument("--cards", default=None)
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args(argv)
    cards = a.cards or _cards()
    port = free_port()
    # mutual help: both chats compute each expert on whichever card holds it (the point of stratad)
    # and the prefix cache: a chat's next turn reads only its new tokens
    daemon = LocalDaemon(a.model, cards, http=f"127.0.0.1:{port}",
                         args=["--expert-cache", "0.5", "--mutual-help", "--prefix-cache", "--log-level", "warning"])
    random = random_weights(a.model)
    if random:
        print("note: this model has random weights (stratad make-model): its replies are not meant to read as "
              "language; the demo shows the serving (two chats, pooled expert caches, the next turn's reuse)")
    print(f"starting stratad on cards {cards} (runtime dir {daemon.runtime_dir}, HTTP gateway on 127.0.0.1:{port})")
    daemon.start()
    try:
        with daemon.client() as c:
            first = two_chats(c, a.max_tokens)
            next_turn(c, first[0], a.max_tokens)
            if not random:
                gateway = LocalGateway(port)
                gateway.wait_healthy()
                tool_call(gateway)
            print("\n$ stratactl status\n" + status_table(c.status()))
    finally:
        rc = daemon.stop()
        rt = daemon.runtime_dir
        print(f"\nstratad stopped (exit {rc}); runtime dir left: {sorted(os.listdir(rt)) if os.path.isdir(rt) else []}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

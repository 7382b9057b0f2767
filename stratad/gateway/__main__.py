"""python -m stratad.gateway --runtime-dir DIR --listen HOST:PORT --model GGUF [--api-key-file F] [--listen-fd N
--parent-pid P]"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from stratad.config import default_runtime_dir
from stratad.gateway.launch import is_loopback, listen_socket, parse_listen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stratad.gateway",
                                description="OpenAI- and Anthropic-compatible HTTP gateway to a running stratad")
    p.add_argument("--runtime-dir", default=default_runtime_dir(), help="the daemon's runtime dir (its client socket)")
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (a non-loopback host needs --api-key-file)")
    p.add_argument("--listen-fd", type=int, help="serve on this inherited socket, already bound at --listen (how "
                                                 "`stratad serve` starts the gateway: it binds the address itself)")
    p.add_argument("--parent-pid", type=int, help="exit (as on SIGTERM) when this process, the one that started the "
                                                  "gateway, dies: `stratad serve` passes its own pid, so that a "
                                                  "SIGKILLed daemon does not leave the gateway holding the address")
    p.add_argument("--model", required=True, help="the daemon's GGUF: its tokenizer and chat template (no weights)")
    p.add_argument("--context-length", type=int, default=8192, help="the lanes' context: the default max_tokens")
    p.add_argument("--api-key-file", help="file holding the API key clients must send")
    p.add_argument("--served-model-name", help="the name /v1/models gives (default: the GGUF's file name)")
    p.add_argument("--tool-format", choices=("json", "xml"), help="tool-call format (default: the template's)")
    p.add_argument("--max-body-bytes", type=int, default=None)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    a = p.parse_args(argv)
    if a.parent_pid is not None:  # first: a parent that dies while we load the tokenizer takes us with it too
        from stratad.proc import die_with

        die_with(a.parent_pid)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s gateway %(levelname)s %(message)s")
    try:
        host, _ = parse_listen(a.listen)
    except ValueError as e:
        p.error(f"--listen: {e}")
    if a.api_key_file is None and not is_loopback(host):
        p.error(f"--listen {a.listen} is reachable from other machines: give --api-key-file")

    import socket

    import uvicorn

    from stratad.gateway import app as app_mod
    from stratad.gateway.backend import Backend
    from stratad.gateway.guard import load_key

    try:
        key = load_key(a.api_key_file) if a.api_key_file else None
    except (OSError, ValueError) as e:
        p.error(f"--api-key-file: {e}")
    if a.listen_fd is not None:
        sock = socket.socket(fileno=a.listen_fd)
    else:
        try:  # bound here, so that a taken address is one clear line (uvicorn would log and exit 1)
            sock = listen_socket(a.listen)
        except OSError as e:
            p.error(f"--listen {a.listen}: cannot listen there ({e.strerror or e})")
    backend = Backend(a.runtime_dir, a.model, a.context_length, a.tool_format, a.served_model_name)
    kw = {} if a.max_body_bytes is None else {"max_body_bytes": a.max_body_bytes}
    app = app_mod.build(backend, key, **kw)
    app.state.intake.start()  # the worker for big bodies, now: the first one does not wait for its spawn
    logging.getLogger("stratad.gateway").info("listening on %s (model %s, tool calls as %s)", a.listen,
                                              backend.model_name, backend.tool_format)
    # uvicorn stops on SIGTERM / SIGINT, then raises the signal again for the handler it found there: a no-op, so
    # that the cleanup below runs (the default action ended the process first, and multiprocessing's resource
    # tracker reported the intake worker's queues as leaked semaphores at every stop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level=a.log_level, access_log=a.log_level == "debug"))
        server.run(sockets=[sock])
    finally:
        app.state.intake.close()
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

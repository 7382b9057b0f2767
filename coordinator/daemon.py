"""The coordinator process: owns the arena, the directory, the lanes and the request queue.

One thread runs a poll loop over the client socket(s) and the lane socket; lanes do the computing. Clients'
requests are validated and tokenised here (big ones in a worker process: coordinator/intake.py), queued (bounded
FIFO), handed to free lanes; lanes' token chunks are routed back to the client that asked, through per-client
bounded queues that never block the loop (coordinator/client_io.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
from concurrent.futures import CancelledError, Future
from concurrent.futures.process import BrokenProcessPool
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import zmq

from coordinator import card_slots, profile_store
from coordinator.client_io import ClientIO
from coordinator.intake import BEHIND_BYTES, BEHIND_COUNT, Intake
from stratad.prompts import HEAVY_BYTES, INPUT_ERRORS, max_prompt_bytes, prompt_tokens, size_refusal
from coordinator.gateway_child import GatewayChild
from coordinator.lanes import LaneHandle, Supervisor, lane_argv
from coordinator.pool import CardPool
from coordinator.runtime import RuntimeDir
from protos import messages as M
from protos.codec import FrameError, decode, encode, peek
from stratad import kv_store, sd_notify, shm, threads
from stratad.config import DaemonConfig, LaneConfig
from stratad.engine.prefix_cache import common_prefix
from stratad.model.config import effective_context_length
from stratad.model.gguf_file import ModelFile
from stratad.model.slot_layout import slot_bytes

log = logging.getLogger("stratad.coordinator")
POLL_MS = 50
TOKEN_PREFIX = b'{"v":%d,"type":"tokens",' % M.PROTOCOL_VERSION  # how a lane's TokenChunk frame begins
PREFIX_MIN = 64  # prefix_cache: a shorter common prefix does not make a lane the request's lane
BUSY_POLL_MS = 5  # while replies wait for a client's room or a prompt is being prepared


@dataclass
class Request:
    req_id: str
    sock: zmq.Socket
    client: bytes
    tokens: list[int]
    sampling: M.Sampling
    t_arrival: float = field(default_factory=time.monotonic)
    t_assigned: float = 0.0
    lane: LaneHandle | None = None
    cancel_sent: bool = False
    digest: bool = False
    streamed: bool = False  # a lane has sent the client something for it
    requeued: bool = False  # queued again once already, its lane having died before streaming anything


class Coordinator:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.rt = RuntimeDir(cfg.runtime_dir)
        self.t_start = time.time()
        self.stopping = False
        self.exit_code = 0
        self.stop_began = self.stop_deadline = 0.0
        self.ready_sent = False
        self.requests: dict[str, Request] = {}
        self.last_prompt: dict[int, list[int]] = {}  # lane -> the prompt it read last (prefix_cache affinity)
        self.queue: deque[str] = deque()
        self.ctx: zmq.Context | None = None
        self.io: ClientIO | None = None
        self.intake: Intake | None = None
        self.stop_signalled = False
        self.auth = None

    # ---- start ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        reclaimed = self.rt.acquire()
        if reclaimed:
            log.warning("reclaimed leftovers of an earlier daemon: %s", ", ".join(reclaimed))
        self.model = ModelFile(self.cfg.model)  # the arena: the GGUF mapped shared, read by every lane
        self.tokenizer = self.model.tokenizer
        cfg = self.cfg
        c = self.model.config = self.model.config.with_rope_overrides(cfg.rope_scaling, cfg.rope_scale,
                                                                      cfg.yarn_orig_ctx)
        self.context_length = effective_context_length(cfg.context_length, c,
                                                       explicit="context_length" in cfg.model_fields_set)
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, self.context_length)  # refused untokenised beyond
        self.intake = Intake(str(self.model.path), prompt_tokens, self.context_length, self.max_prompt_bytes)
        self.cards = list(self.cfg.cards) or detect_cards()
        self.slot_bytes = slot_bytes(self.model)
        self.slots, fit = card_slots.per_card(self.cfg.expert_cache, self.cards, c.n_layer * c.n_expert,
                                              self.slot_bytes, self.model.size)
        self.state_file = (profile_store.path_for(self.cfg.state_dir, self.model.header_hash)
                           if self.cfg.state_dir else None)
        self.profile = self._profile()
        self.last_profile_save = time.monotonic()
        self.kv_store = self._kv_store()
        self.pool = CardPool(self.slots, (c.n_layer, c.n_expert), self.profile, self.rt.shm_prefix,
                             self._send_lane, self.cfg.mutual_help, self.cfg.rejoin_idle_s,
                             self.cfg.replan_interval_s, self.cfg.replan_min_gain, fit)
        self.ctx = zmq.Context()
        self.lane_sock = self.ctx.socket(zmq.ROUTER)
        self.lane_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.lane_sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted lane takes over its identity
        self.lane_sock.bind(self.rt.lane_endpoint)
        self.io = ClientIO(self.ctx, self.cfg.client_queue_messages, self.cfg.client_queue_bytes,
                           self.cfg.client_queue_total_bytes, self._client_lost)
        self.io.socket(self.rt.client_endpoint)
        if self.cfg.tcp:
            self._tcp_socket()
        for p in self.rt.path.glob("*.sock"):
            p.chmod(0o600)
        # the gateway's address is bound before any lane starts: a taken one stops the daemon at once
        self.gateway = GatewayChild.for_config(self.cfg, str(self.rt.path), str(self.model.path),
                                               self.context_length) if self.cfg.http else None
        self.sup = Supervisor(self.cards, self._lane_argv, self.rt.shm_prefix, self.cfg.lane_timeout_s,
                              threads.per_lane(self.cfg.cpu_threads, len(self.cards)), self.cfg.lane_start_timeout_s)
        self.sup.start_all()
        self.intake.start()  # beside the lanes' start
        if self.gateway:
            self.gateway.start()
        log.info("model %s: %d layers x %d experts, slot %.2f MiB, expert slots per card %s (expert_cache %s%s), "
                 "%d cards %s", self.model.path, c.n_layer, c.n_expert, self.slot_bytes / 2**20,
                 ",".join(map(str, self.slots)), self.cfg.expert_cache,
                 ": GPU cards keep what fits" if any(fit) else "", len(self.cards), ",".join(self.cards))

    def _kv_store(self) -> kv_store.KvStore | None:
        """The host conversation cache's segment (with prefix_cache), sized by kv_cache_host."""
        if not self.cfg.prefix_cache:
            return None
        if any(card != "cpu" for card in self.cards) and not self.cfg.gpu.host_kv_cache:
            log.info("host conversation cache off for GPU cards ([gpu] host_kv_cache = false)")
            return None
        block = kv_store.block_bytes(self.model.config, self.cards)
        pools = sum(n * self.slot_bytes for n, card in zip(self.slots, self.cards) if card == "cpu")
        limit = kv_store.host_limit(self.cfg.kv_cache_host, self.model.size + pools, pools)
        asked = self.cfg.kv_cache_host.bytes
        if asked is not None and limit < asked:
            log.warning("kv_cache_host %s is more than shared memory (%s) has room for: %.1f MiB used",
                        self.cfg.kv_cache_host, shm.SHM_DIR, limit / 2**20)
        if limit < block:
            log.info("host conversation cache off (kv_cache_host %s: %d bytes, a block is %d)",
                     self.cfg.kv_cache_host, limit, block)
            return None
        st = kv_store.KvStore(kv_store.segment_name(self.rt.shm_prefix), create=True, limit_bytes=limit,
                              slot_bytes=block)
        log.info("host conversation cache: %.1f MiB, %d blocks of %d tokens", st.n_slots * block / 2**20,
                 st.n_slots, st.block_tokens)
        return st

    def _profile(self) -> np.ndarray:
        """The starting profile: the configured file, else the one saved by an earlier run, else none (lane 0's
        routing warm-up seeds the counts). Sets profile_source for status."""
        c = self.model.config
        shape = (c.n_layer, c.n_expert)
        if self.cfg.profile:
            try:
                p = profile_store.read(self.cfg.profile, shape)
            except ValueError as e:
                raise ValueError(f"profile {self.cfg.profile}: {e}") from None
            self.profile_source = f"file {self.cfg.profile}"
            return p
        if self.state_file is not None:
            p = profile_store.load(self.state_file, shape)
            if p is not None and p.any():
                self.profile_source = f"saved {self.state_file}"
                log.info("starting from the expert profile saved at %s", self.state_file)
                return p
        self.profile_source = "routing warm-up" if self.cfg.warmup_tokens else "none"
        return np.zeros(shape)

    def _save_profile(self) -> None:
        if self.state_file is None:
            return
        learned = self.pool.learned()
        if not learned.any():
            return
        try:
            profile_store.save(self.state_file, learned)
        except OSError as e:  # a full or read-only disk must not stop serving
            log.warning("could not save the expert profile to %s: %s", self.state_file, e)
        self.last_profile_save = time.monotonic()

    def _lane_argv(self, h: LaneHandle) -> list[str]:
        return lane_argv(LaneConfig.for_lane(self.cfg, lane=h.lane, card=h.card, endpoint=self.rt.lane_endpoint,
                                             model=str(self.model.path), model_hash=self.model.header_hash,
                                             shm_prefix=self.rt.shm_prefix, context_length=self.context_length,
                                             cpu_threads=threads.per_lane(self.cfg.cpu_threads, len(self.cards)),
                                             kv_store=self.kv_store.name if self.kv_store else ""))

    def _tcp_socket(self) -> zmq.Socket:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        key, allowed = self.cfg.curve_secret_key_file, self.cfg.curve_authorized_dir
        if not (key and allowed):
            raise ValueError("tcp needs curve_secret_key_file and curve_authorized_dir (CURVE keys)")
        if not os.path.isdir(allowed):
            raise ValueError(f"curve_authorized_dir {allowed} is not a directory")
        try:  # zmq names neither the setting nor, for a missing file, the reason
            public, secret = zmq.auth.load_certificate(key)
        except (OSError, ValueError) as e:
            raise ValueError(f"curve_secret_key_file {key}: {e}") from None
        if secret is None:
            raise ValueError(f"curve_secret_key_file {key} holds no secret key")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=allowed)
        return self.io.socket(self.cfg.tcp, curve=(secret, public))

    # ---- loop -----------------------------------------------------------------------------------------------
    def signal_stop(self, *_a) -> None:
        """SIGTERM / SIGINT: only a flag, so that no reply is sent from inside a send (the loop stops)."""
        self.stop_signalled = True

    def request_stop(self) -> None:
        if not self.stopping:
            log.info("stopping: in-flight requests get %.1f s to finish", self.cfg.stop_grace_s)
            self.stopping = True
            self.stop_began = time.monotonic()
            self.stop_deadline = self.stop_began + self.cfg.stop_grace_s
            sd_notify.notify("STOPPING=1")
            for rid in list(self.queue):
                self._fail(self.requests[rid], M.ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
            # the intake's messages are answered in their turn by the loop as before (a request refused
            # shutting_down with its req_id, a status request answered); those still waiting when the stop ends:
            # _answer_intake

    def _answer_intake(self) -> None:
        """At the stop's end, every message still in the intake answered, in each client's order: those whose turn
        has come as the loop would (a request refused shutting_down, with its req_id: decoded here or by the
        worker; a status request answered; a cancel as any); a big frame still in the worker is refused
        shutting_down with the req_id its head shows (codec.req_id_of: it is not decoded yet)."""
        for (sock, client), msg, prepared in self.intake.ready(everything=True):
            if prepared is not None and not prepared.done():
                self._reply(sock, client, M.Error(req_id=getattr(prepared, "req_id", None),
                                                  code=M.ErrorCode.SHUTTING_DOWN, message="the daemon is stopping"))
            else:
                self._guarded(sock, client, self._prepared, sock, client, msg, prepared)

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.lane_sock, zmq.POLLIN)
        for s in self.io.socks:
            poller.register(s, zmq.POLLIN)
        wd = sd_notify.watchdog_interval_s()
        last_wd = 0.0
        while True:
            busy = self.io.pending() or self.intake.pending()
            for sock, _ in poller.poll(BUSY_POLL_MS if busy else POLL_MS):
                for _ in range(256):  # drain, bounded so one busy socket cannot starve the others
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is self.lane_sock:
                        self._on_lane(parts)
                    else:
                        self._on_client(sock, parts)
            if self.stop_signalled:
                self.request_stop()
            for (sock, client), msg, prepared in self.intake.ready():
                self._guarded(sock, client, self._prepared, sock, client, msg, prepared)
            self.io.flush()
            self._tick()
            if wd and time.monotonic() - last_wd >= wd:
                sd_notify.notify("WATCHDOG=1")
                last_wd = time.monotonic()
            if self.stopping and self._stop_step():
                return self.exit_code

    def _tick(self) -> None:
        for h, why in self.sup.reap():
            if self.stopping:  # stopped with the daemon (Ctrl-C reaches the lanes too): neither restarted nor a fault
                log.info("%s while the daemon stops", why)
                if h.req_id in self.requests:
                    self._fail(self.requests[h.req_id], M.ErrorCode.SHUTTING_DOWN, "the daemon is stopping")
                h.req_id = None
                continue
            log.error(h.failed or f"{why}; restarting it")
            r = self.requests.get(h.req_id or "")
            if r is not None and not (r.streamed or r.requeued):
                # nothing reached the client yet: an accepted request is not lost to a lane's death, it runs again
                # (from the start, so with the same tokens) on the next free lane
                log.warning("%s before request %s's first token: queued again", why, r.req_id)
                r.lane, r.requeued = None, True
                self.queue.appendleft(r.req_id)
            elif r is not None:
                self._fail(r, M.ErrorCode.LANE_FAILED, f"{why} while serving this request; the lane is being "
                                                       "restarted")
            h.req_id = None
            self.last_prompt.pop(h.lane, None)  # a new process holds no sequence
            self.pool.lane_dead(h.lane)
        if not self.stopping:
            self.sup.restart_due()
            if self.gateway:
                self.gateway.poll()
            self.pool.tick(time.monotonic())
            self._dispatch()
            if time.monotonic() - self.last_profile_save >= self.cfg.profile_save_s:
                self._save_profile()
        if all(h.failed for h in self.sup.lanes):
            log.error("no lane could be started; stopping")
            self.exit_code = 3
            self.request_stop()
        if not self.ready_sent and all(h.ready or h.failed for h in self.sup.lanes):
            self.ready_sent = True
            sd_notify.notify(f"READY=1\nSTATUS=serving on {len(self.cards)} cards")
            log.info("ready: %d lanes up, clients at %s", len(self.cards), self.rt.client_endpoint)

    def _stop_step(self) -> bool:
        """One step of a graceful stop; True when everything is released."""
        busy = [r for r in self.requests.values() if r.lane is not None]
        if busy and time.monotonic() < self.stop_deadline:
            return False
        for r in busy:
            self._fail(r, M.ErrorCode.SHUTTING_DOWN, "the daemon stopped before this request finished")
        self._answer_intake()
        self._save_profile()  # while the lanes' counts are still attached
        for h in self.sup.lanes:
            self._to_lane(h, M.Shutdown(reason="daemon stopping"))
        self.sup.stop_all()
        log.info("lanes stopped, %.2f s into the stop", time.monotonic() - self.stop_began)  # a slow stop's clue
        return True

    def close(self) -> None:
        """Releases everything, in this order (the host conversation cache's segment once the lanes are gone); a
        step over a second is logged by name: a slow stop's clue (one stalled for 10 s once, after its lanes had
        stopped, on a loaded CI box)."""
        for what, thing, release in (
                ("the HTTP gateway", getattr(self, "gateway", None), lambda g: g.stop()),
                ("the card pool", getattr(self, "pool", None), lambda p: p.close()),
                ("the lanes", getattr(self, "sup", None), lambda s: s.stop_all()),
                ("the host conversation cache", getattr(self, "kv_store", None), lambda k: k.close()),
                ("the intake worker", self.intake, lambda i: i.close()),
                ("the client sockets", self.io, lambda io: io.close()),
                ("the authenticator", self.auth, lambda a: a.stop()),
                ("the ZeroMQ context", self.ctx, lambda c: c.destroy(linger=0)),
                ("the runtime directory", self.rt, lambda rt: rt.release())):
            if thing is None:
                continue
            t0 = time.monotonic()
            release(thing)
            took = time.monotonic() - t0
            if took > 1.0:
                log.warning("releasing %s took %.1f s", what, took)

    # ---- clients --------------------------------------------------------------------------------------------
    def _reply(self, sock: zmq.Socket, client: bytes, msg) -> bool:
        return self.io.send(sock, client, msg)

    def _client_lost(self, sock: zmq.Socket, client: bytes, why: str) -> None:
        """A client gone or cut off (ClientIO): what it asked for is cancelled, its lanes freed."""
        self.intake.drop((sock, client))
        for r in [r for r in self.requests.values() if r.sock is sock and r.client == client]:
            self._cancel_request(r)

    def _guarded(self, sock: zmq.Socket, client: bytes, handler, *args) -> None:
        """One client message's handling: whatever it raises is logged, answered with an error, and the loop goes
        on serving everyone else."""
        try:
            handler(*args)
        except Exception as e:  # noqa: BLE001 - a bug met by one message must not end the daemon
            log.exception("client %s: error handling its message", client.hex())
            self._reply(sock, client, M.Error(code=M.ErrorCode.INTERNAL,
                                              message=f"the daemon failed handling this message ({type(e).__name__}; "
                                                      f"see its log)"))

    def _on_client(self, sock: zmq.Socket, parts: list[bytes]) -> None:
        if not self.io.is_lost(sock, parts[0]):  # a client cut off is not listened to either
            self._guarded(sock, parts[0], self._on_client_frame, sock, parts)

    def _on_client_frame(self, sock: zmq.Socket, parts: list[bytes]) -> None:
        client = parts[0]
        if len(parts) != 2:
            log.warning("client %s: %d-part message refused", client.hex(), len(parts) - 1)
            self._reply(sock, client, M.Error(code=M.ErrorCode.BAD_FRAME,
                                              message=f"expected one frame per message, got {len(parts) - 1}"))
            return
        if HEAVY_BYTES < len(parts[1]) <= M.MAX_FRAME_BYTES:  # decoded, refused or tokenised off the loop
            self.intake.add((sock, client), frame=parts[1])
            return
        try:
            msg = decode(parts[1], M.ClientToCoordinator)
        except FrameError as e:
            return self._bad_frame(sock, client, e.code, str(e))
        if self.intake.busy((sock, client)):  # behind this client's earlier messages
            if not self.intake.add((sock, client), msg, size=len(parts[1])):
                self._reply(sock, client, M.Error(req_id=getattr(msg, "req_id", None), code=M.ErrorCode.QUEUE_FULL,
                                                  message=f"over {BEHIND_COUNT} messages or {BEHIND_BYTES} bytes wait "
                                                          "behind this client's large requests; send it again later"))
        else:
            self._handle(sock, client, msg)

    def _bad_frame(self, sock, client, code: M.ErrorCode, message: str) -> None:
        log.warning("client %s: %s", client.hex(), message)
        self._reply(sock, client, M.Error(code=code, message=message))

    def _prepared(self, sock, client, msg, prepared: Future | None) -> None:
        """A message whose turn came in the intake; prepared: the worker's work on a big frame (its message)."""
        if prepared is not None:
            try:
                msg = prepared.result()
            except (BrokenProcessPool, CancelledError):
                return self._reply(sock, client, M.Error(code=M.ErrorCode.INTERNAL, message="the worker preparing "
                                                         "this request died; send it again"))
            except Exception as e:  # noqa: BLE001 - a fault of ours, not the client's: said so, and logged
                req_id = getattr(e, "req_id", None)
                log.error("request %s: preparing it failed in the intake worker", req_id, exc_info=e)
                return self._reply(sock, client, M.Error(req_id=req_id, code=M.ErrorCode.INTERNAL, message=(
                    f"the daemon failed preparing this prompt ({getattr(e, 'cause', type(e).__name__)}; see its log)")))
            if isinstance(msg, M.Error):
                if msg.req_id is None:  # a bad frame
                    return self._bad_frame(sock, client, msg.code, msg.message)
                if msg.code == M.ErrorCode.QUEUE_FULL:  # the intake's own refusal: the operator sees the load
                    log.warning("client %s, request %s: %s", client.hex(), msg.req_id, msg.message)
                return self._reply(sock, client, msg)
        self._handle(sock, client, msg)

    def _handle(self, sock, client, msg) -> None:
        if isinstance(msg, M.StatusRequest):
            self._reply(sock, client, self.status())
        elif isinstance(msg, M.Cancel):
            self._cancel(sock, client, msg.req_id)
        elif isinstance(msg, M.Generate):
            self._generate(sock, client, msg)

    def _refusal(self, g: M.Generate) -> tuple[M.ErrorCode, str] | None:
        """Why g cannot be served, from what is known before its prompt is tokenised; None if it may be."""
        if self.stopping:
            return M.ErrorCode.SHUTTING_DOWN, "the daemon is stopping"
        if g.req_id in self.requests:
            return M.ErrorCode.DUPLICATE_REQUEST, f"request {g.req_id} is already in flight"
        return size_refusal(g, self.context_length, self.max_prompt_bytes)

    def _generate(self, sock, client, g: M.Generate) -> None:
        """g from a small frame (tokenised here), or from the intake worker (its prompt already token ids)."""
        def refuse(code, message):
            self._reply(sock, client, M.Error(req_id=g.req_id, code=code, message=message))

        if (why := self._refusal(g)) is not None:
            return refuse(*why)
        try:
            tokens = prompt_tokens(self.tokenizer, g)
        except INPUT_ERRORS as e:  # the client's input
            return refuse(M.ErrorCode.BAD_REQUEST, str(e))
        except Exception as e:  # noqa: BLE001 - a fault of ours, not the client's: said so, and logged
            log.error("request %s: preparing its prompt failed", g.req_id, exc_info=e)
            return refuse(M.ErrorCode.INTERNAL, f"the daemon failed preparing this prompt ({type(e).__name__}; see "
                                                f"its log)")
        if not tokens:
            return refuse(M.ErrorCode.BAD_REQUEST, "the prompt is empty")
        if len(tokens) + g.sampling.max_tokens > self.context_length:
            return refuse(M.ErrorCode.PROMPT_TOO_LONG,
                          f"prompt of {len(tokens)} tokens + max_tokens {g.sampling.max_tokens} exceeds the "
                          f"context length {self.context_length}")
        if len(self.queue) >= self.cfg.queue_limit:
            return refuse(M.ErrorCode.QUEUE_FULL, f"the queue is full ({self.cfg.queue_limit} requests waiting)")
        r = Request(g.req_id, sock, client, tokens, g.sampling, digest=g.digest)
        self.requests[r.req_id] = r
        self.queue.append(r.req_id)
        self._dispatch()  # the lane's first tokens come through this loop, so Accepted still arrives first
        position = 0 if r.lane is not None else self.queue.index(r.req_id) + 1
        self._reply(sock, client, M.Accepted(req_id=r.req_id, prompt_tokens=len(tokens), queue_position=position))

    def _cancel(self, sock, client, req_id: str) -> None:
        r = self.requests.get(req_id)
        if r is None or r.client != client:
            self._reply(sock, client, M.Error(req_id=req_id, code=M.ErrorCode.UNKNOWN_REQUEST,
                                              message=f"no request {req_id} of this client in flight"))
            return
        self._cancel_request(r)

    def _cancel_request(self, r: Request) -> None:
        if r.lane is None:
            self.queue.remove(r.req_id)
            del self.requests[r.req_id]
            self._reply(r.sock, r.client, M.Done(req_id=r.req_id, finish_reason="cancelled",
                                                 stats=M.RequestStats(prompt_tokens=len(r.tokens))))
        elif not r.cancel_sent:
            r.cancel_sent = True
            self._to_lane(r.lane, M.Cancel(req_id=r.req_id))

    def _fail(self, r: Request, code: M.ErrorCode, message: str) -> None:
        if r.lane is not None:
            if r.lane.req_id == r.req_id:
                self._to_lane(r.lane, M.Cancel(req_id=r.req_id))
                r.lane.req_id = None  # its Done/Error for this request, if any, is dropped
                if r.lane.proc is not None:
                    self.pool.request_finished(r.lane.lane)
        elif r.req_id in self.queue:
            self.queue.remove(r.req_id)
        self.requests.pop(r.req_id, None)
        self._reply(r.sock, r.client, M.Error(req_id=r.req_id, code=code, message=message))

    def _pick_lane(self, r: Request) -> int | None:
        """The lane for r: with prefix_cache, the free lane whose last prompt shares the longest prefix with r's
        (at least PREFIX_MIN tokens: a turn of a conversation goes back to the lane that holds it); else by role,
        a lane keeping no conversation first (any lane restores r's prefix from the host cache, kv_store)."""
        free = [h.lane for h in self.sup.lanes if h.free]
        if self.cfg.prefix_cache:
            shared = {i: common_prefix(self.last_prompt.get(i, []), r.tokens) for i in free}
            best = max(free, key=lambda i: shared[i], default=None)
            if best is not None and shared[best] >= PREFIX_MIN and self.pool.pick_lane([best]) == best:
                return best
            free.sort(key=lambda i: i in self.last_prompt)  # of equal roles, a lane holding no conversation
        return self.pool.pick_lane(free)

    def _dispatch(self) -> None:
        while self.queue:
            r = self.requests[self.queue[0]]
            i = self._pick_lane(r)
            if i is None:
                return
            lane = self.sup.lanes[i]
            self.queue.popleft()
            if self.cfg.prefix_cache:
                self.last_prompt[i] = r.tokens
            r.lane, r.t_assigned, lane.req_id = lane, time.monotonic(), r.req_id
            self.pool.request_started(i)  # its role and View reach the lane before the request does
            if not self._to_lane(lane, M.Assign(req_id=r.req_id, tokens=tuple(r.tokens), sampling=r.sampling,
                                                digest=r.digest)):
                lane.req_id, r.lane = None, None
                self.pool.request_finished(i)
                self.queue.appendleft(r.req_id)
                return  # the lane's death is noticed by reap()

    # ---- lanes ----------------------------------------------------------------------------------------------
    def _send_lane(self, lane: int, msg) -> bool:
        return self._to_lane(self.sup.lanes[lane], msg)

    def _to_lane(self, h: LaneHandle, msg) -> bool:
        try:
            self.lane_sock.send_multipart([h.identity, encode(msg)])
            return True
        except zmq.ZMQError:
            return False

    def _on_lane(self, parts: list[bytes]) -> None:
        h = self.sup.by_identity(parts[0])
        if h is None or len(parts) != 2 or h.proc is None:
            log.warning("message from unknown or dead lane %r dropped", parts[0])
            return
        h.last_seen = time.monotonic()
        if parts[1].startswith(TOKEN_PREFIX):  # the hot path: relay the lane's chunk to its client as it is
            return self._relay_tokens(h, parts[1])
        try:
            msg = decode(parts[1], M.LaneToCoordinator)
        except FrameError as e:
            log.error("lane %d sent a bad frame: %s", h.lane, e)
            return
        if isinstance(msg, M.LaneHello):
            if msg.model_hash != self.model.header_hash:
                log.error("lane %d attached a different model (hash %s)", h.lane, msg.model_hash[:12])
                return
            warm = self.cfg.warmup_tokens if h.lane == 0 and h.restarts == 0 and not self.profile.any() else 0
            self._to_lane(h, self.pool.placement(h.lane, warm))
        elif isinstance(msg, M.Heartbeat):
            h.status = msg.status
            if not h.ready and msg.status.role != M.Role.STARTING:
                h.ready = True
                log.info("lane %d ready (%d/%d slots)", h.lane, msg.status.slots_used, msg.status.slots_total)
                self.pool.lane_ready(h.lane, restarted=h.restarts > 0, status=msg.status)
        elif isinstance(msg, M.LaneFailed):
            h.fail_reason = msg.reason  # the lane exits next: reap names it
        elif isinstance(msg, M.EpochAck):
            self.pool.on_ack(h.lane, msg.epoch)
        elif isinstance(msg, M.Loaded):
            self.pool.on_loaded(h.lane, msg.epoch)
        elif isinstance(msg, (M.Done, M.Error)):
            r = self.requests.get(msg.req_id or "")
            if r is None or r.lane is not h:
                return  # a request already failed or cancelled here
            if isinstance(msg, M.Done):
                msg = msg.model_copy(update={"stats": msg.stats.model_copy(
                    update={"queue_s": r.t_assigned - r.t_arrival})})
            self._reply(r.sock, r.client, msg)
            del self.requests[r.req_id]
            h.req_id = None
            self.pool.request_finished(h.lane)
            self._dispatch()

    def _relay_tokens(self, h: LaneHandle, frame: bytes) -> None:
        r = self.requests.get(peek(frame).get("req_id", ""))
        if r is None or r.lane is not h:
            return  # a request already failed or cancelled here
        r.streamed = True
        self.io.send_frame(r.sock, r.client, frame)  # a client gone or too slow is cancelled by _client_lost

    # ---- status ---------------------------------------------------------------------------------------------
    def status(self) -> M.Status:
        lanes = []
        for h in self.sup.lanes:
            base = h.status or M.LaneStatus(lane=h.lane, card=h.card, role=h.role, failed=h.failed)
            role = self.pool.roles.role(h.lane) if h.ready else (M.Role.DOWN if h.proc is None else M.Role.STARTING)
            lanes.append(base.model_copy(update={"role": role, "pid": h.pid, "req_id": h.req_id,
                                                 "restarts": h.restarts,
                                                 "role_since": self.pool.role_since[h.lane]}))
        cards = []
        for i, card in enumerate(self.cards):
            st = self.sup.lanes[i].status
            used = (st.slots_used if st else 0) * self.slot_bytes
            cards.append(M.CardStatus(card=f"{card}{i}" if card == "cpu" else card,
                                      kind="cpu" if card == "cpu" else "gpu", memory_used=used,
                                      memory_total=self.pool.slots[i] * self.slot_bytes,
                                      used_by=self.pool.users(i)))
        return M.Status(model=str(self.model.path), uptime_s=time.time() - self.t_start, lanes=tuple(lanes),
                        cards=tuple(cards), queue=tuple(self.queue), queue_limit=self.cfg.queue_limit,
                        epoch=self.pool.epochs.epoch, role_log=tuple(self.pool.role_log),
                        profile=self.profile_source, kv_cache=self._kv_status(),
                        model_types=self.model.types_summary)

    def _kv_status(self) -> M.KvCacheStatus | None:
        if self.kv_store is None:
            return None
        return M.KvCacheStatus(**dataclasses.asdict(self.kv_store.stats()))


def detect_cards() -> list[str]:
    """Every CUDA device when CuPy sees any; else two CPU cards (and the log says so)."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no cupy, no driver, no device: all mean "no GPU"
        log.warning("no --cards given and no GPU found (%s): running on 2 CPU cards", type(e).__name__)
        return ["cpu", "cpu"]
    if n == 0:
        log.warning("no --cards given and no GPU found: running on 2 CPU cards")
        return ["cpu", "cpu"]
    log.info("no --cards given: using GPUs %s", ",".join(map(str, range(n))))
    return [str(i) for i in range(n)]


def serve(cfg: DaemonConfig) -> int:
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s coordinator %(levelname)s %(message)s")
    co = Coordinator(cfg)
    signal.signal(signal.SIGTERM, co.signal_stop)
    signal.signal(signal.SIGINT, co.signal_stop)
    try:
        co.start()
        return co.run()
    finally:
        co.close()
        if co.stopping:
            log.info("stopped: everything released, %.2f s into the stop", time.monotonic() - co.stop_began)

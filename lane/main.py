"""A lane process: one card, one sequence at a time, driven by the coordinator over ZeroMQ.

Started by the coordinator (`python -m lane.main ...`). It attaches the arena (the model file's shared mapping),
fills its card's slot pool from its placement, then serves `Assign`s: tokens stream back as they are made,
between tokens it reads cancels and role changes and sends heartbeats.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import sys
import tempfile
import time
from collections import deque

import numpy as np
import zmq

from lane.block_writer import BlockWriter
from lane.counters import Counters
from lane.numpy_card import NumpyCard
from lane.slot_loader import SlotLoader
from lane.slot_pool import SlotPool
from lane.stop import StopSignal
from protos import messages as M
from protos.codec import FrameError, decode, encode
from stratad import kv_store, shm
from stratad.config import LaneConfig
from stratad.engine.generation import CHUNK_READ, BadRequest, Generation
from stratad.engine.prefix_cache import PrefixCache
from stratad.engine.sampling import SamplingParams
from stratad.model.gguf_file import ModelFile
from stratad.model.generated_vocab import warmup_text
from stratad.model.slot_layout import slot_bytes
from stratad.proc import die_with

log = logging.getLogger("stratad.lane")

# a send waiting this long (the coordinator's pipe full: it is gone or stuck) looks at the stop flag: a stopping
# lane does not wait for a reader that will not come
SEND_WAIT_MS = 1000


class Cancelled(Exception):
    pass


class Lane:
    def __init__(self, cfg: LaneConfig, stop: StopSignal | None = None):
        self.cfg = cfg
        self.stop = stop
        self.lane, self.card_name = cfg.lane, cfg.card
        self.role = M.Role.STARTING
        self.role_since = time.time()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"lane-{cfg.lane}".encode())
        self.sock.setsockopt(zmq.LINGER, 500)
        self.sock.setsockopt(zmq.SNDTIMEO, SEND_WAIT_MS)
        self.sock.connect(cfg.endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if stop is not None:
            self.poller.register(stop.fd, zmq.POLLIN)  # SIGTERM wakes a waiting lane
        self.model = ModelFile(cfg.model)
        self.model.config = self.model.config.with_rope_overrides(cfg.rope_scaling, cfg.rope_scale, cfg.yarn_orig_ctx)
        self.segments: list[shm.Segment] = []
        self.card = None
        self.loader: SlotLoader | None = None
        self.req_id: str | None = None
        self.gen: Generation | None = None  # the request in progress
        # the host conversation cache shared by every lane (its segment is the coordinator's)
        self.store = kv_store.KvStore(cfg.kv_store, lane=cfg.lane) if cfg.prefix_cache and cfg.kv_store else None
        # writes each sequence's new blocks to the store in the background
        self.writer = BlockWriter(self.store, cfg.lane) if self.store is not None else None
        # the last sequence, for the next prompt (which restores its blocks from the store once they have landed)
        self.prefix = PrefixCache(self.store, self.writer and self.writer.wait_for) if cfg.prefix_cache else None
        self.tok_s = 0.0
        self.last_beat = 0.0
        self.shutdown = False  # the coordinator's Shutdown
        self.deferred: deque = deque()  # control messages read during a prompt, handled at the next token

    @property
    def stopping(self) -> bool:
        return self.shutdown or (self.stop is not None and self.stop.set)

    # ---- messages -------------------------------------------------------------------------------------------
    def send(self, msg) -> None:
        frame = encode(msg)
        while True:
            try:
                self.sock.send(frame)
                return
            except zmq.Again:
                if self.stopping:
                    return

    def recv(self, timeout_ms: int):
        """The next control message: one put aside during a prompt first, then the socket's."""
        if self.deferred:
            return self.deferred.popleft()
        return self._read(timeout_ms)

    def _read(self, timeout_ms: int):
        ready = dict(self.poller.poll(timeout_ms))
        if self.stop is not None and self.stop.fd in ready:
            self.stop.drain()
        if self.sock not in ready:
            return None
        frame = self.sock.recv()
        try:
            return decode(frame, M.CoordinatorToLane)
        except FrameError as e:
            log.error("lane %d: bad frame from the coordinator: %s", self.lane, e)
            return None

    def status(self) -> M.LaneStatus:
        counters = self.card.counters if self.card else Counters()
        c = counters.shares() if counters.total else (0.0, 0.0, 0.0)
        total = counters.total or 1
        g = self.gen
        if g is not None and g.t_first and g.generated > 1:
            self.tok_s = (g.generated - 1) / max(1e-9, time.monotonic() - g.t_first)
        pool = self.card.pool if self.card else None
        return M.LaneStatus(lane=self.lane, card=self.card_name, role=self.role, pid=os.getpid(), req_id=self.req_id,
                            tok_s=self.tok_s, generated=g.generated if g else 0, share_card=c[0], share_peer=c[1],
                            share_cpu=c[2], slots_used=pool.used if pool else 0,
                            share_by_peer=tuple((k, n / total) for k, n in sorted(counters.by_peer.items())),
                            share_host_read=counters.host_read / total,
                            slots_total=pool.n_slots if pool else 0, slots_loaded=pool.loads if pool else 0,
                            epoch=self.card.epoch if self.card else 0, role_since=self.role_since,
                            kept_tokens=len(self.prefix.tokens) if self.prefix else 0,
                            pool=self.card.pool_ident if self.card else "",
                            device=self.card.device_ident if self.card else "")

    def beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_beat >= self.cfg.heartbeat_s:
            self.send(M.Heartbeat(status=self.status()))
            self.last_beat = now

    # ---- card -----------------------------------------------------------------------------------------------
    def build_card(self, placement: M.Placement) -> None:
        c = self.model.config
        counts_name = f"{self.cfg.shm_prefix}lane{self.lane}-counts"
        shm.unlink(counts_name)  # a previous incarnation of this lane that was killed
        counts = shm.Segment(counts_name, c.n_layer * c.n_expert * 8, create=True)
        self.segments.append(counts)
        live = counts.array(np.float64, shape=(c.n_layer, c.n_expert))
        n = placement.n_slots
        if self.cfg.card == "cpu":
            name = f"{self.cfg.shm_prefix}lane{self.lane}-slots"
            shm.unlink(name)
            seg = shm.Segment(name, max(1, n) * slot_bytes(self.model), create=True, reserve=True)  # filled now
            self.segments.append(seg)
            self.card = NumpyCard(self.model, SlotPool(self.model, seg.array(), n), live, pool_ident=name)
        else:
            from lane.cupy_card import CupyCard  # CUDA only where a GPU card is asked for

            with fitting_alone(self.cfg.card, placement.fit, self.cfg.shm_prefix, self.beat) as before:
                self.card = CupyCard(self.model, int(self.cfg.card), n, self.cfg.context_length, live,
                                     self.cfg.cpu_threads, host_experts=self.cfg.host_experts,
                                     host_cpu_share=self.cfg.host_cpu_share,
                                     prompt_chunk=self.cfg.prompt_chunk, options=self.cfg.gpu, fit=placement.fit,
                                     cards=placement.cards, before=min(before, placement.gpu_lanes - 1),
                                     after=max(0, placement.gpu_lanes - 1 - before))
            if self.store is not None:  # restores then copy straight from the cache's pages
                t0 = time.monotonic()
                pinned = self.card.pin_store(self.store)
                log.info("lane %d: host conversation cache (%.1f GiB) %s in %.1f s", self.lane,
                         self.store.data.nbytes / 2**30, "page-locked" if pinned else "not page-locked (restores "
                         "go through staging)", time.monotonic() - t0)
        self.card.pool.fill(list(placement.experts))
        self.loader = SlotLoader(self.card.pool)
        if placement.warmup_tokens:
            self.warm_up(placement.warmup_tokens)

    def warm_up(self, n: int) -> None:
        """Route the built-in text through the card once: its live expert counts seed the first placement."""
        tokens = self.model.tokenizer.encode(warmup_text())[:min(n, self.cfg.context_length)]
        t0 = time.monotonic()
        self.card.forward(tokens, self.card.new_kv(), logits="none")
        self.card.counters = Counters()  # the warm-up is no request's work
        log.info("lane %d: routing warm-up of %d tokens in %.2f s", self.lane, len(tokens), time.monotonic() - t0)

    # ---- serving --------------------------------------------------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, M.Shutdown):
            self.shutdown = True
        elif isinstance(msg, M.RoleChange):
            self.role, self.role_since = msg.role, time.time()
            self.beat(force=True)
        elif isinstance(msg, M.View):
            self.card.set_view(msg)
            self.send(M.EpochAck(epoch=msg.epoch))
        elif isinstance(msg, M.Load):  # copies run in the background; Loaded once they have landed
            self.loader.begin(msg.epoch, msg.slots)
        elif isinstance(msg, M.Cancel):
            if msg.req_id == self.req_id:
                raise Cancelled()
        elif isinstance(msg, M.Assign):
            if self.req_id is not None:  # the coordinator never does this; refuse rather than lose the first
                self.send(M.Error(req_id=msg.req_id, code=M.ErrorCode.INTERNAL, message="lane is busy"))
            else:
                self.serve(msg)

    def report_loads(self) -> None:
        for epoch in self.loader.landed():
            self.send(M.Loaded(epoch=epoch))

    def between_chunks(self) -> None:
        """Between a long prompt's chunks (Generation's CHUNK_READ): heartbeats, slot loads that have landed, and a
        cancel of this request or a shutdown; other control waits for the next token (a View must not change the
        peers under a prompt)."""
        if self.loader is not None:
            self.report_loads()
        while (msg := self._read(0)) is not None:
            if isinstance(msg, M.Cancel) and msg.req_id == self.req_id:
                raise Cancelled()
            if isinstance(msg, M.Shutdown):
                self.shutdown = True
                continue
            self.deferred.append(msg)
        if self.stopping and self.req_id is not None:
            raise Cancelled()
        self.beat()

    def poll_between_tokens(self) -> None:
        while (msg := self.recv(0)) is not None:
            self.handle(msg)
            if self.stopping:
                raise Cancelled()
        if self.stopping:  # SIGTERM, seen here rather than raised wherever the lane was
            raise Cancelled()
        self.report_loads()
        self.beat()

    def serve(self, a: M.Assign) -> None:
        self.req_id, self.tok_s = a.req_id, 0.0
        s = a.sampling
        params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                seed=s.seed, stop=tuple(s.stop), ignore_eos=s.ignore_eos)
        before = self.card.counters.copy()
        finish = None
        gen = steps = None
        io_s = 0.0
        prompt_done = None  # counters once the prompt is read
        try:
            gen = self.gen = Generation(self.card, self.model.tokenizer, list(a.tokens), params,
                                        self.cfg.context_length, digest=a.digest, cache=self.prefix)
            steps = iter(gen)
            for tok, text in steps:
                if (tok, text) == CHUNK_READ:
                    self.between_chunks()
                    continue
                if prompt_done is None:
                    prompt_done = self.card.counters.copy()
                t0 = time.perf_counter()
                self.send(M.TokenChunk(req_id=a.req_id, tokens=() if tok is None else (tok,), text=text))
                self.poll_between_tokens()
                io_s += time.perf_counter() - t0
            finish = gen.finish_reason
        except Cancelled:
            finish = "cancelled"
        except Exception as e:  # noqa: BLE001 - the request fails with its cause; the lane goes on serving
            if not isinstance(e, BadRequest):
                log.exception("lane %d: request %s failed", self.lane, a.req_id)
            self.send(error_reply(self.lane, a.req_id, e))
        finally:
            if steps is not None:
                steps.close()  # a cancel ends the steps here: the sequence's KV is kept for the next prompt
            used = self.card.counters.minus(before)
            decode = self.card.counters.minus(prompt_done or self.card.counters)
            self.req_id, self.gen = None, None
            done = None
            if finish is not None and gen is not None:
                gen.t_end = gen.t_end or time.monotonic()
                self.tok_s = gen.decode_tok_s
                done = M.Done(req_id=a.req_id, finish_reason=finish, stats=M.RequestStats(
                    prompt_tokens=len(a.tokens), prompt_cached_tokens=gen.cached, generated_tokens=gen.generated,
                    ttft_s=gen.ttft_s, decode_tok_s=gen.decode_tok_s, lane=self.lane, experts_card=used.card, experts_peer=used.peer,
                    experts_cpu=used.cpu, decode_experts_card=decode.card, decode_experts_peer=decode.peer,
                    decode_experts_cpu=decode.cpu, experts_staged=used.staged, experts_host_read=used.host_read,
                    expert_bytes=self.card.pool.slot_bytes, logits_sha256=gen.digest.hexdigest() if gen.digest else None,
                    lane_io_s=io_s))
            self.beat(force=True)  # before Done: a status read right after the Done sees this request's figures
            if done is not None:
                self.send(done)
            if not self.stopping:  # the store goes with the daemon: no write to wait for at a stop
                self.save_blocks()

    def save_blocks(self) -> None:
        """After Done (the lane is free at once): the kept sequence's new whole blocks to the host cache. The
        export is a copy made here (the next request may change the KV); the writer's thread writes the store."""
        if self.writer is None or self.prefix.kv is None:
            return
        t0 = time.monotonic()
        with self.writer.room() as submit:
            t_room = time.monotonic()
            try:
                w = self.prefix.unsaved(self.card, self.writer.writing())
            except Exception:  # noqa: BLE001 - the cache is an optimisation: serving goes on without it
                log.exception("lane %d: exporting KV blocks for the host cache failed", self.lane)
                return
            if w is not None:
                submit(w)
        held = time.monotonic() - t0
        if held > 0.1:  # the lane takes no request meanwhile (docs/perf-notes.md, session 25's agents run)
            log.info("lane %d: the host cache export held the lane %.2f s (%.2f s waiting for room, %d blocks)",
                     self.lane, held, t_room - t0, len(w.hashes) if w is not None else 0)

    def run(self) -> int:
        self.send(M.LaneHello(lane=self.lane, pid=os.getpid(), card=self.card_name, model_hash=self.model.header_hash))
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while self.card is None:
            if self.stopping:
                return 0
            msg = self.recv(200)
            if isinstance(msg, M.Placement):
                try:
                    self.build_card(msg)
                except Exception as e:  # noqa: BLE001 - any of them leaves this lane without a card: say why
                    why = card_failure(self.cfg, msg, self.model, e)
                    log.error("lane %d: %s", self.lane, why)
                    self.send(M.LaneFailed(reason=why))
                    return 5
            elif isinstance(msg, M.Shutdown):
                return 0
            elif time.monotonic() > deadline:
                log.error("lane %d: no placement from the coordinator", self.lane)
                return 3
        self.role = M.Role.SOLO
        self.beat(force=True)
        while not self.stopping:
            msg = self.recv(2 if self.loader.busy else int(self.cfg.heartbeat_s * 1000))
            if msg is not None:
                try:
                    self.handle(msg)
                except Cancelled:
                    pass
            self.report_loads()
            self.beat()
        return 0

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self.card is not None:
            self.card.close()
        if self.writer is not None:
            self.writer.close(drop=self.stopping)  # at a stop, only the write under way lands
        if self.store is not None:
            self.store.close()
        for s in self.segments:
            s.close()
        self.sock.close(linger=200)
        self.ctx.term()


@contextlib.contextmanager
def fitting_alone(card: str, fit: bool, run: str, beat=lambda: None):
    """Lanes of one GPU that fit their pools to the memory left build one after the other (a file lock a GPU and
    user), each seeing what the others took; yields how many lanes of this GPU built before this one in this
    daemon's run (run: its shm prefix; the count is kept in the lock file and goes up once a build succeeds).
    beat() is called while the lock is waited for (the coordinator hears from a lane that waits)."""
    if not fit:
        yield 0
        return
    path = os.path.join(tempfile.gettempdir(), f"stratad-{os.getuid()}-gpu{card}-fit.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                beat()
                time.sleep(0.2)
        seen = os.pread(fd, 512, 0).decode(errors="replace").split()
        before = int(seen[1]) if len(seen) == 2 and seen[0] == run and seen[1].isdigit() else 0
        yield before
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{run} {before + 1}".encode(), 0)
    finally:
        os.close(fd)  # the lock goes with it, also when the lane dies holding it


def error_reply(lane: int, req_id: str, e: Exception) -> M.Error:
    """A request's failure as the client sees it: `bad_request` only for input Generation refused (BadRequest),
    anything else is this lane's fault (`internal`, with the exception's type; the traceback is in the log)."""
    if isinstance(e, BadRequest):
        return M.Error(req_id=req_id, code=M.ErrorCode.BAD_REQUEST, message=str(e))
    return M.Error(req_id=req_id, code=M.ErrorCode.INTERNAL,
                   message=f"lane {lane} failed serving the request: {type(e).__name__}: {e} (see the daemon's log)")


def card_failure(a: LaneConfig, placement: M.Placement, model: ModelFile, e: Exception) -> str:
    """Why building card a.card failed, in the terms of the daemon's configuration."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "cupy":
        return (f"card {a.card} is a GPU card but CuPy is not installed (install the gpu extra: "
                f"pip install 'stratad[gpu]'; or use 'cpu' cards)")
    if type(e).__name__ == "OutOfMemoryError":  # CuPy's, on the card's first allocation that did not fit
        if placement.fit:  # expert_cache = auto: the slots were to be what is left; the rest did not fit
            return (f"card {a.card}: out of GPU memory building the lane before any expert slot (the model's dense "
                    f"weights, a KV cache of {a.context_length} tokens, prompt chunks of {a.prompt_chunk} tokens): "
                    f"lower context_length or prompt_chunk ({e})")
        gib = placement.n_slots * slot_bytes(model) / 2**30
        return (f"card {a.card}: out of GPU memory building the lane ({placement.n_slots} expert slots = {gib:.1f} "
                f"GiB, a KV cache of {a.context_length} tokens, prompt chunks of {a.prompt_chunk} tokens): lower "
                f"expert_cache (or set it to auto), context_length or prompt_chunk ({e})")
    return f"card {a.card}: {type(e).__name__}: {e}"


def parse_args(argv: list[str] | None = None) -> LaneConfig:
    """The lane's command line: one argument, its LaneConfig as JSON (coordinator/lanes.py lane_argv writes it)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m lane.main LANE_CONFIG_JSON (the coordinator starts lanes)")
    return LaneConfig.model_validate_json(argv[0])


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format=f"%(asctime)s lane{cfg.lane} %(levelname)s %(message)s")
    stop = StopSignal()  # before PR_SET_PDEATHSIG: the coordinator's death is the same flag
    # the coordinator that started this lane (the environment names it, so a coordinator already gone is seen)
    die_with(int(os.environ.get("STRATAD_PARENT_PID") or os.getppid()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on `stratad serve` reaches the group: the coordinator stops us
    lane = Lane(cfg, stop)
    try:
        if lane.model.header_hash != cfg.model_hash:
            log.error("lane %d: model file changed under the daemon (header hash differs)", cfg.lane)
            return 4
        return lane.run()
    finally:
        lane.close()
        stop.close()


if __name__ == "__main__":
    sys.exit(main())

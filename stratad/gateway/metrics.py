"""Prometheus metrics: vLLM's names where the meaning is the same (under `stratad:`), and the daemon's own state
(lanes' roles, where expert work runs, slots, epochs, restarts) read from its status at each scrape."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from protos import messages as M
from stratad.gateway.errors import ApiError

# seconds; vLLM's buckets reach minutes: a long prompt on a partly resident model is read that long
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class DaemonCollector:
    """The latest status, as gauges and counters (set by the /metrics handler just before it renders)."""

    def __init__(self):
        self.status: M.Status | None = None

    def collect(self):
        st = self.status
        up = GaugeMetricFamily("stratad:daemon_up", "1 when the coordinator answered the last status request")
        up.add_metric([], 0 if st is None else 1)
        yield up
        if st is None:
            return
        running = GaugeMetricFamily("stratad:num_requests_running", "Requests on a lane now")
        running.add_metric([], sum(ln.req_id is not None for ln in st.lanes))
        waiting = GaugeMetricFamily("stratad:num_requests_waiting", "Requests waiting for a lane")
        waiting.add_metric([], len(st.queue))
        role = GaugeMetricFamily("stratad:lane_role", "1 for each lane's current role", labels=["lane", "card", "role"])
        share = GaugeMetricFamily("stratad:lane_expert_work_share", "Share of the lane's expert work since it "
                                  "started, by where it ran", labels=["lane", "place"])
        slots = GaugeMetricFamily("stratad:lane_slots_used", "Expert slots of the lane's card in use", labels=["lane"])
        total = GaugeMetricFamily("stratad:lane_slots_total", "Expert slots of the lane's card", labels=["lane"])
        loaded = CounterMetricFamily("stratad:lane_slots_loaded", "Experts copied into the lane's card since it "
                                     "started (fill and swaps)", labels=["lane"])
        restarts = CounterMetricFamily("stratad:lane_restarts", "Times the lane's process was restarted",
                                       labels=["lane"])
        tok_s = GaugeMetricFamily("stratad:lane_tokens_per_second", "The lane's decode rate", labels=["lane"])
        for ln in st.lanes:
            lane = str(ln.lane)
            role.add_metric([lane, ln.card, ln.role.value], 1)
            for place, v in (("own_card", ln.share_card), ("peer_card", ln.share_peer),
                             ("host_read", ln.share_host_read), ("cpu_pool", ln.share_cpu - ln.share_host_read)):
                share.add_metric([lane, place], v)
            slots.add_metric([lane], ln.slots_used)
            total.add_metric([lane], ln.slots_total)
            loaded.add_metric([lane], ln.slots_loaded)
            restarts.add_metric([lane], ln.restarts)
            tok_s.add_metric([lane], ln.tok_s)
        epochs = CounterMetricFamily("stratad:epoch_swaps", "Directory epochs: placement changes since start")
        epochs.add_metric([], st.epoch)
        yield from (running, waiting, role, share, slots, total, loaded, restarts, tok_s, epochs)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("stratad:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("stratad:generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.cache_queries = Counter("stratad:prefix_cache_queries", "Prompt tokens looked up in a lane's kept "
                                     "sequence (prefix_cache)", registry=r)
        self.cache_hits = Counter("stratad:prefix_cache_hits", "Prompt tokens found there (not read again)",
                                  registry=r)
        self.success = Counter("stratad:request_success", "Finished requests", ["finished_reason"], registry=r)
        self.errors = Counter("stratad:request_errors", "Requests that ended in an error", ["code"], registry=r)
        self.expert_work = Counter("stratad:expert_computations", "Expert computations of finished requests, by "
                                   "where they ran", ["place"], registry=r)
        self.ttft = Histogram("stratad:time_to_first_token_seconds", "From the HTTP request to its first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("stratad:time_per_output_token_seconds", "Mean time between a request's tokens after "
                              "the first", buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("stratad:e2e_request_latency_seconds", "From the HTTP request to its last token",
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("stratad:request_queue_time_seconds", "Time waiting for a lane", buckets=_LATENCY,
                               registry=r)
        self.daemon = DaemonCollector()
        r.register(self.daemon)

    def finished(self, g) -> None:
        """A Generation that ended with the daemon's stats."""
        st: M.RequestStats = g.stream.stats
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generation_tokens.inc(st.generated_tokens)
        self.cache_queries.inc(st.prompt_tokens)
        self.cache_hits.inc(st.prompt_cached_tokens)
        self.success.labels("abort" if g.stream.finish_reason == "cancelled" and not g.cut else g.finish_reason).inc()
        for place, n in (("own_card", st.experts_card), ("peer_card", st.experts_peer),
                         ("host_read", st.experts_host_read), ("cpu_pool", st.experts_cpu - st.experts_host_read)):
            self.expert_work.labels(place).inc(n)
        self.queue.observe(st.queue_s)
        if g.t_first:
            self.ttft.observe(g.t_first - g.t0)
            if st.generated_tokens > 1:
                self.tpot.observe((g.t_end - g.t_first) / (st.generated_tokens - 1))
        self.e2e.observe(g.t_end - g.t0)

    def failed(self, e: Exception) -> ApiError:
        err = ApiError.of(e)
        self.errors.labels(err.code or err.kind).inc()
        return err

    def render(self, status: M.Status | None) -> bytes:
        self.daemon.status = status
        return generate_latest(self.registry)

"""The supervisor's liveness rule on real child processes: a lane still building its card may stay silent up to
the start timeout (kernels compiled on a cold cache and the expert pool uploaded took over 30 s for two lanes on
one H200), a serving lane only up to the lane timeout; either past its limit is killed and reported with why."""
import sys
import time

from coordinator.lanes import Supervisor


def supervisor(n: int) -> Supervisor:
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    return Supervisor(["cpu"] * n, lambda h: sleeper, "test-liveness-", timeout_s=30, threads=1, start_timeout_s=600)


def test_a_starting_lane_gets_the_start_timeout_a_serving_lane_the_lane_timeout():
    sup = supervisor(3)
    sup.start_all()
    try:
        starting, serving, stuck = sup.lanes
        serving.ready = True
        now = time.monotonic()
        starting.last_seen = serving.last_seen = now - 40  # past the lane timeout, within the start timeout
        stuck.last_seen = now - 700  # past the start timeout
        procs = {h.lane: h.proc for h in sup.lanes}
        before = time.monotonic()
        dead = dict((h.lane, why) for h, why in sup.reap())
        after = time.monotonic()
        assert set(dead) == {1, 2}

        def silent_for(s: float) -> set[str]:  # what reap() may say: s and the time this process took to call it
            return {f"{n} s" for n in range(round(s + before - now), round(s + after - now) + 1)}

        assert dead[1] in {f"lane 1 stopped answering for {x}" for x in silent_for(40)}, dead[1]
        assert dead[2] in {f"lane 2 did not finish starting (building its card) in {x}" for x in silent_for(700)}, dead
        assert starting.proc is not None and starting.proc.poll() is None  # left to finish starting
        assert procs[1].returncode is not None and procs[2].returncode is not None  # killed and reaped
        assert serving.proc is None and not serving.ready
        starting.last_seen = time.monotonic()
        assert sup.reap() == []
    finally:
        for h in sup.lanes:
            if h.proc is not None:
                h.proc.kill()
                h.proc.wait()

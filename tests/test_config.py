"""Configuration: the host_experts choice, prompt_chunk and prefix_cache are validated and reach every lane's command line."""
from __future__ import annotations

import pytest

from coordinator.lanes import LaneHandle, lane_argv
from stratad import config


def test_host_experts_default_and_choices():
    assert config.load(None, {"model": "m.gguf"}).host_experts == "card"
    assert config.load(None, {"model": "m.gguf", "host_experts": "cpu"}).host_experts == "cpu"
    with pytest.raises(config.ConfigError, match="key 'host_experts'"):
        config.load(None, {"model": "m.gguf", "host_experts": "gpu"})


def test_lane_command_line_carries_host_experts():
    import lane.main

    argv = lane_argv(LaneHandle(lane=1, card="0"), endpoint="ipc:///tmp/x", model="m.gguf", model_hash="h",
                     shm_prefix="/p", context_length=4096, heartbeat_s=1.0, log_level="info", cpu_threads=2,
                     host_experts="cpu")
    assert argv[argv.index("--host-experts") + 1] == "cpu"
    assert lane.main.parse_args(argv[3:]).host_experts == "cpu"


def test_prefix_cache_reaches_the_lane():
    import lane.main

    assert config.load(None, {"model": "m.gguf"}).prefix_cache is False
    common = dict(endpoint="ipc:///tmp/x", model="m.gguf", model_hash="h", shm_prefix="/p", context_length=4096,
                  heartbeat_s=1.0, log_level="info", cpu_threads=2)
    on = lane_argv(LaneHandle(lane=0, card="cpu"), prefix_cache=True, **common)
    off = lane_argv(LaneHandle(lane=0, card="cpu"), **common)
    assert lane.main.parse_args(on[3:]).prefix_cache and not lane.main.parse_args(off[3:]).prefix_cache


def test_prompt_chunk_reaches_the_lane():
    import lane.main

    assert config.load(None, {"model": "m.gguf"}).prompt_chunk == config.GPU_PROMPT_CHUNK
    with pytest.raises(config.ConfigError, match="key 'prompt_chunk'"):
        config.load(None, {"model": "m.gguf", "prompt_chunk": 0})
    common = dict(endpoint="ipc:///tmp/x", model="m.gguf", model_hash="h", shm_prefix="/p", context_length=4096,
                  heartbeat_s=1.0, log_level="info", cpu_threads=2)
    assert lane.main.parse_args(lane_argv(LaneHandle(lane=0, card="0"), prompt_chunk=2048, **common)[3:]) \
        .prompt_chunk == 2048
    assert lane.main.parse_args(lane_argv(LaneHandle(lane=0, card="0"), **common)[3:]).prompt_chunk == \
        config.GPU_PROMPT_CHUNK


def test_status_says_where_host_memory_work_ran():
    """stratactl status: expert work from host memory is split into what the card read over the bus
    (host_experts = card) and what the CPU pool computed."""
    from protos import messages as M
    from stratad.ctl import status_table

    lane = M.LaneStatus(lane=0, card="0", role=M.Role.SOLO, share_card=0.7, share_peer=0.0, share_cpu=0.3,
                        share_host_read=0.2)
    st = M.Status(model="m.gguf", uptime_s=1.0, lanes=(lane,), cards=(), queue=(), queue_limit=4)
    out = status_table(st)
    assert "host%" in out and " 30.0%" in out
    assert "host memory: 20.0% read by the card over the bus, 10.0% on the CPU pool" in out
    quiet = status_table(st.model_copy(update={"lanes": (lane.model_copy(update={"share_host_read": 0.0}),)}))
    assert "read by the card" not in quiet

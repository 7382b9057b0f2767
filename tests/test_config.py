"""Configuration: the host_experts choice and prefix_cache are validated and reach every lane's command line."""
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

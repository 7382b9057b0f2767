"""Configuration: the settings are validated and reach every lane whole (its LaneConfig, on its command line)."""
from __future__ import annotations

import datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.lanes import lane_argv
from stratad import config


def test_host_experts_default_and_choices():
    assert config.load(None, {"model": "m.gguf"}).host_experts == "card"
    assert config.load(None, {"model": "m.gguf", "host_experts": "cpu"}).host_experts == "cpu"
    with pytest.raises(config.ConfigError, match="key 'host_experts'"):
        config.load(None, {"model": "m.gguf", "host_experts": "gpu"})


def lane_config(**daemon_keys) -> config.LaneConfig:
    """The LaneConfig the coordinator hands lane 0 for a daemon configured with these keys, as the lane reads it
    back from its command line."""
    import lane.main

    cfg = config.load(None, {"model": "m.gguf"} | daemon_keys)
    lc = config.LaneConfig.for_lane(cfg, lane=0, card="0", endpoint="ipc:///tmp/x", model="m.gguf", model_hash="h",
                                    shm_prefix="/p", context_length=4096, cpu_threads=2)
    argv = lane_argv(lc)
    assert argv[1:3] == ["-m", "lane.main"] and len(argv) == 4  # the whole configuration in one argument
    return lane.main.parse_args(argv[3:])


def test_lane_command_line_carries_host_experts():
    assert lane_config(host_experts="cpu").host_experts == "cpu"
    assert lane_config().host_experts == "card"


def test_host_cpu_share_is_a_fraction_and_reaches_the_lane():
    assert config.load(None, {"model": "m.gguf"}).host_cpu_share == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(config.ConfigError, match="key 'host_cpu_share'"):
            config.load(None, {"model": "m.gguf", "host_cpu_share": bad})
    with pytest.raises(config.ConfigError, match="key 'host_cpu_share'.*host_experts = 'cpu'"):
        config.load(None, {"model": "m.gguf", "host_experts": "cpu", "host_cpu_share": 0.5})
    assert lane_config(host_cpu_share=0.4).host_cpu_share == 0.4
    assert lane_config().host_cpu_share == 0.0


def test_prefix_cache_reaches_the_lane():
    assert config.load(None, {"model": "m.gguf"}).prefix_cache is True  # on by default with the host cache
    assert lane_config().prefix_cache and not lane_config(prefix_cache=False).prefix_cache


def test_prompt_chunk_reaches_the_lane():
    assert config.load(None, {"model": "m.gguf"}).prompt_chunk == config.GPU_PROMPT_CHUNK
    with pytest.raises(config.ConfigError, match="key 'prompt_chunk'"):
        config.load(None, {"model": "m.gguf", "prompt_chunk": 0})
    assert lane_config(prompt_chunk=2048).prompt_chunk == 2048
    assert lane_config().prompt_chunk == config.GPU_PROMPT_CHUNK


def test_every_lane_setting_reaches_the_lane():
    """Each daemon setting a lane uses arrives as the daemon has it: the rope overrides, the [gpu] table, the
    heartbeat and start timeout, the log level."""
    lc = lane_config(rope_scaling="yarn", rope_scale=4.0, yarn_orig_ctx=32768, heartbeat_s=0.5,
                     lane_start_timeout_s=90.0, log_level="debug",
                     gpu={"pdl": False, "peer_copy": "host", "peers_as_remote": True, "kernel_cache": "/k"})
    assert (lc.rope_scaling, lc.rope_scale, lc.yarn_orig_ctx) == ("yarn", 4.0, 32768)
    assert (lc.heartbeat_s, lc.start_timeout_s, lc.log_level) == (0.5, 90.0, "debug")
    assert lc.gpu == config.GpuOptions(pdl=False, peer_copy="host", peers_as_remote=True, kernel_cache="/k")
    assert lane_config().gpu == config.GpuOptions()


def test_gpu_table_refuses_unknown_keys_and_values():
    with pytest.raises(config.ConfigError, match="key 'gpu.peer_copy'"):
        config.load(None, {"model": "m.gguf", "gpu": {"peer_copy": "nvlink"}})
    with pytest.raises(config.ConfigError, match="key 'gpu.attn_load'"):
        config.load(None, {"model": "m.gguf", "gpu": {"attn_load": "ring"}})


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


def test_http_default_empty_and_bad_addresses():
    """The gateway is on by default at 127.0.0.1:8080 (so `systemctl start stratad` brings it up); "" turns it off,
    in the file and on the command line."""
    assert config.load(None, {"model": "m.gguf"}).http == config.DEFAULT_HTTP == "127.0.0.1:8080"
    assert config.load(None, {"model": "m.gguf", "http": ""}).http == ""
    assert config.load(None, {"model": "m.gguf", "http": "[::1]:9000"}).http == "[::1]:9000"
    for bad in ("8080", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(config.ConfigError, match="key 'http'"):
            config.load(None, {"model": "m.gguf", "http": bad})


def test_http_flag_overrides_the_file(tmp_path):
    from stratad.cli import build_parser

    f = tmp_path / "c.toml"
    f.write_text('model = "m.gguf"\nhttp = ""\n')
    assert config.load(str(f), {}).http == ""
    a = build_parser().parse_args(["serve", "--config", str(f), "--http", "127.0.0.1:9001"])
    assert config.load(a.config, {"http": a.http}).http == "127.0.0.1:9001"
    f.write_text('model = "m.gguf"\nhttp = "127.0.0.1:9002"\n')
    a = build_parser().parse_args(["serve", "--config", str(f), "--http", ""])
    assert config.load(a.config, {"http": a.http}).http == ""
    a = build_parser().parse_args(["serve", "--config", str(f)])  # no flag: the file's
    assert config.load(a.config, {"http": a.http}).http == "127.0.0.1:9002"


@pytest.mark.parametrize("addr", ["0.0.0.0:8080", "[::]:8080", "192.168.1.5:8080", "myhost:8080"])
def test_http_off_loopback_needs_an_api_key(addr):
    """Reachable from other machines (any address but loopback, a host name but localhost): refused without
    api_key_file, naming both settings."""
    with pytest.raises(config.ConfigError, match=r"key 'api_key_file'.*http on .* needs api_key_file"):
        config.load(None, {"model": "m.gguf", "http": addr})
    assert config.load(None, {"model": "m.gguf", "http": addr, "api_key_file": "/k"}).api_key_file == "/k"
    for local in ("127.0.0.1:8080", "[::1]:8080", "localhost:8080", "127.0.0.2:8080"):
        assert config.load(None, {"model": "m.gguf", "http": local}).api_key_file is None


@pytest.mark.parametrize("key,value", [("rope_scale", float("inf")), ("rope_scale", float("nan")),
                                       ("heartbeat_s", float("inf")), ("stop_grace_s", float("nan"))])
def test_infinite_or_nan_values_are_refused_naming_the_key(key, value):
    """TOML writes inf and nan; a float key refuses them like any other bad value (rope_scale = inf crashed the
    start with an OverflowError)."""
    with pytest.raises(config.ConfigError, match=f"key '{key}'"):
        config.load(None, {"model": "m.gguf", key: value})


def test_cards_as_one_index_or_refused_by_name():
    """cards = 0 (one GPU, written as a number) is card 0; a value of another type is a ConfigError naming the key
    (a bool or a number crashed the start with a TypeError)."""
    assert config.load(None, {"model": "m.gguf", "cards": 0}).cards == ("0",)
    for v in (True, 1.5, {"a": 1}, datetime.date(2026, 1, 1)):
        with pytest.raises(config.ConfigError, match="key 'cards'"):
            config.load(None, {"model": "m.gguf", "cards": v})


@pytest.mark.parametrize("content,why", [(b'cards = "\xff"\n', "not valid TOML"), (None, "cannot read it")])
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, content, why):
    path = tmp_path / "stratad.toml"
    if content is None:
        path.mkdir()  # a directory where the file should be
    else:
        path.write_bytes(content)
    with pytest.raises(config.ConfigError, match=f"config file {path}: {why}"):
        config.load(str(path), {})


TOML_VALUES = st.recursive(
    st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(), st.text(max_size=12), st.datetimes(),
              st.dates(), st.times(), st.sampled_from(["cpu", "0,1", "auto", "1GiB", "50%", "127.0.0.1:8080", "card"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=6)
KEYS = sorted(config.DaemonConfig.model_fields)


@settings(max_examples=400, deadline=None, database=None)
@given(data=st.dictionaries(st.sampled_from(KEYS), TOML_VALUES, min_size=1, max_size=4),
       gpu=st.dictionaries(st.sampled_from(sorted(config.GpuOptions.model_fields)), TOML_VALUES, max_size=3))
def test_any_values_give_a_config_or_a_config_error(data, gpu):
    """Whatever a TOML file holds under the daemon's keys (any TOML type, in [gpu] too): a config, or ConfigError
    naming the key, never another exception at the start."""
    try:
        config.load(None, data | ({"gpu": gpu} if gpu else {}))
    except config.ConfigError as e:
        assert "key '" in str(e)

"""Daemon configuration: a TOML file validated by pydantic, overridden by command-line flags.

Every key is documented in the README. Unknown keys and bad values are rejected with the key's name.
"""
from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KiB|MiB|GiB|TiB)\s*$")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


# The GPU card's prompt chunk: a bigger chunk gives each expert more tokens a tensor-core tile (faster prompts), and
# the expert workspaces grow with it (figures: docs/perf-notes.md, "Where the defaults come from")
GPU_PROMPT_CHUNK = 4096
DEFAULT_HTTP = "127.0.0.1:8080"  # the gateway's address unless the config says otherwise ("": none)

class ConfigError(ValueError):
    pass


def default_runtime_dir() -> str:
    if os.geteuid() == 0:
        return "/run/stratad"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/stratad-{os.getuid()}"
    return str(Path(base) / "stratad")


class CacheBudget(BaseModel):
    """A budget: a fraction (of all experts: expert_cache; of the host memory left: kv_cache_host), bytes, or (the
    expert cache only) auto: as many as the card has room for."""
    model_config = ConfigDict(frozen=True, allow_inf_nan=False)
    fraction: float | None = None
    bytes: int | None = None
    auto: bool = False

    @classmethod
    def parse(cls, v: Any) -> "CacheBudget":
        if isinstance(v, CacheBudget):
            return v
        if isinstance(v, str) and v.strip() == "auto":
            return cls(auto=True)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"a fraction must be within 0..1, got {v}")
            return cls(fraction=float(v))
        if isinstance(v, str):
            m = _SIZE.match(v)
            if m:
                return cls(bytes=int(float(m.group(1)) * _UNITS[m.group(2)]))
            try:
                return cls.parse(float(v))
            except ValueError:
                pass
        raise ValueError(f"expected a fraction 0..1, a size such as '40GiB' or 'auto', got {v!r}")

    def __str__(self) -> str:
        if self.auto:
            return "auto"
        return f"{self.fraction:g} of the experts" if self.fraction is not None else f"{self.bytes} bytes"


class GpuOptions(BaseModel):
    """GPU cards' code paths, the config's [gpu] table: the defaults are the measured best; the others exist to
    measure a path on the machine at hand (docs/perf-notes.md)."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # TOML has inf and nan

    pdl: bool = Field(True, description="programmatic dependent launch in captured decode graphs (sm_90+): each "
                                        "kernel's launch overlaps its predecessor's tail")
    peer_copy: Literal["auto", "host"] = Field("auto", description="a peer on another GPU: its input and result "
                                                                   "rows copied peer to peer (auto) or through "
                                                                   "page-locked host memory (host)")
    peers_as_remote: bool = Field(False, description="compute a same-GPU peer's experts by the other-GPU path (to "
                                                     "run that path on a one-GPU machine)")
    kernel_cache: str | None = Field(None, description="folder of compiled kernels (cubins); unset: "
                                                       "$TMPDIR/stratad-kernels-<uid>")
    host_kv_cache: bool = Field(True, description="GPU lanes use the host conversation cache (KV blocks copied "
                                                  "to and from kv_cache_host, through page-locked staging)")
    pack_layers: bool = Field(True, description="a card packs its layers' and LM head's K- and I-quant matrices (Q4_K, Q5_K, "
                                                "Q6_K, IQ3_S) into int8 rows where that costs no expert slot: "
                                                "faster decode steps, the same bits, ~1.2 bytes a weight more")
    fetch_ahead: int = Field(2, ge=0, le=32, description="decode, experts read from the arena (host_experts = "
                                                         "card): up to this many of the next layer's experts no "
                                                         "card holds, as its router guesses them from this layer's "
                                                         "input, fetched over the bus while it is otherwise idle; "
                                                         "0: none. The same bits")


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # TOML has inf and nan

    model: str = Field(description="path of the qwen3moe GGUF file")
    cards: tuple[str, ...] = Field((), description="GPU indices or 'cpu' virtual cards; empty: every GPU, else 2 CPU cards")
    runtime_dir: str = Field(default_factory=default_runtime_dir)
    context_length: int = Field(8192, ge=16, description="KV-cache capacity of each lane, in tokens")
    rope_scaling: Literal["none", "linear", "yarn"] | None = Field(
        None, description="RoPE scaling as llama-server's --rope-scaling; unset: the model file's")
    rope_scale: float | None = Field(None, gt=1.0, description="RoPE context expansion factor (--rope-scale); "
                                                               "unset: the model file's")
    yarn_orig_ctx: int | None = Field(None, ge=16, description="YaRN: the context the model was trained at "
                                                               "(--yarn-orig-ctx); unset: the file's, else its length")
    expert_cache: CacheBudget = Field(CacheBudget(auto=True), description="per-card expert-cache budget: a "
                                      "fraction of all experts, a size, or auto: as many as each card has room for")
    rejoin_idle_s: float = Field(30.0, ge=0)
    mutual_help: bool = False
    replan_interval_s: float = Field(2.0, gt=0, description="how often live counts are checked for a better placement")
    replan_min_gain: float = Field(0.02, ge=0, description="swap experts only when coverage of live work rises this much")
    queue_limit: int = Field(64, ge=1)
    client_queue_messages: int = Field(4096, ge=1, description="replies waiting for one client that does not read "
                                                               "them; past this (or client_queue_bytes) it is cut off")
    client_queue_bytes: int = Field(8 << 20, ge=1024, description="the same limit in bytes")
    client_queue_total_bytes: int = Field(256 << 20, ge=1024, description="every client's waiting replies together; "
                                          "past this the clients with the most waiting are cut off")
    heartbeat_s: float = Field(1.0, gt=0)
    lane_timeout_s: float = Field(30.0, gt=0, description="a lane silent this long is declared dead")
    lane_start_timeout_s: float = Field(600.0, gt=0, description="the same for a lane still building its card")
    stop_grace_s: float = Field(5.0, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    cpu_threads: int = Field(0, ge=0, description="compute threads per lane (CPU pool, numpy); 0: cores / lanes")
    host_experts: Literal["cpu", "card"] = Field(
        "card", description="GPU cards, decode: the experts no card holds are read by the card from the page-locked "
                            "arena over the bus (card: the faster, docs/perf-notes.md) or computed by the CPU pool "
                            "(cpu)")
    host_cpu_share: float = Field(0.0, ge=0.0, le=1.0, description="GPU cards with host_experts = card, decode: the "
                                  "part of the experts no card holds (by expected use) that the CPU pool computes "
                                  "while the card reads the rest over the bus (0: the card reads them all; it "
                                  "pays only on a slow bus, docs/perf-notes.md)")
    prompt_chunk: int = Field(GPU_PROMPT_CHUNK, ge=16, description="GPU cards: tokens a prompt is read in at a "
                              "time (bigger: faster prompts, more workspace, cancels and role changes seen less often)")
    prefix_cache: bool = Field(True, description="a lane keeps its last sequence's KV (and the host conversation "
                                                 "cache, kv_cache_host, every lane's blocks) and reuses it for the "
                                                 "next prompt's common prefix (agents resending a conversation); "
                                                 "not bit-identical to reading the prompt afresh")
    kv_cache_host: CacheBudget = Field(CacheBudget(fraction=0.25), description="the host conversation cache "
                                       "shared by every lane (with prefix_cache): a fraction 0..1 of the host "
                                       "memory left beside the model and the CPU cards' pools, or a size "
                                       "('16GiB'); 0: off")
    profile: str | None = Field(None, description="expert profile: per-(layer, expert) counts, .npy")
    state_dir: str | None = Field(None, description="keeps the learned expert profile between runs (the systemd "
                                                    "unit: /var/lib/stratad); unset: nothing is kept")
    profile_save_s: float = Field(300.0, gt=0, description="how often the learned profile is saved while serving")
    warmup_tokens: int = Field(256, ge=0, description="without a profile: routing warm-up tokens run by lane 0")
    tcp: str | None = Field(None, description="opt-in TCP listener, e.g. tcp://0.0.0.0:5555; needs CURVE keys")
    curve_secret_key_file: str | None = None
    curve_authorized_dir: str | None = Field(None, description="directory of clients' public key files")
    http: str = Field(DEFAULT_HTTP, description="HTTP gateway (OpenAI / Anthropic APIs) at HOST:PORT; empty: no "
                                                "gateway; a non-loopback address needs api_key_file")
    api_key_file: str | None = Field(None, validate_default=True, description="file holding the HTTP gateway's "
                                                                             "API key")
    gpu: GpuOptions = Field(GpuOptions(), description="GPU cards' code paths ([gpu] table)")
    log_level: str = Field("info", pattern="^(debug|info|warning|error)$")

    @field_validator("expert_cache", "kv_cache_host", mode="before")
    @classmethod
    def _budget(cls, v, info):
        b = CacheBudget.parse(v)
        if b.auto and info.field_name != "expert_cache":
            raise ValueError(f"{info.field_name} takes a fraction 0..1 or a size, not 'auto'")
        return b

    @field_validator("host_cpu_share")
    @classmethod
    def _cpu_share(cls, v, info):
        if v and info.data.get("host_experts") == "cpu":
            raise ValueError("is a part of the misses the card would read: with host_experts = 'cpu' the CPU pool "
                             "computes every one of them already")
        return v

    @field_validator("cards", mode="before")
    @classmethod
    def _cards(cls, v):
        if isinstance(v, str):
            v = [c for c in v.split(",") if c.strip()]
        elif isinstance(v, int) and not isinstance(v, bool):  # cards = 0: one GPU
            v = [v]
        elif not isinstance(v, (list, tuple)):
            raise ValueError(f"a list of cards (GPU indices or 'cpu') or a string such as \"0,1\", got {v!r}")
        out = []
        for c in v:
            c = str(c).strip()
            if c != "cpu" and not c.isdigit():
                raise ValueError(f"a card is a GPU index or 'cpu', got {c!r}")
            out.append(c)
        return tuple(out)

    @field_validator("http")
    @classmethod
    def _http(cls, v):
        v = v.strip()
        if v:
            from stratad.gateway.launch import parse_listen  # the gateway's own check, so both agree

            parse_listen(v)
        return v

    @field_validator("api_key_file")
    @classmethod
    def _http_key(cls, v, info):
        http = info.data.get("http")
        if http and v is None:
            from stratad.gateway.launch import is_loopback, parse_listen

            if not is_loopback(parse_listen(http)[0]):
                raise ValueError(f"http on {http} (not a loopback address) needs api_key_file")
        return v

    @field_validator("tcp")
    @classmethod
    def _tcp(cls, v):
        if v is not None and not v.startswith("tcp://"):
            raise ValueError(f"expected tcp://HOST:PORT, got {v!r}")
        return v


class LaneConfig(BaseModel):
    """Everything a lane process starts with: built by the coordinator (for_lane) and handed to the lane whole, as
    JSON on its command line. The defaults are DaemonConfig's; nothing here has one of its own."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # TOML has inf and nan

    lane: int
    card: str
    endpoint: str
    model: str
    model_hash: str
    shm_prefix: str
    context_length: int
    cpu_threads: int
    heartbeat_s: float
    start_timeout_s: float  # how long to wait for the coordinator's placement
    log_level: str
    host_experts: Literal["cpu", "card"]
    host_cpu_share: float
    prompt_chunk: int
    prefix_cache: bool
    kv_store: str  # the host conversation cache's segment ("": none)
    rope_scaling: Literal["none", "linear", "yarn"] | None
    rope_scale: float | None
    yarn_orig_ctx: int | None
    gpu: GpuOptions

    @classmethod
    def for_lane(cls, cfg: DaemonConfig, *, lane: int, card: str, endpoint: str, model: str, model_hash: str,
                 shm_prefix: str, context_length: int, cpu_threads: int, kv_store: str = "") -> "LaneConfig":
        return cls(lane=lane, card=card, endpoint=endpoint, model=model, model_hash=model_hash,
                   shm_prefix=shm_prefix, context_length=context_length, cpu_threads=cpu_threads,
                   heartbeat_s=cfg.heartbeat_s, start_timeout_s=cfg.lane_start_timeout_s, log_level=cfg.log_level,
                   host_experts=cfg.host_experts, host_cpu_share=cfg.host_cpu_share, prompt_chunk=cfg.prompt_chunk,
                   prefix_cache=cfg.prefix_cache, kv_store=kv_store,
                   rope_scaling=cfg.rope_scaling, rope_scale=cfg.rope_scale, yarn_orig_ctx=cfg.yarn_orig_ctx,
                   gpu=cfg.gpu)


def load(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Read the TOML file (if any), apply the non-None overrides, validate."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except OSError as e:  # a directory, no permission
            raise ConfigError(f"config file {path}: cannot read it ({e.strerror})") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path}: not valid TOML ({e})") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return DaemonConfig(**data)
    except ValidationError as e:
        where = f"config file {path}" if path else "configuration"
        msgs = [f"key '{'.'.join(str(p) for p in err['loc'])}': {err['msg']}" for err in e.errors()]
        raise ConfigError(f"{where}: " + "; ".join(msgs)) from None

"""Every control-plane message: typed, versioned, validated (pydantic). Per-layer data never travels here."""
from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 << 20  # a request with a ~100K-token prompt as token ids fits with room to spare
# Stop strings travel to the lane with the request and are searched for after every token: bounded (OpenAI takes 4)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024


class ErrorCode(str, Enum):
    BAD_FRAME = "bad_frame"  # not a message of this protocol (malformed, oversized, unknown type)
    BAD_VERSION = "bad_version"
    BAD_REQUEST = "bad_request"  # a valid message with unusable contents
    PROMPT_TOO_LONG = "prompt_too_long"
    QUEUE_FULL = "queue_full"
    DUPLICATE_REQUEST = "duplicate_request"
    UNKNOWN_REQUEST = "unknown_request"
    LANE_FAILED = "lane_failed"  # the lane serving the request died
    SHUTTING_DOWN = "shutting_down"
    CLIENT_TOO_SLOW = "client_too_slow"  # the client stopped reading: its replies outgrew their queue; cut off
    INTERNAL = "internal"


class Role(str, Enum):
    SOLO = "solo"
    LEAD = "lead"
    PEER = "peer"
    MUTUAL = "mutual"
    STARTING = "starting"
    DOWN = "down"


REQ_ID_MAX = 128  # characters of a client's request id


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: int = PROTOCOL_VERSION


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    arguments: dict[str, Any]  # a mapping, as transformers' chat templates render it (not a JSON string)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: str
    content: str
    # Protocol v1, tools (optional: a message without them is what it was before): an assistant turn's calls, a
    # tool result's call id and tool name, an assistant turn's reasoning. Passed to the chat template as given.
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["function"] = "function"
    function: ToolFunction


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = Field(0, ge=-2**63, lt=2**63)  # any int64; each one its own reproducible draws (-1 is not "random")
    stop: tuple[Annotated[str, Field(max_length=MAX_STOP_CHARS)], ...] = Field((), max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False


# ---- client <-> coordinator ---------------------------------------------------------------------------------
class Generate(_Msg):
    type: Literal["generate"] = "generate"
    req_id: str = Field(min_length=1, max_length=REQ_ID_MAX)
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    tokens: tuple[int, ...] | None = None
    sampling: Sampling = Sampling()
    digest: bool = False  # report a sha256 of every step's logits (bit-exactness checks across modes)
    # Protocol v1, tools (optional; with messages only): the tools the chat template shows the model, the
    # template's enable_thinking (None: the template's default), and text the reply starts with (rendered after
    # the generation prompt: a forced tool call's opening, or an assistant turn to continue).
    tools: tuple[Tool, ...] | None = None
    enable_thinking: bool | None = None
    prefill: str = ""

    @model_validator(mode="after")
    def _one_input(self):
        given = [n for n in ("prompt", "messages", "tokens") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt, messages, tokens is required (got {given or 'none'})")
        if self.messages is None:
            extra = [n for n in ("tools", "enable_thinking") if getattr(self, n) is not None]
            if extra or self.prefill:
                raise ValueError(f"{', '.join(extra + ['prefill'] * bool(self.prefill))} need messages")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's arguments besides the messages (those given)."""
        kw: dict[str, Any] = {}
        if self.tools is not None:
            kw["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.enable_thinking is not None:
            kw["enable_thinking"] = self.enable_thinking
        return kw


class Cancel(_Msg):
    type: Literal["cancel"] = "cancel"
    req_id: str = Field(max_length=REQ_ID_MAX)


class StatusRequest(_Msg):
    type: Literal["status_request"] = "status_request"


class Accepted(_Msg):
    type: Literal["accepted"] = "accepted"
    req_id: str
    prompt_tokens: int
    queue_position: int  # 0: went straight to a lane


class TokenChunk(_Msg):
    type: Literal["tokens"] = "tokens"
    req_id: str
    tokens: tuple[int, ...]
    text: str


class RequestStats(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prompt_tokens: int = 0
    prompt_cached_tokens: int = 0  # of the prompt, read from the lane's last sequence (prefix_cache)
    generated_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0  # from the lane taking the request to the first token
    decode_tok_s: float = 0.0
    lane: int = -1
    experts_card: int = 0  # expert computations on the lane's own card
    experts_peer: int = 0  # on other cards
    experts_cpu: int = 0  # from host memory: on the CPU pool, or by the card reading the arena (experts_host_read)
    decode_experts_card: int = 0  # the same, counting only the decode steps (after the prompt)
    decode_experts_peer: int = 0
    decode_experts_cpu: int = 0
    experts_staged: int = 0  # expert copies made to the card for the prompt (GPU cards: experts no card holds)
    experts_host_read: int = 0  # of experts_cpu: computed by the card from the arena over the bus (host_experts = card)
    expert_bytes: int = 0  # bytes of one expert's weights (the largest layer's): counts x this = bytes moved
    logits_sha256: str | None = None  # with Generate.digest
    lane_io_s: float = 0.0  # time the lane spent on the daemon's messaging (sending chunks, reading control)


class Done(_Msg):
    type: Literal["done"] = "done"
    req_id: str
    finish_reason: Literal["stop", "length", "cancelled"]
    stats: RequestStats


class Error(_Msg):
    type: Literal["error"] = "error"
    req_id: str | None = None
    code: ErrorCode
    message: str


class LaneStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    lane: int
    card: str
    role: Role
    pid: int = 0
    req_id: str | None = None
    tok_s: float = 0.0
    generated: int = 0
    share_card: float = 0.0  # share of expert work on the own card / peer cards / CPU, since start
    share_peer: float = 0.0
    share_cpu: float = 0.0
    share_by_peer: tuple[tuple[int, float], ...] = ()  # (card, share of expert work) for each other card used
    share_host_read: float = 0.0  # of share_cpu: read by the card from host memory (host_experts = card)
    slots_used: int = 0
    slots_total: int = 0
    slots_loaded: int = 0  # experts copied into the card since the lane started (fill and swaps)
    epoch: int = 0  # the directory epoch of the lane's current view
    kept_tokens: int = 0  # prefix_cache: tokens of the last sequence the lane keeps for the next prompt
    restarts: int = 0
    role_since: float = 0.0  # unix time of the last role change
    failed: str | None = None  # why the coordinator gave up restarting this lane
    pool: str = ""  # how other lanes reach this card's slot pool: segment name (CPU) or CUDA IPC handle, hex (GPU)
    device: str = ""  # where the pool lives: "cpu" or "cuda:<PCI bus id>"


class CardStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    card: str
    kind: Literal["cpu", "gpu"]
    memory_used: int = 0  # bytes
    memory_total: int = 0
    used_by: tuple[int, ...] = ()  # lanes computing from this card's cache (its own lane first)


class RoleEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    time: float  # unix time
    lane: int
    role: Role


class KvCacheStatus(BaseModel):
    """The host conversation cache (stratad/kv_store.py): blocks held, their bytes, and what lanes got from it
    (hits: requests that restored some of their prompt from it; tokens: prompt tokens restored)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    entries: int = 0
    bytes_used: int = 0
    bytes_limit: int = 0
    block_tokens: int = 0
    lookups: int = 0
    hits: int = 0
    tokens_served: int = 0
    blocks_written: int = 0


class Status(_Msg):
    type: Literal["status"] = "status"
    model: str
    uptime_s: float
    lanes: tuple[LaneStatus, ...]
    cards: tuple[CardStatus, ...]
    queue: tuple[str, ...]  # queued request ids, oldest first
    queue_limit: int
    epoch: int = 0
    role_log: tuple[RoleEvent, ...] = ()  # the latest role changes, oldest first
    profile: str = ""  # where the starting expert profile came from (a file, a saved run, a warm-up, none)
    kv_cache: KvCacheStatus | None = None  # the host conversation cache; None: off
    model_types: str = ""  # the file's type and each role's tensor types (ModelFile.types_summary)


# ---- coordinator <-> lane -----------------------------------------------------------------------------------
class LaneHello(_Msg):
    type: Literal["lane_hello"] = "lane_hello"
    lane: int
    pid: int
    card: str
    model_hash: str


class Assign(_Msg):
    type: Literal["assign"] = "assign"
    req_id: str
    tokens: tuple[int, ...]
    sampling: Sampling
    digest: bool = False


class Heartbeat(_Msg):
    type: Literal["heartbeat"] = "heartbeat"
    status: LaneStatus


class RoleChange(_Msg):
    type: Literal["role"] = "role"
    role: Role
    epoch: int = 0


class Placement(_Msg):
    """The experts this lane's card holds, in slot order, for a directory epoch."""
    type: Literal["placement"] = "placement"
    epoch: int
    n_slots: int = Field(ge=0)
    experts: tuple[tuple[int, int], ...]  # (layer, expert)
    warmup_tokens: int = 0  # run this many tokens of the built-in text first, to seed the live expert counts
    # expert_cache = auto on a GPU card: hold the first experts of the list up to what the card has room for beside
    # its own needs (n_slots at most), sharing the GPU with gpu_lanes such lanes; the lane's first Heartbeat tells
    # how many (slots_total). cards: the daemon's card count (the most sources a prompt chunk's rows may hold)
    fit: bool = False
    gpu_lanes: int = Field(1, ge=1)
    cards: int = Field(1, ge=1)


class CardView(BaseModel):
    """Another card's slots a lane may compute from: its slot pool (a shared segment / CUDA IPC handle) and
    which expert sits in which slot."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    card: int
    pool: str  # segment name (CPU card) or CUDA IPC handle, hex (GPU card)
    device: str = ""  # "cpu" or "cuda:<PCI bus id>"
    generation: int  # the owning lane's incarnation: a restarted lane has a new pool
    experts: tuple[tuple[int, int, int], ...]  # (layer, expert, slot)


class View(_Msg):
    """The other cards' experts a lane may use from its next token on; acknowledged with EpochAck."""
    type: Literal["view"] = "view"
    epoch: int
    cards: tuple[CardView, ...]


class EpochAck(_Msg):
    type: Literal["epoch_ack"] = "epoch_ack"
    epoch: int


class Load(_Msg):
    """Fill these slots of the lane's own card (nobody else computes from them until the next View)."""
    type: Literal["load"] = "load"
    epoch: int
    slots: tuple[tuple[int, int, int], ...]  # (slot, layer, expert)


class Loaded(_Msg):
    type: Literal["loaded"] = "loaded"
    epoch: int


class LaneFailed(_Msg):
    """The lane could not build its card (sent before it exits): why, for the coordinator's log and status."""
    type: Literal["lane_failed"] = "lane_failed"
    reason: str


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


ClientToCoordinator = Annotated[Union[Generate, Cancel, StatusRequest], Field(discriminator="type")]
CoordinatorToClient = Annotated[Union[Accepted, TokenChunk, Done, Error, Status], Field(discriminator="type")]
LaneToCoordinator = Annotated[Union[LaneHello, TokenChunk, Done, Error, Heartbeat, EpochAck, Loaded, LaneFailed],
                              Field(discriminator="type")]
CoordinatorToLane = Annotated[Union[Assign, Cancel, RoleChange, Placement, View, Load, Shutdown], Field(discriminator="type")]

"""What crosses a process boundary, and its codec.

    worker -> ModelRunnerOutput -> EngineCore's scheduler -> EngineCoreOutput -> AsyncLLM

- `RequestSpec` (`SamplingParams.extra_args[SPEC_KEY]`, one value): all of ours an engine request carries, frontend
  to scheduler and workers: the key its vectors come back under, what to capture (`CaptureSpec`), its steering
  (`SteerEntry`) and, in tests, the hook to fail for it.
- `PlanEntry` (SchedulerOutput attribute `PLAN_ATTR`): scheduler to worker, what to capture.
- `StepCapture` (ModelRunnerOutput attribute `STEP_ATTR`): worker to scheduler, one buffer per step.
- `EngineMessage` (`kv_transfer_params[OUTPUT_KEY]`): scheduler to frontend, one typed message per
  output, under the request's key: its rows and heads' outputs (`CapturedRows`, raw little-endian bytes: vLLM's
  msgpack, never pickled), the stop condition that finished it (`StopReport`), where its conditional steering
  applied (`SteeredReport`), and a `HookFault`: a hook of ours that raised for it in the worker
  (`StepCapture.faults`) or the scheduler; that request finishes with vLLM's "error" and its caller gets a
  500 naming the hook, the others go on. Taken off before vLLM reads that field.

Decoding validates and raises `HiddenStatesProtocolError`; nothing here executes message code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

# The `extra_args` key (an OpenAI request's `vllm_xargs`) of a request's one RequestSpec. Every key with this
# prefix is ours: stripped from what clients send, so no client can forge a capture or join a collector.
SPEC_KEY = "hidden_states"
RESERVED_EXTRA_ARGS_PREFIX = SPEC_KEY
STEP_ATTR = "hidden_states_step"  # ModelRunnerOutput attribute: the step's StepCapture
SEQ_ATTR = "hidden_states_seq"  # SchedulerOutput attribute: the step's sequence number (async scheduling)
PLAN_ATTR = "hidden_states_plan"  # SchedulerOutput attribute: the step's capture plan, {request id: PlanEntry}
OUTPUT_KEY = "hidden_states_output"  # EngineCoreOutput.kv_transfer_params key: one EngineMessage
# Pipeline parallelism: the rows an earlier stage gathered at its layers ride its IntermediateTensors to the last
# stage, which sends them: [rows, D] in the model's dtype under PP_ROWS_KEY, and under PP_INDEX_KEY int64
# [layer, number of plan entries, the entries..., number of rows] per slice (capture._RunnerHook.forward_rows).
PP_ROWS_KEY = "hidden_states_rows"
PP_INDEX_KEY = "hidden_states_rows_index"
# ...and the requests a hook of an earlier stage failed, the stage that sends reports them (uint8: msgspec JSON of
# request id -> HookFault; encode_pp_faults)
PP_FAULTS_KEY = "hidden_states_faults"
# The engine's static layer set, frontend to workers at start: VllmConfig.additional_config[CONFIG_KEY]
# = {"capture_layers": [decoder-layer indices]} (vLLM hashes additional_config into its compile-cache key).
CONFIG_KEY = "hidden_states"
# Tests only: with FAULT_INJECTION_ENV=1 in the engine's environment, a request whose spec names a hook
# (`RequestSpec.inject`) makes that hook raise for it (HTTP clients cannot set it: reserved prefix).
FAULT_INJECTION_ENV = "HIDDEN_STATES_FAULT_INJECTION"


def capture_layers_of(vllm_config: Any) -> list[int]:
    """The engine's static layer set (decoder-layer indices 0..L-1), as the engine put it in the config."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return []
    return [int(l) for l in (extra.get(CONFIG_KEY) or {}).get("capture_layers") or ()]


def with_capture_layers(vllm_config: Any, layers: Sequence[int]) -> None:
    """Puts the static layer set where every worker reads it (and vLLM's compile-cache hash sees it)."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    vllm_config.additional_config = {**extra, CONFIG_KEY: {"capture_layers": sorted(set(layers))}}


# dtype name -> bytes per element. bfloat16 has no numpy dtype: decoded by hand.
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_NUMPY_DTYPE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def numpy_dtype(dtype: str) -> np.dtype:
    """The raw element type of `dtype` on the wire (uint16 bit patterns for bfloat16)."""
    return np.dtype(_NUMPY_DTYPE[dtype])


def widen(values: np.ndarray, dtype: str) -> np.ndarray:
    """Raw elements of `dtype` as float32 (exact: float16 and bfloat16 widen without loss)."""
    if dtype == "bfloat16":
        return (np.asarray(values, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.asarray(values).astype(np.float32, copy=False)


def narrow(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 as raw elements of `dtype` (uint16 bits for bfloat16), round-to-nearest-even as torch:
    `widen`'s inverse."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        bits = values.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return values.astype(numpy_dtype(dtype))


@dataclasses.dataclass(frozen=True)
class Span:
    """Positions of prompt+completion as the engine captures them: range(start, end, stride) on a
    sequence of `total` tokens; negative start/end count from the end (end None: to the end).
    The position p row is the hidden state of token p (token p as input)."""

    start: int
    end: int | None = None
    stride: int = 1

    @staticmethod
    def of(position: str | Mapping[str, Any], prompt_len: int) -> Span:
        if position == "completion":
            return Span(prompt_len)
        if position == "all":
            return Span(0)
        if position == "completion_end":
            return Span(-1)
        if position == "prompt_end":
            return Span(prompt_len - 1, prompt_len)
        return Span(position["start"], position.get("end"), position.get("stride", 1) or 1)

    def to_list(self) -> list:
        return [self.start, self.end, self.stride]

    @property
    def final_only(self) -> bool:
        """The final position alone (completion_end): its row is the tail step's, nothing before."""
        return self.start == -1 and self.end is None

    @staticmethod
    def from_list(raw: Sequence) -> Span:
        return Span(int(raw[0]), None if raw[1] is None else int(raw[1]), int(raw[2]))

    def positions(self, total: int) -> range:
        """The positions of a sequence of `total` tokens."""
        s = max(self.start + total if self.start < 0 else self.start, 0)
        e = total if self.end is None else min(self.end + total if self.end < 0 else self.end, total)
        return range(s, max(s, e), self.stride)

    def lowest(self, prompt_len: int) -> int:
        """The lowest position that can be asked of a completion of at least one token."""
        return max(self.start + prompt_len + 1, 0) if self.start < 0 else self.start

    def classify(self, p: np.ndarray, known: int, total: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(wanted, undecided) masks of captured positions `p`, given a sequence of at least `known`
        tokens (and of exactly `total` once it ended); the rest is never wanted."""
        p = np.asarray(p, dtype=np.int64)
        none = np.zeros(p.shape, dtype=bool)
        if total is not None:
            r = self.positions(total)
            return (p >= r.start) & (p < r.stop) & ((p - r.start) % r.step == 0), none
        if self.start < 0:  # aligned to the end: decided once the sequence ends
            undecided = p >= known + self.start
            if self.end is not None and self.end >= 0:
                undecided &= p < self.end
            return none, undecided
        ok = (p >= self.start) & ((p - self.start) % self.stride == 0)
        if self.end is None:
            return ok, none
        if self.end >= 0:
            return ok & (p < self.end), none
        sure = ok & (p < known + self.end)
        return sure, ok & ~sure

    def capturable(self, first: int, stop: int) -> list[int]:
        """Of the positions first..stop-1 a step computes (the sequence has at least `stop` tokens),
        those that may be wanted."""
        if self.start >= 0:
            lo = max(first, self.start)
            lo += (-(lo - self.start)) % self.stride
            hi = stop if self.end is None or self.end < 0 else min(stop, self.end)
            return list(range(lo, hi, self.stride))
        lo = max(first, stop + self.start)
        hi = stop if self.end is None or self.end < 0 else min(stop, self.end)
        return list(range(lo, hi))


def absolute_layer(layer: int, num_layers: int) -> int:
    """transformers' numbering: 0 = embeddings, num_layers = after the final norm; negative counts from the end."""
    return layer if layer >= 0 else num_layers + 1 + layer


class HiddenStatesProtocolError(ValueError):
    """A captured vector that does not decode (a bug or a version mismatch, never a client's doing)."""


def _convert(raw, cls, what: str):
    """`raw` (builtins off an engine output) as `cls`; else HiddenStatesProtocolError."""
    try:
        return msgspec.convert(raw, cls)
    except (msgspec.ValidationError, TypeError) as e:
        raise HiddenStatesProtocolError(f"malformed {what}: {e}") from None


class CaptureSpec(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """What the engine captures of one request (`RequestSpec.capture`)."""

    # Positions of prompt+completion to capture in every step that computes them: params.Span as
    # [start, end | None, stride]. [-1, None, 1] (completion_end) is planned in the tail step only.
    span: list[int | None]
    # Layers as transformers numbers `output_hidden_states` (-1 = after the final norm).
    layers: list[int] = msgspec.field(default_factory=lambda: [-1])
    # True: the span can hold the request's final token, whose row no generation step computes
    # (the final token is an output). The scheduler decides whether a tail step computes it
    # (hidden_states/vllm/core/scheduler.py); where none does, the frontend's extraction step.
    reaches_final: bool = False
    dtype: str = "float32"  # rows cast on the device
    topk: int = 0  # > 0: per position the k largest-magnitude entries
    # Rows on every output (a stream of several positions, RequestOutputKind.DELTA / CUMULATIVE), or
    # all of them on the finishing output only (no per-step work for rows nobody reads before the end).
    every_step: bool = False
    # Heads (hidden_states/heads.py) run on the device over the same positions: [name, k] (k: an
    # SAE's features per position; 0 for a linear head's every output). `layers` may then be empty
    # (heads alone: no rows travel).
    heads: list[list] = msgspec.field(default_factory=list)
    # Stop conditions on heads' outputs (hidden_states_stop), judged by the scheduler on every completion
    # row the steps compute: the request finishes at the first position where one holds.
    monitors: list[Monitor] = msgspec.field(default_factory=list)
    # hidden_states_pool "mean": the span's rows summed per layer in float32 (on the device where a step's rows
    # are all wanted, `PlanEntry.pool`), sent once, on the finishing output (`CapturedRows.pooled`).
    pool: bool = False

    def head_spec(self, name: str, k: int) -> CaptureSpec:
        """The spec a head's outputs are kept under in the engine core: float32, `k` wide top-k or dense."""
        return msgspec.structs.replace(self, dtype="float32", topk=k, heads=[], monitors=[], pool=False)


class Monitor(msgspec.Struct, array_like=True, frozen=True):
    """One stop condition as the engine judges it: head `head`'s output `index` (an SAE's feature
    activation, as SAELens's encode gives it; a linear head's class score after its activation), in
    float32 on the device per completion row, against `threshold` (`above`: score > threshold; else
    score < threshold)."""

    head: str
    index: int
    above: bool
    threshold: float

    def holds(self, score: float) -> bool:
        return score > self.threshold if self.above else score < self.threshold


# A step's monitor scores travel as a block of the step's buffer under this head name: float32
# [watched positions, the request's monitors] (RowBlock.head); never a registered head's name.
MONITOR_BLOCK = "\x00monitors"
# A request a monitor stopped finishes "stop", its stop_reason STOP_REASON.format(monitor index).
STOP_REASON = "hidden_states_stop[{}]"


class Clamp(msgspec.Struct, array_like=True, frozen=True):
    """A clamp's SAE feature i, as SAELens encodes it from the stream x (little-endian float32 [D] each):
    f = relu((x - b_dec) . w_mag + b_mag) * [(x - b_dec) . w_gate + b_gate > threshold] (standard: w_gate =
    w_mag, threshold 0; JumpReLU: its threshold; gated: its gate and magnitude paths); the entry adds
    (value - f) x W_dec[i] (SteerEntry.vector)."""

    value: float
    b_dec: bytes
    w_mag: bytes
    b_mag: float
    w_gate: bytes
    b_gate: float
    threshold: float


class SteerEntry(msgspec.Struct, array_like=True, frozen=True):
    """One steering entry as the workers apply it: at transformers' hidden_states[layer] (the output
    of decoder layer layer - 1), on the rows of absolute positions start..end-1 (end -1: to
    the end; `positions` names them as asked, "prompt", "completion" or "all", and `steering.anchor`
    sets them from the prompt's length), `op` "add" (+ scale x vector), "ablate" (the unit
    vector's component projected out), "cap" (that component limited to `cap`) or "clamp" (an SAE
    feature set to a value: `clamp`)."""

    layer: int  # absolute, 0..num_layers - 1
    op: str
    positions: str
    scale: float
    vector: bytes  # little-endian float32 [hidden size]
    start: int = 0
    end: int = -1
    # Conditional (`when`): applied at a completion position q only where the condition held on the
    # head's row of position q - 1; the scheduler decides and the plan names the rows (PlanEntry.steer),
    # or under async scheduling the worker, on the device, from the row before (PlanEntry.steer_if).
    when: Monitor | None = None
    # A replay: exactly these positions (an extraction step of a conditional entry: where it was applied).
    at: list[int] | None = None
    clamp: Clamp | None = None  # op "clamp": the feature's encoder (`vector` is its decoder row)
    cap: float = 0.0  # op "cap": the stream's component along the unit vector at most this

    def array(self) -> np.ndarray:
        return np.frombuffer(self.vector, "<f4")


class RequestSpec(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True, frozen=True):
    """All of ours one engine request carries, as one value (`SamplingParams.extra_args[SPEC_KEY]`): the frontend
    writes it, the scheduler and every worker (every tensor-parallel rank) read it off their own copy of the
    request."""

    # The key its vectors, reports and faults come back under (EngineMessage.key): its collector's tag, and
    # `{tag}.{n}` once the frontend admits it as one engine request of that collector (Extraction.owner).
    key: str = ""
    capture: CaptureSpec | None = None  # what to capture; None: nothing (steering alone)
    steer: list[SteerEntry] = []  # its additions to the residual stream, anchored (steering.anchor)
    inject: str = ""  # tests only (FAULT_INJECTION_ENV): the hook to fail for it

    @staticmethod
    def of(extra_args: Mapping | None) -> RequestSpec:
        """The spec an engine request's extra_args carry (empty: none); a malformed one raises
        HiddenStatesProtocolError."""
        raw = (extra_args or {}).get(SPEC_KEY)
        return _EMPTY if raw is None else _convert(raw, RequestSpec, "request spec")

    def into(self, extra_args: Mapping | None) -> dict:
        """`extra_args` with this spec as its one value of ours (builtins: vLLM's msgpack carries them)."""
        return {**(extra_args or {}), SPEC_KEY: msgspec.to_builtins(self, builtin_types=(bytes,))}

    def replace(self, **parts) -> RequestSpec:
        return msgspec.structs.replace(self, **parts)


_EMPTY = RequestSpec()


class PlanEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What the worker captures of one request in one step. `offsets` index the request's scheduled
    tokens (0 = its first), `positions` are their absolute positions. A step's plan crosses to the workers as
    msgpack bytes (`encode_plan` / `decode_plan`): vLLM's executor carries bytes, no object of ours."""

    offsets: list[int]
    positions: list[int]
    layers: list[int]  # absolute (transformers numbering)
    num_tokens: int  # tokens the request's scheduled span reaches in the step
    dtype: str | None  # the rows cast to it on the device (None: the engine's own)
    topk: int
    heads: list[tuple[str, int]] = []  # (name, k) of the request's heads (CaptureSpec.heads)
    # Rows the request's monitors score (offsets as `offsets`; completion positions not judged yet),
    # their positions, and the monitors as (head, index, above, threshold) (Monitor's fields): the worker
    # sends float32 scores (MONITOR_BLOCK).
    watch: list[int] = []
    watch_positions: list[int] = []
    monitors: list[tuple[str, int, bool, float]] = []
    # The request's conditional steering entries this step: (entry index, offsets of the rows it applies to).
    steer: list[tuple[int, list[int]]] = []
    # Under async scheduling, the ones the scheduler cannot decide yet (the row before was computed by the step
    # still in flight): (entry index, monitor index, offset) applied where that monitor held on the worker's
    # own verdict of the row before (`keep_held`), on the device; the scheduler learns where from the scores.
    steer_if: list[tuple[int, int, int]] = []
    keep_held: bool = False  # keep the verdicts of the last watched row for the next step's `steer_if`
    pool: bool = False  # the rows summed per layer on the device (float32, one row per layer): RowBlock.pooled


_PLAN_DECODER = msgspec.msgpack.Decoder(dict[str, PlanEntry])


def encode_plan(plan: Mapping[str, PlanEntry]) -> bytes:
    """A step's plan, {request id: PlanEntry}, as the bytes the SchedulerOutput carries (PLAN_ATTR)."""
    return msgspec.msgpack.encode(plan)


def decode_plan(raw: bytes | None) -> dict[str, PlanEntry]:
    """The plan a SchedulerOutput carries (PLAN_ATTR), typed; {} for none."""
    return _PLAN_DECODER.decode(raw) if raw else {}


class RowBlock(NamedTuple):
    """One request's rows of one layer in a step's buffer: `positions` (absolute, in
    prompt+completion) x `width` elements of `dtype` at byte `values_at`, and for top-k their
    int32 indices at `indices_at` (-1: dense rows)."""

    num_tokens: int  # tokens the request's scheduled span reaches in the step
    layer: int  # absolute (transformers numbering)
    positions: list[int]
    dtype: str
    width: int
    values_at: int
    indices_at: int = -1
    head: str = ""  # a head's outputs (float32, width = its outputs or k) at `layer`; "": rows
    pooled: bool = False  # one float32 row: the sum of the rows at `positions` (PlanEntry.pool)

    def values(self, data: np.ndarray) -> np.ndarray:
        n = (1 if self.pooled else len(self.positions)) * self.width * ITEMSIZE[self.dtype]
        return data[self.values_at : self.values_at + n].view(_NUMPY_DTYPE[self.dtype]).reshape(-1, self.width)

    def indices(self, data: np.ndarray) -> np.ndarray | None:
        if self.indices_at < 0:
            return None
        n = len(self.positions) * self.width * 4
        return data[self.indices_at : self.indices_at + n].view("<i4").reshape(-1, self.width)


class HookFault(msgspec.Struct, array_like=True, gc=False):
    """A hook of ours that raised while serving one request, where it ran (worker or scheduler)."""

    hook: str  # capture | steering | heads | plan | file | send | tail
    error: str  # the exception's type and message (the traceback is logged where it ran)

    @staticmethod
    def of(hook: str, error: BaseException | str) -> HookFault:
        return HookFault(hook, error if isinstance(error, str) else f"{type(error).__name__}: {error}")


def encode_pp_faults(faults: Mapping[str, HookFault]) -> bytes:
    return msgspec.json.encode(dict(faults))


def decode_pp_faults(raw: bytes) -> dict[str, HookFault]:
    """An earlier pipeline stage's faults (PP_FAULTS_KEY); malformed: HiddenStatesProtocolError."""
    try:
        return msgspec.json.decode(raw, type=dict[str, HookFault])
    except msgspec.DecodeError as e:
        raise HiddenStatesProtocolError(f"an earlier stage's faults do not decode: {e}") from e


def fault_injection() -> bool:
    """Whether this engine process honours injected faults (FAULT_INJECTION_ENV; read once, at start)."""
    import os

    return os.environ.get(FAULT_INJECTION_ENV) == "1"


def injected_fault(extra_args: Mapping | None) -> str | None:
    """The hook a test asks to fail for this request (`RequestSpec.inject`); callers ask only where
    `fault_injection()` holds."""
    return RequestSpec.of(extra_args).inject or None


class InjectedFault(RuntimeError):
    """What an injected fault raises (tests only: FAULT_INJECTION_ENV)."""


@dataclasses.dataclass
class StepCapture:
    """One engine step's captured rows: one byte buffer (`data`, what the step's single
    device-to-host copy brought), and per request id where its rows are in it; and the requests a
    hook of this worker failed (their rows are not in it)."""

    data: np.ndarray  # uint8
    requests: dict[str, list[RowBlock]]
    faults: dict[str, HookFault] = dataclasses.field(default_factory=dict)


class CapturedRows(msgspec.Struct, array_like=True, gc=False):
    """Rows of one engine request at absolute positions of prompt+completion, as many layers:
    `values` [len(layers), len(positions), width] row-major little-endian `dtype` (width = hidden
    size, or k for top-k, with int32 `indices` of the same shape)."""

    dtype: str
    topk: int  # 0: dense rows
    width: int
    layers: list[int]  # absolute layer numbers (transformers')
    positions: list[int]
    values: bytes  # in the engine core, a view of its rows (captured_rows): as bytes once decoded
    indices: bytes = b""
    # On a finishing output: the positions the scheduler's steps scheduled to compute the final
    # token's row (a tail step: 1; a held request recomputed after preemption: more). 0: none ran.
    tail_positions: int = 0
    # hidden_states_pool: `values` [len(layers), 1, width] float32 hold the sums of the rows at `positions`.
    pooled: bool = False

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(values [layers, positions (1 if pooled), width] raw dtype, indices int32 or None)."""
        shape = (len(self.layers), 1 if self.pooled else len(self.positions), self.width)
        values = np.frombuffer(self.values, dtype=_NUMPY_DTYPE[self.dtype]).reshape(shape)
        indices = np.frombuffer(self.indices, dtype="<i4").reshape(shape) if self.topk else None
        return values, indices

    def to_output(self) -> list:
        return msgspec.to_builtins(self, builtin_types=(bytes, memoryview))

    @staticmethod
    def from_output(raw) -> CapturedRows:
        return _convert(raw, CapturedRows, "captured rows").check()

    def check(self) -> CapturedRows:
        """Itself, if its dtype is known and its bytes hold its shape; else HiddenStatesProtocolError."""
        cr = self
        if cr.dtype not in ITEMSIZE:
            raise HiddenStatesProtocolError(f"unsupported dtype {cr.dtype!r}; expected one of {sorted(ITEMSIZE)}")
        n = len(cr.layers) * (1 if cr.pooled else len(cr.positions)) * cr.width
        if cr.pooled and (cr.topk or cr.dtype != "float32"):
            raise HiddenStatesProtocolError("pooled rows are float32 sums, without top-k")
        if cr.width < 1 or n * ITEMSIZE[cr.dtype] != len(cr.values) or len(cr.indices) != (4 * n if cr.topk else 0):
            raise HiddenStatesProtocolError(
                f"{len(cr.values)} + {len(cr.indices)} bytes do not hold {len(cr.layers)} x {len(cr.positions)} x "
                f"{cr.width} of {cr.dtype}" + (" with int32 indices" if cr.topk else "")
            )
        return cr


def captured_rows(
    dtype: str,
    topk: int,
    layers: list[int],
    positions: list[int],
    values: np.ndarray,
    indices: np.ndarray | None,
    pooled: bool = False,
) -> CapturedRows:
    """`values` [len(layers), len(positions), width] raw elements of `dtype` (uint16 bit patterns for
    bfloat16; any byte order); `indices` int32 alike (top-k); `pooled`: [len(layers), 1, width] float32 sums."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype!r}")
    if values.dtype.newbyteorder("<") != np.dtype(_NUMPY_DTYPE[dtype]):
        raise ValueError(f"array of {values.dtype} cannot be sent as {dtype}")
    values = np.ascontiguousarray(values, dtype=_NUMPY_DTYPE[dtype])
    ind = b"" if not topk else _raw(np.ascontiguousarray(indices, dtype="<i4"))
    return CapturedRows(
        dtype,
        int(topk),
        int(values.shape[-1]),
        list(layers),
        [int(p) for p in positions],
        _raw(values),
        ind,
        pooled=pooled,
    )


def _raw(arr: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes as a view, no copy: msgpack writes them out (to_output), and the frontend
    decodes `bytes`."""
    return memoryview(arr.reshape(-1)).cast("B")


class StopReport(msgspec.Struct, array_like=True, frozen=True):
    """The stop condition (`Monitor`) that finished a request: at which position, which one, its score."""

    position: int
    condition: int
    score: float


class SteeredReport(msgspec.Struct, array_like=True, frozen=True):
    """Where a request's conditional steering entries applied since its last output: (entry index, positions)."""

    applied: list[tuple[int, list[int]]]


class EngineMessage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """All one EngineCoreOutput carries of ours (`kv_transfer_params[OUTPUT_KEY]`): typed optional parts, under
    the request's key (`RequestSpec.key`)."""

    key: str = ""
    rows: CapturedRows | None = None
    heads: dict[str, CapturedRows] = {}  # each head's outputs, at the rows' positions
    stop: StopReport | None = None  # on a finishing output: the condition that finished it
    steered: SteeredReport | None = None  # where its `when` entries applied
    fault: HookFault | None = None  # a hook failed it: its finish is "error"

    def __bool__(self) -> bool:
        return any((self.rows, self.heads, self.stop, self.steered, self.fault))

    def to_output(self) -> list:
        return msgspec.to_builtins(self, builtin_types=(bytes, memoryview))

    @staticmethod
    def from_output(raw) -> EngineMessage:
        """The message off an output, every part checked; else HiddenStatesProtocolError."""
        msg = _convert(raw, EngineMessage, "engine message")
        for cr in (msg.rows, *msg.heads.values()):
            if cr is not None:
                cr.check()
        some = msg.rows if msg.rows is not None else next(iter(msg.heads.values()), None)
        if any(h.positions != some.positions for h in msg.heads.values()):
            raise HiddenStatesProtocolError("head outputs at other positions than the rows of their step")
        return msg

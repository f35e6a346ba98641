"""The hidden-states request fields and their rules: one schema, one parse.

`HiddenStatesFields` is the schema; `parse_fields` runs its validators once, in whichever
process first reads the request. The spec crosses to the replica as JSON (`to_json`/`from_json`,
not re-checked) and the engine checks what needs the model (`check_model`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hidden_states.proofs import ProofRequest
from hidden_states.protocol import Span, absolute_layer  # noqa: F401 (the engine-facing forms; re-exported)

# Each set of values once: the request model's types, and the tuples the checks use.
SinglePosition = Literal["completion_end", "prompt_end"]  # one vector per choice (1-D)
NamedPosition = Literal[SinglePosition, "completion", "all"]  # and a range: {"start", "end", "stride"}
Encoding = Literal["float", "base64"]
Dtype = Literal["float32", "float16", "bfloat16"]
Pool = Literal["mean"]
SINGLE_POSITIONS, POSITIONS = get_args(SinglePosition), get_args(NamedPosition)
ENCODINGS, DTYPES, POOLS = get_args(Encoding), get_args(Dtype), get_args(Pool)


def _one_of(values) -> str:
    quoted = [repr(v) for v in values]
    if len(quoted) == 1:
        return quoted[0]
    return ", ".join(quoted[:-1]) + f" or {quoted[-1]}"


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
TOPK_INDEX_BYTES = 4  # a top-k entry's index: int32
DEFAULT_MAX_HIDDEN_STATES_BYTES = 64 * 2**20

DISABLED = (
    "hidden states are disabled on this server: set `enable_return_hidden_states: true` in the app's args "
    "(config.yaml: applications[0].args) and redeploy (a Python engine: "
    "HiddenStatesEngine.start(enable_return_hidden_states=True))"
)


class HiddenStatesRequestError(ValueError):
    """A hidden-states request that cannot be served as asked (a 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModelError(LookupError):
    """A request whose `model` is neither the served model nor one of its LoRA adapters (a 404)."""

    def __init__(self, model: str, served: Sequence[str]):
        super().__init__(unknown_model(model, served))


def unknown_model(model: str, served: Sequence[str]) -> str:
    names = ", ".join(f"`{name}`" for name in served)
    return f"the model `{model}` does not exist; this server serves {names}"


class HiddenStatesDisabledError(HiddenStatesRequestError):
    """Hidden states asked of a server or engine started without them."""

    def __init__(self):
        super().__init__(DISABLED, "return_hidden_states")


class PositionRange(BaseModel):
    """Absolute positions in prompt+completion: range(start, end, stride); negative values count from
    the end of prompt+completion (`{"start": -1}` is the final token); `end` is exclusive, default the end."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    start: int
    end: int | None = None
    stride: int = Field(1, ge=1)


class VectorFields(BaseModel):
    """Which vectors and how they travel: the fields POST /v1/hidden_states shares with completions."""

    model_config = ConfigDict(frozen=True)
    hidden_states_encoding: Encoding = Field(
        "float",
        validation_alias=AliasChoices("hidden_states_encoding", "encoding_format"),
        description="a JSON list of floats, or base64 of the little-endian bytes; OpenAI's `encoding_format` "
        "is taken as an alias",
    )
    hidden_states_layers: list[int] | None = Field(
        None,
        description="layers as transformers numbers output_hidden_states (0 = embeddings, -1 = after the "
        "final norm); the answer then carries hidden_states_by_layer",
    )
    hidden_states_position: NamedPosition | PositionRange = Field(
        "completion_end",
        description="the final token of prompt+completion, the last prompt token, every "
        "completion token, every token, or a range of positions in prompt+completion",
    )
    hidden_states_dtype: Dtype = Field(
        "float32", description="the rows' dtype, cast on the device (base64 carries its little-endian bytes)"
    )
    hidden_states_topk: int | None = Field(
        None, ge=1, description="per position only the k largest-magnitude entries: {indices, values}"
    )

    _encoding = field_validator("hidden_states_encoding", mode="before")(lambda cls, v: check_encoding(v))
    _layers = field_validator("hidden_states_layers", mode="before")(lambda cls, v: check_layer_list(v))
    _position = field_validator("hidden_states_position", mode="before")(lambda cls, v: check_position(v))
    _dtype = field_validator("hidden_states_dtype", mode="before")(lambda cls, v: check_dtype(v))
    _topk = field_validator("hidden_states_topk", mode="before")(lambda cls, v: check_topk(v))

    @property
    def layers(self) -> tuple[int, ...]:
        """The layers asked, as given (the last layer by default); the engine checks them against its model."""
        return tuple(self.hidden_states_layers or (-1,))

    @property
    def position(self) -> str | dict[str, int | None]:
        """The position as the engine takes it: one of POSITIONS, or a range {"start", "end", "stride"}."""
        p = self.hidden_states_position
        return p if isinstance(p, str) else {"start": p.start, "end": p.end, "stride": p.stride}

    def capture(self) -> tuple[tuple[int, ...], str | dict[str, int | None], str, int | None]:
        """(layers, position, dtype, top-k) the engine captures."""
        return self.layers, self.position, self.hidden_states_dtype, self.hidden_states_topk


class HeadAsk(BaseModel):
    """One head a request reads: its name, and for an SAE how many features per position (default: the head's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    topk: int | None = Field(None, ge=1)


class ConditionAsk(BaseModel):
    """A condition on a registered head's output: an SAE's `feature`, a linear head's output by
    `feature` index or `label` (an SAE's `label` is a feature's description), `above` or `below` a
    threshold (hidden_states_stop, and a steering entry's `when`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    head: str
    feature: int | None = Field(None, ge=0)
    label: str | None = None
    above: float | None = None
    below: float | None = None


MAX_STEERING_ENTRIES = 16  # a request's hidden_states_steering entries, at most
STEER_POSITIONS = ("prompt", "completion", "all")


class SteeringAsk(BaseModel):
    """One steering entry as asked: where (layer, positions), what (an inline vector, a registered
    vector's name, or an SAE head's feature: its decoder row), how (add x scale, or ablate)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    layer: int | None = None
    vector: str | list[float] | None = None  # base64 of little-endian float32, or floats
    name: str | None = None
    head: str | None = None
    feature: int | None = Field(None, ge=0)
    scale: float = 1.0
    positions: Literal["prompt", "completion", "all"] = "all"
    op: Literal["add", "ablate", "clamp", "cap"] = "add"
    value: float | None = None  # clamp: the SAE feature's activation set to this
    max: float | None = None  # cap: the stream's component along the unit vector at most this
    when: ConditionAsk | None = None  # applied at a completion position where this held on the row before


MAX_STOP_CONDITIONS = 8  # a request's hidden_states_stop conditions, at most


class StopAsk(ConditionAsk):
    """One stop condition as asked: the condition (ConditionAsk) at a completion position."""

    positions: Literal["completion"] = "completion"


class HiddenStatesFields(VectorFields):
    """The request fields this server adds to vLLM's OpenAI API (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    return_hidden_states: bool = Field(False, description="attach each choice's final-token hidden state")
    hidden_states_proof: ProofRequest | None = Field(
        None,
        description="attach each choice's proofs of inference (TOPLOC): built on the server from the rows "
        "it computes; the rows themselves are not returned",
    )

    hidden_states_heads: list[HeadAsk] | None = Field(
        None,
        description="heads registered on the server (SAEs, linear probes) run on the device over the rows of "
        "hidden_states_position; each choice carries hidden_states_heads {name: outputs}, without "
        "the rows unless return_hidden_states is true too. Items: a name, or {name, topk}",
    )

    hidden_states_steering: list[SteeringAsk] | None = Field(
        None,
        description="add to (or ablate from) the residual stream at chosen layers and positions, for this "
        "request alone: [{layer, vector | name | head + feature, scale, positions, op}] "
        "(docs/steering.md)",
    )

    hidden_states_stop: list[StopAsk] | None = Field(
        None,
        description="finish a choice at the first completion position where a registered head's output "
        "crosses a threshold, judged in the engine on each row it computes: [{head, feature | "
        "label, above | below}] (docs/heads.md); finish_reason stop, stop_reason names it",
    )

    hidden_states_pool: Pool | None = Field(
        None,
        description="per layer, one vector: the mean of the rows of hidden_states_position (reduced in the "
        "engine, the rows never travel); with return_hidden_states, without top-k, heads or proofs",
    )

    _wants = field_validator("return_hidden_states", mode="before")(lambda cls, v: check_bool(v))
    _pool = field_validator("hidden_states_pool", mode="before")(lambda cls, v: check_pool(v))
    _stop = field_validator("hidden_states_stop", mode="before")(lambda cls, v: check_stop(v))
    _proof = field_validator("hidden_states_proof", mode="before")(lambda cls, v: check_proof(v))
    _heads = field_validator("hidden_states_heads", mode="before")(lambda cls, v: check_heads(v))
    _steering = field_validator("hidden_states_steering", mode="before")(lambda cls, v: check_steering(v))

    @model_validator(mode="after")
    def _one_kind(self) -> HiddenStatesFields:
        if self.hidden_states_pool is not None:
            other = (
                "hidden_states_topk" * (self.hidden_states_topk is not None)
                or "hidden_states_heads" * bool(self.hidden_states_heads)
                or "hidden_states_proof" * (self.hidden_states_proof is not None)
            )
            if other:
                raise HiddenStatesRequestError(
                    f"hidden_states_pool cannot be combined with {other}: a pool is the mean of whole rows",
                    "hidden_states_pool",
                )
            if not self.return_hidden_states:
                raise HiddenStatesRequestError(
                    "hidden_states_pool pools the rows of return_hidden_states: set it to true", "hidden_states_pool"
                )
        if self.hidden_states_heads and self.hidden_states_proof is not None:
            raise HiddenStatesRequestError(
                "hidden_states_heads cannot be combined with hidden_states_proof: send two requests (the same seed "
                "gives the same completion)",
                "hidden_states_heads",
            )
        if self.return_hidden_states and self.hidden_states_proof is not None:
            raise HiddenStatesRequestError(
                "hidden_states_proof cannot be combined with return_hidden_states yet: a choice carries its proofs "
                "or its hidden states; send two requests (the same seed gives the same completion)",
                "hidden_states_proof",
            )
        return self

    @property
    def wants(self) -> bool:
        """The request asks for rows (vectors, proofs, or heads' outputs) or steers."""
        return (
            self.return_hidden_states
            or self.hidden_states_proof is not None
            or bool(self.hidden_states_heads)
            or bool(self.hidden_states_steering)
            or bool(self.hidden_states_stop)
        )

    @property
    def heads(self) -> tuple[tuple[str, int | None], ...]:
        """(name, topk or None) of each head asked, in order."""
        return tuple((h.name, h.topk) for h in self.hidden_states_heads or ())

    @property
    def rows_asked(self) -> bool:
        """The rows themselves travel (vectors or a proof's rows); heads alone send none."""
        return self.return_hidden_states or self.hidden_states_proof is not None

    def capture(self) -> tuple[tuple[int, ...], str | dict[str, int | None], str, int | None]:
        """(layers, position, dtype, top-k) the engine captures: the vectors' as asked, or the proof scheme's rows."""
        proof = self.hidden_states_proof
        if proof is not None:
            return (-1,), proof.capture_position, proof.capture_dtype, proof.topk
        return super().capture()

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, raw: bytes) -> HiddenStatesFields:
        """A spec `parse_fields` made in another process, as it was made: read, not checked again."""
        d = json.loads(raw)
        position, proof = d["hidden_states_position"], d["hidden_states_proof"]
        d["hidden_states_position"] = (
            position if isinstance(position, str) else PositionRange.model_construct(**position)
        )
        d["hidden_states_proof"] = None if proof is None else ProofRequest.model_construct(**proof)
        if d.get("hidden_states_heads") is not None:
            d["hidden_states_heads"] = [HeadAsk.model_construct(**h) for h in d["hidden_states_heads"]]
        if d.get("hidden_states_steering") is not None:
            d["hidden_states_steering"] = [
                SteeringAsk.model_construct(
                    **{**e, "when": None if e.get("when") is None else ConditionAsk.model_construct(**e["when"])}
                )
                for e in d["hidden_states_steering"]
            ]
        if d.get("hidden_states_stop") is not None:
            d["hidden_states_stop"] = [StopAsk.model_construct(**e) for e in d["hidden_states_stop"]]
        return cls.model_construct(**d)


# Fields of ours that a request may carry; any other `hidden_states*` field is refused by name.
OUR_FIELDS = frozenset(HiddenStatesFields.model_fields)


def refuse_unknown(req: Mapping[str, Any], ours: frozenset[str] = OUR_FIELDS) -> None:
    unknown = sorted(
        k for k in req if isinstance(k, str) and k.startswith(("hidden_states", "return_hidden")) and k not in ours
    )
    if unknown:
        raise HiddenStatesRequestError(
            f"unknown field {unknown[0]!r}: this server's fields are {', '.join(sorted(ours))}", unknown[0]
        )


NOTHING = HiddenStatesFields()  # a request that asks for no rows

# How many specs this process has parsed (parse_fields): a test reads it to show each request is checked once.
PARSED = [0]


def parse_fields(req: Mapping[str, Any], *, enabled: bool) -> HiddenStatesFields:
    """A request's hidden-states spec from its raw JSON fields (other keys ignored): the one place
    the shape rules run; raises HiddenStatesRequestError (a 400) naming the field."""
    PARSED[0] += 1
    refuse_unknown(req)
    if (
        "encoding_format" in req
        and "hidden_states_encoding" in req
        and req["encoding_format"] != req["hidden_states_encoding"]
    ):  # OpenAI's name (embeddings): an alias
        raise HiddenStatesRequestError(
            f"encoding_format ({req['encoding_format']!r}) and hidden_states_encoding "
            f"({req['hidden_states_encoding']!r}) disagree: send one (encoding_format is its alias)",
            "encoding_format",
        )
    fields = {k: v for k, v in req.items() if k in OUR_FIELDS}
    if "encoding_format" in req and "hidden_states_encoding" not in req:
        fields["encoding_format"] = req["encoding_format"]
    asks = fields.get("return_hidden_states") is True or fields.get("hidden_states_proof") is not None
    if fields.get("hidden_states_steering") and not enabled:
        raise HiddenStatesRequestError(
            DISABLED.replace("hidden states are disabled", "steering is disabled"), "hidden_states_steering"
        )
    if fields.get("hidden_states_stop") and not enabled:
        raise HiddenStatesRequestError(
            DISABLED.replace("hidden states are disabled", "stop conditions are disabled"), "hidden_states_stop"
        )
    if fields.get("hidden_states_heads") and not enabled:
        raise HiddenStatesRequestError(
            DISABLED.replace("hidden states are disabled", "heads are disabled"), "hidden_states_heads"
        )
    if asks and not enabled:
        raise HiddenStatesDisabledError()
    try:
        return HiddenStatesFields.model_validate(fields)
    except ValidationError as e:
        if (ours := request_error(e)) is not None:
            raise ours from None
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise HiddenStatesRequestError(f"{where}: {err.get('msg')}", str(err.get("loc", ("",))[0])) from None


def check_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise HiddenStatesRequestError("return_hidden_states must be a boolean", "return_hidden_states")
    return value


def check_encoding(enc: Any) -> str:
    if enc not in ENCODINGS:
        raise HiddenStatesRequestError(
            f"hidden_states_encoding must be {_one_of(ENCODINGS)}, not {enc!r}", "hidden_states_encoding"
        )
    return enc


def check_layer_list(layers: Any) -> list[int] | None:
    if layers is not None and (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    ):
        raise HiddenStatesRequestError(
            "hidden_states_layers must be a non-empty list of integers (-1 = last layer)", "hidden_states_layers"
        )
    return layers


_POSITION_KEYS = ("start", "end", "stride")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_position(position: Any) -> str | dict[str, int | None]:
    """The position as asked: one of POSITIONS, or a range as {"start", "end", "stride"} (end None: to the end)."""
    if isinstance(position, BaseModel):
        position = position.model_dump()
    if isinstance(position, str) and position in POSITIONS:
        return position
    if not isinstance(position, Mapping):
        raise HiddenStatesRequestError(
            f"hidden_states_position must be {', '.join(map(repr, POSITIONS))}, or a range "
            f'{{"start": int, "end": int, "stride": int}}, not {position!r}',
            "hidden_states_position",
        )
    unknown = sorted(str(k) for k in position if k not in _POSITION_KEYS)
    if unknown:
        raise HiddenStatesRequestError(
            f"a hidden_states_position range takes start, end and stride only, not {unknown}", "hidden_states_position"
        )
    start, end, stride = position.get("start"), position.get("end"), position.get("stride", 1)
    if not _is_int(start):
        raise HiddenStatesRequestError(
            "hidden_states_position.start must be an integer (an absolute position in prompt+completion; "
            "negative counts from the end, -1 = the final token)",
            "hidden_states_position",
        )
    if end is not None and not _is_int(end):
        raise HiddenStatesRequestError(
            "hidden_states_position.end must be an integer (exclusive; negative counts from the end) or absent "
            "(to the end)",
            "hidden_states_position",
        )
    if not _is_int(stride) or stride < 1:
        raise HiddenStatesRequestError(
            "hidden_states_position.stride must be a positive integer", "hidden_states_position"
        )
    if end is not None and (start < 0) == (end < 0) and end <= start:
        raise HiddenStatesRequestError(
            f"hidden_states_position selects no position: end ({end}) must come after start ({start})",
            "hidden_states_position",
        )
    return {"start": start, "end": end, "stride": stride}


def check_proof(proof: Any) -> ProofRequest | None:
    """`hidden_states_proof` as asked (None: no proofs), or a 400 naming what is wrong."""
    if proof is None:
        return None
    if isinstance(proof, ProofRequest):
        spec = proof
    else:
        if not isinstance(proof, Mapping):
            raise HiddenStatesRequestError(
                'hidden_states_proof must be an object, e.g. {"scheme": "toploc", "topk": 128, '
                f'"decode_batching_size": 32}}, not {proof!r}',
                "hidden_states_proof",
            )
        try:
            spec = ProofRequest.model_validate(proof)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ()))
            raise HiddenStatesRequestError(
                f"hidden_states_proof.{where}: {err.get('msg')}", "hidden_states_proof"
            ) from None
    return spec


def check_heads(heads: Any) -> list[HeadAsk] | None:
    """`hidden_states_heads` as asked: a non-empty list of names or {name, topk}, each head once."""
    if heads is None:
        return None
    bad = HiddenStatesRequestError(
        'hidden_states_heads must be a non-empty list of head names or {"name": ..., "topk": k} objects, '
        f"not {heads!r}",
        "hidden_states_heads",
    )
    if not isinstance(heads, list) or not heads:
        raise bad
    out = []
    for h in heads:
        if isinstance(h, HeadAsk):
            out.append(h)
        elif isinstance(h, str) and h:
            out.append(HeadAsk(name=h))
        elif isinstance(h, Mapping):
            if unknown := sorted(str(k) for k in h if k not in ("name", "topk")):
                raise HiddenStatesRequestError(
                    f"a hidden_states_heads item takes name and topk only, not {unknown}", "hidden_states_heads"
                )
            name, topk = h.get("name"), h.get("topk")
            if not isinstance(name, str) or not name:
                raise bad
            if topk is not None and (not _is_int(topk) or topk < 1):
                raise HiddenStatesRequestError(
                    f"hidden_states_heads[{name!r}].topk must be a positive integer, not {topk!r}",
                    "hidden_states_heads",
                )
            out.append(HeadAsk(name=name, topk=topk))
        else:
            raise bad
    names = [h.name for h in out]
    if len(set(names)) != len(names):
        raise HiddenStatesRequestError(f"hidden_states_heads names a head twice: {names}", "hidden_states_heads")
    return out


def _a_list(value: Any, field: str, what: str, most: int, example: str) -> None:
    """A list field's shape: a non-empty list of at most `most` items, or a 400 naming `field`."""
    if not isinstance(value, list) or not value:
        raise HiddenStatesRequestError(
            f"{field} must be a non-empty list of {what}, e.g. {example}, not {value!r}", field
        )
    if len(value) > most:
        raise HiddenStatesRequestError(f"{field} has {len(value)} {what}; at most {most}", field)


def check_steering(entries: Any) -> list[SteeringAsk] | None:
    """`hidden_states_steering` as asked: at most MAX_STEERING_ENTRIES entries, each with one source
    (vector, name, or head + feature), finite numbers; a 400 naming the entry. What needs the model
    (dimension, layer range, names) is checked by the engine (hidden_states/steering.py)."""
    if entries is None:
        return None
    _a_list(
        entries,
        "hidden_states_steering",
        "entries",
        MAX_STEERING_ENTRIES,
        '[{"layer": 6, "vector": <base64 float32>, "scale": 4.0}]',
    )
    out = []
    for i, e in enumerate(entries):
        where = f"hidden_states_steering[{i}]"
        if isinstance(e, SteeringAsk):
            out.append(e)
            continue
        if not isinstance(e, Mapping):
            raise HiddenStatesRequestError(f"{where} must be an object, not {e!r}", "hidden_states_steering")
        _numbers(e.get("when"), f"{where}.when", "hidden_states_steering")
        for key in ("value", "max"):  # numbers, not strings pydantic would coerce
            if e.get(key) is not None and (isinstance(e[key], bool) or not isinstance(e[key], (int, float))):
                raise HiddenStatesRequestError(
                    f"{where}.{key} must be a number, not {e[key]!r}", "hidden_states_steering"
                )
        try:
            ask = SteeringAsk.model_validate(e)
        except ValidationError as err:
            first = err.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise HiddenStatesRequestError(f"{where}.{loc}: {first.get('msg')}", "hidden_states_steering") from None
        sources = [ask.vector is not None, ask.name is not None, ask.head is not None]
        if sum(sources) != 1 or (ask.head is None) != (ask.feature is None):
            raise HiddenStatesRequestError(
                f"{where} needs exactly one of `vector`, `name`, or `head` with `feature`", "hidden_states_steering"
            )
        if not np.isfinite(ask.scale):
            raise HiddenStatesRequestError(f"{where}.scale must be finite, not {ask.scale}", "hidden_states_steering")
        if (
            ask.vector is not None
            and ask.name is None
            and isinstance(ask.vector, list)
            and not np.isfinite(np.asarray(ask.vector, np.float64)).all()
        ):
            raise HiddenStatesRequestError(f"{where}.vector has NaN or infinite entries", "hidden_states_steering")
        if ask.vector is not None and ask.layer is None:
            raise HiddenStatesRequestError(
                f"{where} needs a `layer` (hidden_states_layers' numbering)", "hidden_states_steering"
            )
        for key, op in (("value", "clamp"), ("max", "cap")):
            given = getattr(ask, key)
            if (given is None) == (ask.op == op):
                raise HiddenStatesRequestError(
                    f"{where}.{key}: " + (f"op {op!r} needs `{key}`" if given is None else f"`{key}` is for op {op!r}"),
                    "hidden_states_steering",
                )
            if given is not None and not np.isfinite(given):
                raise HiddenStatesRequestError(f"{where}.{key} must be finite, not {given}", "hidden_states_steering")
        if ask.op == "clamp" and ask.head is None:
            raise HiddenStatesRequestError(
                f"{where}: op 'clamp' sets an SAE feature: it takes `head` and `feature`", "hidden_states_steering"
            )
        if ask.op in ("clamp", "cap") and ask.scale != 1.0:
            raise HiddenStatesRequestError(f"{where}.scale does not apply to op {ask.op!r}", "hidden_states_steering")
        if ask.when is not None:
            _condition(ask.when, ConditionAsk, f"{where}.when", "hidden_states_steering")
            if ask.positions != "completion":
                raise HiddenStatesRequestError(
                    f'{where}.when needs positions "completion": a conditional entry is decided at each generated '
                    "position from the row before it, which the step before computed (a prompt's rows are computed "
                    "together, in one prefill)",
                    "hidden_states_steering",
                )
        out.append(ask)
    return out


def check_stop(conditions: Any) -> list[StopAsk] | None:
    """`hidden_states_stop` as asked: at most MAX_STOP_CONDITIONS conditions, each a head, one of
    `feature`/`label` and one finite threshold (`above` or `below`); a 400 naming the condition. The
    head, feature and label are checked against the registered heads by `resolve_stop`."""
    if conditions is None:
        return None
    _a_list(
        conditions,
        "hidden_states_stop",
        "conditions",
        MAX_STOP_CONDITIONS,
        '[{"head": "probe", "label": "toxic", "above": 0.9}]',
    )
    return [_condition(c, StopAsk, f"hidden_states_stop[{i}]", "hidden_states_stop") for i, c in enumerate(conditions)]


def _numbers(c: Any, where: str, field: str) -> None:
    """A condition's thresholds are numbers, not strings or bools pydantic would coerce."""
    if isinstance(c, Mapping):
        for key in ("above", "below"):
            if key in c and c[key] is not None and (isinstance(c[key], bool) or not isinstance(c[key], (int, float))):
                raise HiddenStatesRequestError(f"{where}.{key} must be a number, not {c[key]!r}", field)


def _condition(c: Any, cls: type, where: str, field: str) -> Any:
    """A condition (`cls`: StopAsk or ConditionAsk) as asked, checked: one of `feature`/`label`, one finite
    threshold; a 400 naming `where` in `field`."""
    if isinstance(c, cls):
        ask = c
    else:
        if not isinstance(c, Mapping):
            raise HiddenStatesRequestError(f"{where} must be an object, not {c!r}", field)
        _numbers(c, where, field)
        try:
            ask = cls.model_validate(c)
        except ValidationError as err:
            first = err.errors()[0]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise HiddenStatesRequestError(f"{where}.{loc}: {first.get('msg')}", field) from None
    if (ask.feature is None) == (ask.label is None):
        raise HiddenStatesRequestError(f"{where} needs exactly one of `feature` (an index) or `label`", field)
    if (ask.above is None) == (ask.below is None):
        raise HiddenStatesRequestError(f"{where} needs exactly one threshold: `above` or `below`", field)
    threshold = ask.above if ask.above is not None else ask.below
    if not np.isfinite(threshold):
        raise HiddenStatesRequestError(f"{where}: the threshold must be finite, not {threshold}", field)
    return ask


def resolve_stop(spec: HiddenStatesFields, heads: Mapping[str, Any]) -> tuple[list, list[dict]]:
    """The stop conditions against the registered heads (heads.HeadSpec by name): (protocol.Monitor
    per condition, what hidden_states_meta.stop says of each); a 400 naming the condition for an
    unknown head, a feature beyond the head's outputs, or an unknown label."""
    monitors, echo = [], []
    for i, ask in enumerate(spec.hidden_states_stop or ()):
        monitor, e = resolve_condition(ask, heads, f"hidden_states_stop[{i}]", "hidden_states_stop")
        monitors.append(monitor)
        echo.append(e)
    return monitors, echo


def resolve_condition(ask: ConditionAsk, heads: Mapping[str, Any], where: str, field: str) -> tuple[Any, dict]:
    """A condition against the registered heads: (protocol.Monitor, what the meta says of it); a 400 naming
    `where` in `field` for an unknown head, a feature beyond its outputs, an unknown or ambiguous label."""
    from hidden_states.protocol import Monitor

    head = heads.get(ask.head)
    if head is None:
        have = ", ".join(sorted(heads)) or "none"
        raise HiddenStatesRequestError(
            f"{where}: unknown head {ask.head!r}; this server's heads are {have} (GET /v1/models lists them)", field
        )
    if ask.label is not None:
        names = head.labels if head.kind == "linear" else [head.descriptions.get(f) for f in range(head.width)]
        found = [f for f, name in enumerate(names) if name == ask.label]
        if len(found) != 1:
            known = (
                f"its labels are {', '.join(head.labels)}"
                if head.kind == "linear" and head.labels
                else "it has no label names"
                if head.kind == "linear"
                else "labels are its features' descriptions (docs/heads.md, feature labels)"
            )
            raise HiddenStatesRequestError(
                f"{where}: head {ask.head!r} has {'no' if not found else 'several'} output labelled "
                f"{ask.label!r} ({known}); or give `feature`, an index",
                field,
            )
        index = found[0]
    else:
        index = ask.feature
        if index >= head.width:
            what = "features" if head.kind == "sae" else "outputs"
            raise HiddenStatesRequestError(
                f"{where}: feature {index} is beyond the {head.width} {what} of head {ask.head!r}", field
            )
    above = ask.above is not None
    threshold = float(ask.above if above else ask.below)
    e = {"head": ask.head, "feature": int(index), "above" if above else "below": threshold}
    if ask.label is not None:
        e["label"] = ask.label
    return Monitor(ask.head, int(index), above, threshold), e


def resolve_heads(spec: HiddenStatesFields, heads: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
    """The asked heads against the registered ones (heads.HeadSpec by name): (name, k) with k an SAE's
    features per position (its default where not asked) and 0 for a linear head; a 400 naming an
    unknown head and listing this server's."""
    out = []
    for name, topk in spec.heads:
        head = heads.get(name)
        if head is None:
            have = ", ".join(sorted(heads)) or "none"
            raise HiddenStatesRequestError(
                f"unknown head {name!r}: this server's heads are {have} (GET /v1/models lists them)",
                "hidden_states_heads",
            )
        if head.kind != "sae":
            if topk is not None:
                raise HiddenStatesRequestError(
                    f"head {name!r} is a linear head: topk applies to SAE heads only", "hidden_states_heads"
                )
            out.append((name, 0))
            continue
        k = topk or head.topk
        if k > head.width:
            raise HiddenStatesRequestError(
                f"hidden_states_heads[{name!r}].topk {k} exceeds the SAE's {head.width} features", "hidden_states_heads"
            )
        out.append((name, k))
    return tuple(out)


def check_dtype(dtype: Any) -> str:
    if dtype not in DTYPES:
        raise HiddenStatesRequestError(
            f"hidden_states_dtype must be {_one_of(DTYPES)}, not {dtype!r}", "hidden_states_dtype"
        )
    return dtype


def check_pool(pool: Any) -> str | None:
    if pool is not None and pool not in POOLS:
        raise HiddenStatesRequestError(
            f"hidden_states_pool must be {_one_of(POOLS)}, not {pool!r}", "hidden_states_pool"
        )
    return pool


def check_topk(topk: Any) -> int | None:
    """None (every entry), or a positive k (check_model: at most the hidden size)."""
    if topk is None:
        return None
    if not _is_int(topk) or topk < 1:
        raise HiddenStatesRequestError(
            f"hidden_states_topk must be a positive integer, not {topk!r}", "hidden_states_topk"
        )
    return topk


def rows_bytes(count: int, layers: int, hidden_size: int, dtype: str, topk: int | None) -> int:
    """The payload of `count` positions x `layers`: dense rows, or top-k values + int32 indices."""
    width = hidden_size * ITEMSIZE[dtype] if topk is None else topk * (ITEMSIZE[dtype] + TOPK_INDEX_BYTES)
    return count * layers * width


def check_rows_budget(
    span: Span,
    prompt_len: int,
    max_tokens: int | None,
    choices: int,
    layers: int,
    hidden_size: int,
    dtype: str,
    topk: int | None,
    limit: int,
) -> None:
    """The 400 for a request whose worst case (prompt + max_tokens tokens) exceeds `limit` bytes;
    max_tokens None: `prompt_len` given tokens, no generation (POST /v1/hidden_states)."""
    count = len(span.positions(prompt_len + (max_tokens or 0)))
    worst = choices * rows_bytes(count, layers, hidden_size, dtype, topk)
    if worst > limit:
        what = (
            f"{hidden_size} x {ITEMSIZE[dtype]} bytes"
            if topk is None
            else f"top-{topk} x {ITEMSIZE[dtype] + TOPK_INDEX_BYTES} bytes"
        )
        given = max_tokens is None
        of = f"{prompt_len} given tokens" if given else f"a prompt of {prompt_len} tokens + max_tokens {max_tokens}"
        raise HiddenStatesRequestError(
            f"hidden states of {'' if given else 'up to '}{count} positions x {layers} layer(s) x {what} x "
            f"{choices} choice(s) = {worst} bytes ({of}) exceed this server's max_hidden_states_bytes ({limit}): "
            "ask for fewer positions (a range, a stride), fewer layers, hidden_states_dtype float16/bfloat16"
            + (" or hidden_states_topk" if given else ", hidden_states_topk, or a smaller max_tokens"),
            "hidden_states_position",
        )


def given_span(position: str | Mapping[str, Any], total: int, completion_start: int | None) -> Span:
    """POST /v1/hidden_states: the span of `position` on `total` given tokens (completion from
    `completion_start`); a 400 if it selects nothing."""
    if position == "completion" and completion_start is None:
        raise HiddenStatesRequestError(
            'hidden_states_position "completion" selects the tokens of `completion`: send `messages` with a '
            "`completion` (or ask for a range of positions)",
            "hidden_states_position",
        )
    span = Span.of(position, total if completion_start is None else completion_start)
    if not span.positions(total):
        raise HiddenStatesRequestError(
            f"hidden_states_position {position!r} selects no position of the {total} given tokens",
            "hidden_states_position",
        )
    return span


def room_for_completion(prompt_tokens: int, max_model_len: int) -> int:
    """The most completion tokens with hidden states: the final token needs one more position, so
    prompt+completion stays below max_model_len. Below 1: no room."""
    return max_model_len - 1 - prompt_tokens


def check_n(n: Any, max_n: int) -> None:
    """`n` (choices per prompt): an integer from 1 to the server's max_n."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n):
        raise HiddenStatesRequestError(f"n must be an integer from 1 to {max_n}", "n")


def check_room(num_tokens: int, max_model_len: int, param: str, completing: bool) -> None:
    """Raises the 400 for `num_tokens` that leave no room for the vector's position."""
    if completing and room_for_completion(num_tokens, max_model_len) < 1:
        raise HiddenStatesRequestError(
            f"a prompt of {num_tokens} tokens leaves no room for a completion with hidden states: prompt + "
            f"completion must stay below max_model_len ({max_model_len}), since the final token needs one "
            "more position",
            param,
        )
    if not completing and num_tokens >= max_model_len:
        raise HiddenStatesRequestError(
            f"{num_tokens} tokens leave no room: the extraction needs them below max_model_len ({max_model_len})", param
        )


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The layers, deduplicated in order, if the model has them (0..L, or -(L+1)..-1)."""
    layers = tuple(dict.fromkeys(int(layer) for layer in layers))
    if not layers:
        raise HiddenStatesRequestError("hidden_states_layers must name at least one layer", "hidden_states_layers")
    L = num_layers
    bad = [layer for layer in layers if not -(L + 1) <= layer <= L]
    if bad:
        raise HiddenStatesRequestError(
            f"hidden_states_layers {bad} out of range: this model has layers 0..{L} "
            f"(0 = embeddings, {L} = after the final norm; negative counts from the end, -1 = {L})",
            "hidden_states_layers",
        )
    return layers


def check_model(spec: VectorFields, num_layers: int, hidden_size: int) -> tuple[int, ...]:
    """The spec's rules that need the model (top-k within hidden size, layers in range); returns the
    layers, deduplicated."""
    layers, _, _, topk = spec.capture()
    if (proof := getattr(spec, "hidden_states_proof", None)) is not None:
        check_proof_width(proof, hidden_size)
    elif topk is not None and topk > hidden_size:
        raise HiddenStatesRequestError(
            f"hidden_states_topk {topk} exceeds the model's hidden size ({hidden_size})", "hidden_states_topk"
        )
    return check_layers(layers, num_layers)


def spec_of(
    return_hidden_states: bool = True,
    layers: Sequence[int] | None = None,
    position: Any = "completion_end",
    dtype: str = "float32",
    topk: int | None = None,
    proof: Any = None,
    heads: Any = None,
    steering: Any = None,
    stop_conditions: Any = None,
    *,
    enabled: bool,
) -> HiddenStatesFields:
    """A Python caller's keyword arguments as a spec (parse_fields: the same rules as a request's fields)."""
    if isinstance(position, BaseModel):
        position = position.model_dump()
    if isinstance(proof, BaseModel):
        proof = proof.model_dump()
    return parse_fields(
        {
            "return_hidden_states": return_hidden_states and proof is None,
            "hidden_states_layers": None if layers is None else list(layers),
            "hidden_states_position": position,
            "hidden_states_dtype": dtype,
            "hidden_states_topk": topk,
            "hidden_states_proof": proof,
            "hidden_states_heads": None if heads is None else list(heads),
            "hidden_states_steering": None if steering is None else list(steering),
            "hidden_states_stop": None if stop_conditions is None else list(stop_conditions),
        },
        enabled=enabled,
    )


def check_proof_width(proof: ProofRequest, hidden_size: int) -> None:
    if proof.topk > hidden_size:
        raise HiddenStatesRequestError(
            f"hidden_states_proof.topk {proof.topk} exceeds the model's hidden size "
            f"({hidden_size}): the engine sends each row's top-k",
            "hidden_states_proof",
        )


def request_error(e: ValidationError) -> HiddenStatesRequestError | None:
    """The rule of ours a schema's validation failed on (its message and field), or None: pydantic's own."""
    for err in e.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, HiddenStatesRequestError):
            return cause
    return None

"""Messages between the API/router process and the instance processes, over ZeroMQ.

Each message is a frozen ``msgspec`` Struct, declared once: its field types are the wire's checks
(token ids are int64 ``>= 0``, times finite, counts ``>= 0``), so :func:`encode` and :func:`decode`
are msgspec's compiled codec for compact msgpack (a kind tag, then the fields in declaration
order; an instance's reports end with its id ``inst`` and incarnation ``gen``). Code outside this
module reads and builds the Structs only. What a type cannot say is checked in the Struct's
``__post_init__`` (across fields) or, for the vocabulary bound known only to the receiver, right
after decoding. :func:`decode` raises :class:`InvalidMessage` (a ``ValueError``) naming the first
bad field from the top of the message, e.g. ``'request.prompt'`` or ``'samples[1].token'``.

Router -> instance:

- :class:`Add`      a new request for a prefill (or colocated) instance: its :class:`RequestDesc`;
  with ``sampling.n`` > 1 also ``kids``, the request ids of samples 1..n-1 (sample 0 keeps the rid)
- :class:`Transfer` a prefilled request for a decode instance: its :class:`RequestDesc`, ``out``
  (tokens so far), ``computed`` (KV tokens), ``t_first`` (first-token time), ``kv`` (a transport
  descriptor) and ``info`` (its prefill's :class:`StartInfo`); for an n-sample request ``samples``,
  the :class:`SampleStart` of each sample still wanted, which all start from the one prompt KV
- :class:`Abort`    ``rids``: drop these requests wherever they are on the instance and free their KV
- :class:`Lane`     ``lane``: the length lane a pool router (``laps-pools``) gave this instance
- :class:`Stop`     shut down

Instance -> router (each a :class:`Report`, carrying ``inst`` and ``gen``):

- :class:`Ready`     the model is loaded; ``info`` (:class:`InstanceInfo`) = limits the API validates against
- :class:`Tokens`    one :class:`TokenItem` per request with news (one message per engine step, so
  one per batch rather than one per token)
- :class:`Handoff`   a prefill finished: ``rid``, ``out``, ``computed``, ``kv``, ``t_first``, ``logprobs``,
  ``info``; for an n-sample request also ``samples`` (a :class:`SampleFirst` per sample)
- :class:`Stats`     load figures for routers, metrics and admission control (``added`` = ADDs and
  transfers received, so the router can add what it sent after the snapshot); ``kv_events`` = the
  prefix cache's block names added and dropped since the last stats (``core/prefix_summary.py``)
- :class:`Failed`    ``rids`` failed on the instance; ``message`` says why
- :class:`Fatal`     the instance could not start; ``message`` says why
- :class:`Heartbeat` "alive", from a thread of its own, whatever the engine is doing

A request crosses the wire as a :class:`RequestDesc` (a short-keyed map: prompt ids,
:class:`SamplingParams` as ``sp``, arrival, :class:`WireSLO` as ``{"ttft", "tpot"}``, SLO class,
priority; in its ``add`` and again in its ``transfer``), checked where it is decoded (by the
field types; :class:`SamplingParams` also checks itself there) and nowhere else on the way: the
SLO, checked at the API edge, is carried into the receiver's :class:`SLO` unchecked; the router and the
instances build their :class:`Request` from it with :meth:`RequestDesc.request`, the one place one
is built from a description.

Times are seconds on one epoch shared by all processes (:class:`EpochClock`): ``perf_counter``
is CLOCK_MONOTONIC on Linux, one clock for every process of the machine.
"""

from __future__ import annotations

import re
import sys
import time
import typing
from typing import Annotated, Any, ClassVar, Union

import msgspec
from msgspec import Meta, Struct, field
from msgspec.structs import replace

from laneserve.core.request import Request
from laneserve.core.sampling import INT64_MAX, INT64_MIN, SamplingParams
from laneserve.core.slo import SLO
from laneserve.policies.routing import DecodeSummary

# ---- the wire's value types: a field's type is its check ---------------------------------------------
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
TokenId = Count
Real = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]     # finite (NaN fails both)
Prompt = Annotated[list[TokenId], Meta(min_length=1)]
Target = Annotated[float, Meta(gt=0)]                                            # an SLO target, seconds


class EpochClock:
    """Wall time in seconds since a shared ``epoch`` (a ``time.perf_counter()`` value)."""

    __slots__ = ("epoch",)

    def __init__(self, epoch: float | None = None) -> None:
        self.epoch = time.perf_counter() if epoch is None else epoch

    def now(self) -> float:
        return time.perf_counter() - self.epoch


class InvalidMessage(ValueError):
    """A message that does not decode. ``kind``: its tag, when that was readable; ``rids``: the
    requests it names, as far as they could be read (so an instance can fail them); ``kv``: the KV
    descriptor it carried (to discard), if any."""

    def __init__(self, message: str, kind: str | None = None, rids: tuple[int, ...] = (), kv: Any = None) -> None:
        super().__init__(message)
        self.kind, self.rids, self.kv = kind, rids, kv


class FieldError(ValueError):
    """A bad field a type cannot express (checks across fields, the vocabulary): ``path`` names it
    relative to the record that raised it."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(reason)
        self.reason, self.path = reason, path

    def __str__(self) -> str:
        return f"'{self.path}' {self.reason}" if self.path else self.reason


# ---- sampling parameters -------------------------------------------------------------------------
def sampling_to_dict(p: SamplingParams) -> dict[str, Any]:
    """``p`` as the ``sp`` map of a request on the wire."""
    return msgspec.to_builtins(p)


def sampling_from_dict(d: Any) -> SamplingParams:
    """The :class:`SamplingParams` of an ``sp`` map; ``ValueError`` on any bad field (its type
    checked by the codec, its range by ``SamplingParams`` itself)."""
    try:
        return msgspec.convert(d, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"sampling parameters: {exc}") from None


# ---- SLO targets -----------------------------------------------------------------------------------
class WireSLO(Struct, frozen=True, gc=False):
    """A request's SLO on the wire, ``{"ttft", "tpot"}``: each target ``None`` or a number > 0
    (seconds), checked by the decoder, so the receiver builds its :class:`SLO` with
    :meth:`SLO.trusted` instead of checking it again."""

    ttft: Target | None = None
    tpot: Target | None = None

    @classmethod
    def of(cls, slo: SLO) -> WireSLO:
        return cls(slo.ttft, slo.tpot)

    def to_slo(self) -> SLO:
        return SLO.trusted(self.ttft, self.tpot)


# ---- records ---------------------------------------------------------------------------------------
class _Record(Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    """A Struct sent as a list of its fields in declaration order."""


class StartInfo(_Record):
    """How a request's prefill went, for the router (policies) and the API (queue time, cached
    tokens, prompt logprobs): sent with its first tokens and with its hand-off."""

    prefill_start: Real | None = None
    prefill_end: Real | None = None
    preemptions: Count = 0
    cached: Count = 0
    prompt_logprobs: list | None = None       # vLLM's prompt_logprobs, when asked for

    def event(self) -> dict[str, Any]:
        """The map the API reads from a request's events (``server/api.py``)."""
        return {"prefill_start": self.prefill_start, "preemptions": self.preemptions, "cached": self.cached,
                "plp": self.prompt_logprobs}


class RequestDesc(Struct, frozen=True, forbid_unknown_fields=False):
    """One request as it crosses the wire: what an instance needs to build its :class:`Request`.
    Sent as a short-keyed map, the SLO as a :class:`WireSLO` (its field types are its checks; the
    sampling parameters check themselves as they decode). ``prompt`` is shared with the requests built from it, not copied."""

    rid: Int64
    prompt: Prompt
    sampling: SamplingParams = field(name="sp")
    arrival: Real = field()
    slo: WireSLO = field(default_factory=WireSLO)
    slo_class: str = field(default="default", name="cls")
    priority: Int64 = field(default=0, name="prio")

    @classmethod
    def describe(cls, req: Request) -> RequestDesc:
        return cls(req.request_id, req.prompt_token_ids, req.sampling, req.arrival_time, WireSLO.of(req.slo),
                   req.slo_class, req.priority)

    def request(self, *, rid: int | None = None, sampling: SamplingParams | None = None,
                out: list[int] | tuple[int, ...] = (), computed: int = 0, t_first: float | None = None,
                info: StartInfo | None = None) -> Request:
        """The :class:`Request` this describes (the one place one is built from the wire); for a
        transfer, prefilled elsewhere: ``out`` tokens so far, ``computed`` KV tokens, its first
        token at ``t_first`` and its prefill's times in ``info``. ``rid`` and ``sampling`` replace
        the description's (a sample of an n-sample request)."""
        sampling = self.sampling if sampling is None else sampling
        req = Request(request_id=self.rid if rid is None else rid, arrival_time=self.arrival,
                      prompt_len=len(self.prompt), max_output_tokens=sampling.max_tokens, slo=self.slo.to_slo(),
                      slo_class=self.slo_class, priority=self.priority, prompt_token_ids=self.prompt,
                      sampling=sampling)
        if out:
            req.output_token_ids = list(out)
            req.num_output_tokens = len(out)
            req.num_computed_tokens = computed
            t = req.times
            if info is not None:
                t.prefill_start, t.prefill_end = info.prefill_start, info.prefill_end
            t.first_token = t.last_token = t_first
        return req

    def check_vocab(self, vocab: int) -> None:
        """Token ids past the embedding table are a bad request (FieldError naming the field)."""
        _check_ids(self.prompt, vocab, "prompt")
        if any(t >= vocab for t, _ in self.sampling.logit_bias):
            raise FieldError(_outside(vocab), "sp.logit_bias")


class SampleStart(_Record):
    """A sample of an n-sample request going to a decode instance: its request id, its index
    (its seed) and its first token."""

    rid: Int64
    index: Count
    token: TokenId


class SampleFirst(_Record):
    """A sample's first token as its prefill instance sampled it; ``finish`` set if that ended it."""

    rid: Int64
    index: Count
    token: TokenId
    finish: str | None = None
    logprobs: Any = None


class TokenItem(Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """A request's new tokens: ``finish`` reason when it ended, ``logprobs`` when asked for
    (``[[logprob, [[id, logprob], ...]], ...]``), ``info`` with its first tokens and at its end.
    Not frozen, unlike the other records: there is one per request and step."""

    rid: Int64
    tokens: list[TokenId]
    finish: str | None = None
    logprobs: Any = None
    info: StartInfo | None = None


class InstanceInfo(_Record):
    """An instance's limits and identity, sent once it is ready."""

    max_model_len: Count
    kv_blocks: Count
    block_size: Count
    vocab_size: Count
    pid: Count
    policy: str
    role: str
    device: str
    prefix_caching: bool = False
    prefix_root: Any = None                    # the prefix hash chain's root (core/prefix_summary.py)
    stub: bool = False
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=4096)] = 1   # ranks (engine/tp); rank 0 is ``pid``
    rank_pids: list[Count] | None = None       # the processes of ranks 1..N-1 (a list; None: one rank)


# ---- messages ---------------------------------------------------------------------------------------
class _Message(_Record):
    """A message: a record whose first wire element is its kind tag (``tag``)."""

    tag: ClassVar[str]


class Report(_Message, kw_only=True):
    """A message from an instance: ``inst`` its id, ``gen`` its incarnation (filled in by the
    sender, :meth:`sent_by`; last on the wire)."""

    inst: Int64 = -1
    gen: Int64 = 0

    def sent_by(self, inst: int, gen: int) -> Report:
        return replace(self, inst=inst, gen=gen)


class Add(_Message, tag="add"):
    request: RequestDesc
    kids: tuple[Int64, ...] = ()

    def __post_init__(self) -> None:
        n = self.request.sampling.n
        if (n > 1 or self.kids) and len(self.kids) != n - 1:
            raise FieldError(f"must list n - 1 request ids ({n - 1}), got {len(self.kids)}", "kids")


class Transfer(_Message, tag="transfer"):
    request: RequestDesc
    out: list[TokenId]
    computed: Count
    t_first: Real
    kv: Any = None
    info: StartInfo | None = None
    samples: tuple[SampleStart, ...] | None = None

    def __post_init__(self) -> None:
        most = len(self.request.prompt) + max(len(self.out), 1)
        if self.computed > most:
            raise FieldError(f"must be an integer in [0, {most}], got {self.computed}", "computed")
        if self.samples is not None and not self.samples:
            raise FieldError("must list at least one sample", "samples")

    def requests(self) -> list[Request]:
        """The request (or each sample still wanted), prefilled up to here."""
        d = self.request
        if self.samples is None:
            return [d.request(out=self.out, computed=self.computed, t_first=self.t_first, info=self.info)]
        return [d.request(rid=s.rid, sampling=d.sampling.sample(s.index), out=(s.token,), computed=self.computed,
                          t_first=self.t_first, info=self.info) for s in self.samples]


class Abort(_Message, tag="abort"):
    rids: tuple[Int64, ...]


class Lane(_Message, tag="lane"):
    lane: str


class Stop(_Message, tag="stop"):
    pass


class Ready(Report, tag="ready"):
    info: InstanceInfo


class Tokens(Report, tag="tok"):
    items: tuple[TokenItem, ...]


class Handoff(Report, tag="handoff"):
    rid: Int64
    out: list[TokenId]
    computed: Count
    kv: Any
    t_first: Real
    logprobs: Any = None
    info: StartInfo = field(default_factory=StartInfo)
    samples: tuple[SampleFirst, ...] | None = None


class Stats(Report, tag="stats"):
    added: Count = 0                     # ADDs and transfers received
    waiting: Count = 0
    running: Count = 0
    queued_tokens: Count = 0
    kv_usage: Real = 0.0
    kv_free: Count = 0
    kv_total: Count = 0
    host_free: Count | None = None
    host_total: Count | None = None
    preemptions: Count = 0
    prefix_queries: Count | None = None          # None: no prefix cache figures (the stub)
    prefix_hits: Count | None = None
    steps: Count = 0
    busy: Real = 0.0
    live: Count = 0
    incoming: Count = 0
    kv_held: Count = 0
    kv_events: list = field(default_factory=list)
    kv_forks: Count = 0
    decode: DecodeSummary | None = None          # decode: its next step
    #: decode: its last pure decode step (requests, context sum, longest context, seconds) + its number
    last_decode: tuple[Count, Count, Count, Real, Count] | None = None


class Failed(Report, tag="err"):
    rids: tuple[Int64, ...]
    message: str


class Fatal(Report, tag="fatal"):
    message: str


class Heartbeat(Report, tag="hb"):
    pass


_KINDS: dict[str, type] = {}
for _cls in (Add, Transfer, Abort, Lane, Stop, Ready, Tokens, Handoff, Stats, Failed, Fatal, Heartbeat):
    _cls.tag = _cls.__struct_config__.tag
    _KINDS[_cls.tag] = _cls
Message = Union[Add, Transfer, Abort, Lane, Stop, Ready, Tokens, Handoff, Stats, Failed, Fatal, Heartbeat]  # noqa: UP007


def _outside(vocab: int) -> str:
    return f"holds a token id outside the vocabulary [0, {vocab})"


def _check_ids(ids: list[int], vocab: int, path: str) -> None:
    if ids and max(ids) >= vocab:
        raise FieldError(_outside(vocab), path)


def _check_vocab(msg: Message, vocab: int) -> None:
    """The token ids of ``msg`` against the receiver's vocabulary (FieldError naming the field)."""
    if isinstance(msg, (Add, Transfer)):
        try:
            msg.request.check_vocab(vocab)
        except FieldError as exc:
            raise FieldError(exc.reason, f"request.{exc.path}") from None
    if isinstance(msg, (Transfer, Handoff)):
        _check_ids(msg.out, vocab, "out")
    if isinstance(msg, Transfer) and msg.samples:
        for i, s in enumerate(msg.samples):
            _check_ids([s.token], vocab, f"samples[{i}].token")
    if isinstance(msg, Tokens):
        for i, item in enumerate(msg.items):
            _check_ids(item.tokens, vocab, f"items[{i}].tokens")


# ---- the codec -------------------------------------------------------------------------------------
def _builtin(obj: Any) -> Any:
    """A value msgspec does not encode itself: a numpy scalar (``numpy.float64`` from a figure
    computed with numpy) as the Python number it holds."""
    item = getattr(obj, "item", None)
    if item is None:
        raise NotImplementedError(f"cannot encode a {type(obj).__name__}")
    return item()


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_builtin)
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """``msg`` as msgpack: ``[tag, field, ...]`` (a report's ``inst`` and ``gen`` last)."""
    return _ENCODER.encode(msg)


def decode(data: bytes, *, vocab_size: int | None = None) -> Message:
    """The message ``data`` encodes; :class:`InvalidMessage` naming the bad field otherwise.
    ``vocab_size``, when given, bounds the token ids of requests (an out-of-range id would index
    past the embedding table)."""
    try:
        msg = _DECODER.decode(data)
        if vocab_size is not None:
            _check_vocab(msg, vocab_size)
        return msg
    except msgspec.ValidationError as exc:
        raw = msgspec.msgpack.decode(data)
        kind = raw[0] if type(raw) is list and raw and raw[0] in _KINDS else None
        if kind is None:
            raise InvalidMessage(f"not a message: {_show(raw)}") from None
        raise InvalidMessage(_explain(_KINDS[kind], exc), kind, *_named(raw)) from None
    except FieldError as exc:
        raw = msgspec.msgpack.decode(data)
        raise InvalidMessage(str(exc), raw[0], *_named(raw)) from None
    except msgspec.DecodeError as exc:
        raise InvalidMessage(f"not a msgpack message: {exc}") from None


# ---- errors named by field -------------------------------------------------------------------------
_AT = re.compile(r" - at `\$([^`]*)`$")
_STEP = re.compile(r"\[(\d+)\]|\.([^.\[]+)")
_SHORT = re.compile(r"^Expected `array` of at least length \d+, got (\d+)$")
_NOT_POSITIVE = re.compile(r"^Expected `float` > 0\.0$")
_NOT_FINITE = re.compile(r"^Expected `float` [<>]= -?" + re.escape(repr(sys.float_info.max)) + "$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")


def _explain(cls: type, exc: msgspec.ValidationError) -> str:
    """msgspec's error as ``'<field path>' <reason>``: the positions of the array-like records in
    its path (``$[1][7][1]``) turned into their field names (``request.samples[1]``)."""
    reason, steps = str(exc), []
    m = _AT.search(reason)
    if m:
        reason = reason[:m.start()]
        steps = [int(i) if i else key for i, key in _STEP.findall(m.group(1))]
    if _NOT_FINITE.match(reason):
        reason = "must be a finite number"
    elif _NOT_POSITIVE.match(reason):
        reason = "must be a number > 0"
    names, typ = [], cls
    for step in steps:
        name, typ = _step(typ, step)
        names.append(name)
    tail = None
    if (short := _SHORT.match(reason)) and _record(typ):
        tail, reason = _field_at(typ, int(short.group(1))), "is missing"
    elif missing := _MISSING.match(reason):
        tail, reason = missing.group(1), "is missing"
    elif isinstance(exc.__cause__, FieldError):
        tail, reason = exc.__cause__.path or None, exc.__cause__.reason
    elif _record(typ) or hasattr(typ, "__dataclass_fields__"):
        words = reason.split()         # a dataclass's own check names the field first ("SLO ttft must ...")
        words = words[1:] if words and words[0] == typ.__name__ else words
        if words and words[0] in _fields(typ):
            tail = words[0]
    if tail:
        names.append(tail)
    path = "".join(n if n.startswith("[") else f".{n}" for n in names).lstrip(".")
    return f"'{path}' {reason}" if path else f"a '{cls.tag}' message {reason}"


def _record(typ: Any) -> bool:
    return isinstance(typ, type) and issubclass(typ, Struct) and typ.__struct_config__.array_like


def _fields(typ: type) -> tuple[str, ...]:
    if isinstance(typ, type) and issubclass(typ, Struct):
        return tuple(typ.__struct_encode_fields__)
    return tuple(getattr(typ, "__dataclass_fields__", ()))


def _field_at(typ: type, index: int) -> str:
    fields = _fields(typ)
    index -= 1 if typ.__struct_config__.tag is not None else 0     # a message's tag comes first
    return fields[index] if 0 <= index < len(fields) else f"[{index}]"


def _step(typ: Any, step: int | str) -> tuple[str, Any]:
    """The name of ``step`` (an index or a key) into a value of type ``typ``, and its type."""
    typ = _unwrap(typ)
    if isinstance(step, str):
        hints = _hints(typ)
        return step, hints.get(_python_name(typ, step))
    if _record(typ):
        name = _field_at(typ, step)
        return name, _hints(typ).get(name)
    args = [a for a in typing.get_args(typ) if a is not Ellipsis]
    return f"[{step}]", (args[0] if args else None)


def _python_name(typ: Any, key: str) -> str:
    """The attribute a wire key names (``sp`` -> ``sampling``)."""
    if isinstance(typ, type) and issubclass(typ, Struct):
        return dict(zip(typ.__struct_encode_fields__, typ.__struct_fields__)).get(key, key)
    return key


def _hints(typ: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(typ, include_extras=False)
    except Exception:  # noqa: BLE001 - not a class with annotations
        return {}


def _unwrap(typ: Any) -> Any:
    """``X`` of ``X | None`` and of ``Annotated[X, ...]``."""
    while True:
        origin = typing.get_origin(typ)
        if origin is Annotated:
            typ = typing.get_args(typ)[0]
        elif origin is Union or type(typ).__name__ == "UnionType":
            args = [a for a in typing.get_args(typ) if a is not type(None)]
            if len(args) != 1:
                return typ
            typ = args[0]
        else:
            return typ


def _show(v: Any, limit: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


def _named(raw: list) -> tuple[tuple[int, ...], Any]:
    """What a malformed ``add`` or ``transfer`` names (best effort): its request ids and KV."""
    if raw[0] not in ("add", "transfer") or len(raw) < 2 or not isinstance(raw[1], dict):
        return (), None
    kv = raw[5] if raw[0] == "transfer" and len(raw) > 5 else None
    samples = raw[7] if raw[0] == "transfer" and len(raw) > 7 else None
    if isinstance(samples, list):
        rids = tuple(s[0] for s in samples if isinstance(s, list) and s and _is_id(s[0]))
        if rids:
            return rids, kv
    rid = raw[1].get("rid")
    return ((rid,) if _is_id(rid) else ()), kv


def _is_id(v: Any) -> bool:
    return type(v) is int and INT64_MIN <= v <= INT64_MAX

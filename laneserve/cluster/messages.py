"""Messages between the API/router process and the instance processes, over ZeroMQ.

Each message is a frozen dataclass; :func:`encode` and :func:`decode` are the one codec between
them and compact msgpack (a kind tag, then the fields in declaration order; an instance's reports
also carry its id ``inst`` and incarnation ``gen`` after the tag). Code outside this module reads
and builds the dataclasses only. :func:`decode` checks every field and raises
:class:`InvalidMessage` (a ``ValueError``) naming the first bad one, e.g. ``'request.prompt'``.

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

A request crosses the wire as a :class:`RequestDesc` (prompt ids, :class:`SamplingParams`,
arrival, :class:`SLO` as ``{"ttft", "tpot"}``, SLO class, priority; in its ``add`` and again in its
``transfer``), checked where it is decoded and nowhere else on the way; the router and the
instances build their :class:`Request` from it with :meth:`RequestDesc.request`, the one place one
is built from a description.

Times are seconds on one epoch shared by all processes (:class:`EpochClock`): ``perf_counter``
is CLOCK_MONOTONIC on Linux, one clock for every process of the machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, ClassVar

import msgpack

from laneserve.core.request import Request
from laneserve.core.sampling import INT64_MAX, INT64_MIN, SamplingParams, is_real
from laneserve.core.slo import SLO
from laneserve.core.structured import StructuredSpec
from laneserve.policies.routing import DecodeSummary

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
                    "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logit_bias", "min_tokens", "structured", "n", "prompt_logprobs", "min_p",
                    "allowed_token_ids", "bad_words_ids")


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


# ---- sampling parameters -------------------------------------------------------------------------
def sampling_to_dict(p: SamplingParams) -> dict[str, Any]:
    d = {f: getattr(p, f) for f in _SAMPLING_FIELDS}
    d["stop_token_ids"] = list(p.stop_token_ids)
    d["stop"] = list(p.stop)
    d["allowed_token_ids"] = list(p.allowed_token_ids)
    d["bad_words_ids"] = [list(w) for w in p.bad_words_ids]
    d["logit_bias"] = [list(e) for e in p.logit_bias]
    d["structured"] = None if p.structured is None else [p.structured.kind, p.structured.value]
    return d


def sampling_from_dict(d: Any) -> SamplingParams:
    """The :class:`SamplingParams` of a message's ``sp`` map; ``ValueError`` on any bad field."""
    if not isinstance(d, dict):
        raise ValueError(f"sampling parameters must be a map, got {type(d).__name__}")
    fields = {k: v for k, v in d.items() if k in _SAMPLING_FIELDS}
    for name in ("stop_token_ids", "stop", "allowed_token_ids"):
        v = fields.get(name)
        if v is not None and not isinstance(v, (list, tuple)):
            raise ValueError(f"sampling '{name}' must be a list, got {type(v).__name__}")
        fields[name] = tuple(v or ())
    words = fields.get("bad_words_ids")
    if words is not None:
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, (list, tuple)) for w in words):
            raise ValueError("sampling 'bad_words_ids' must be a list of token-id lists")
        fields["bad_words_ids"] = tuple(tuple(w) for w in words)
    bias = fields.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, (list, tuple)) or not all(isinstance(e, (list, tuple)) for e in bias):
            raise ValueError("sampling 'logit_bias' must be a list of [token id, bias] pairs")
        fields["logit_bias"] = tuple(tuple(e) for e in bias)
    spec = fields.get("structured")
    if spec is not None:
        if not isinstance(spec, (list, tuple)) or len(spec) != 2:
            raise ValueError("sampling 'structured' must be a [kind, value] pair")
        fields["structured"] = StructuredSpec(*spec)     # UnsupportedSpec is a ValueError
    try:
        return SamplingParams(**fields)     # SamplingParams checks types, ranges and finiteness
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"sampling parameters: {exc}") from None


# ---- field checks: (value, vocab size or None) -> value, or FieldError -----------------------------
# msgpack decodes to exact types (int, float, str, list, dict, bool, None), so exact type tests suffice
Check = Callable[[Any, "int | None"], Any]


class FieldError(ValueError):
    """A bad field: ``path`` names it from the top of its message (``request.prompt``,
    ``items[2].tokens``), filled in as the error rises through the records that hold it."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(reason)
        self.reason, self.path = reason, path

    def within(self, name: str) -> FieldError:
        """This error, seen from the record that holds the field as ``name``."""
        tail = self.path
        self.path = name + tail if tail.startswith("[") else f"{name}.{tail}" if tail else name
        return self

    def __str__(self) -> str:
        return f"'{self.path}' {self.reason}" if self.path else self.reason


def _int(v: Any, vocab: int | None = None) -> int:
    if type(v) is not int or not INT64_MIN <= v <= INT64_MAX:
        raise FieldError(f"must be an int64, got {_show(v)}")
    return v


def _count(v: Any, vocab: int | None = None) -> int:
    if type(v) is not int or not 0 <= v <= INT64_MAX:
        raise FieldError(f"must be an integer >= 0, got {_show(v)}")
    return v


def _real(v: Any, vocab: int | None = None) -> float:
    if not ((type(v) is float and math.isfinite(v)) or (type(v) is int and is_real(v))):
        raise FieldError(f"must be a finite number, got {_show(v)}")
    return float(v)


def _str(v: Any, vocab: int | None = None) -> str:
    if type(v) is not str:
        raise FieldError(f"must be a string, got {type(v).__name__}")
    return v


def _bool(v: Any, vocab: int | None = None) -> bool:
    if type(v) is not bool:
        raise FieldError(f"must be a boolean, got {_show(v)}")
    return v


def _any(v: Any, vocab: int | None = None) -> Any:
    """An opaque value (a KV descriptor, logprobs, prefix cache events): passed through as is."""
    return v


def _list(v: Any, vocab: int | None = None) -> list | tuple:
    if type(v) is not list and type(v) is not tuple:
        raise FieldError(f"must be a list, got {type(v).__name__}")
    return v


def _map(v: Any) -> dict:
    if type(v) is not dict:
        raise FieldError(f"must be a map, got {type(v).__name__}")
    return v


def _opt(check: Check) -> Check:
    return lambda v, vocab=None: None if v is None else check(v, vocab)


def _seq(check: Check) -> Check:
    def checked(v: Any, vocab: int | None = None) -> tuple:
        out = []
        for i, e in enumerate(_list(v)):
            try:
                out.append(check(e, vocab))
            except FieldError as exc:
                raise exc.within(f"[{i}]") from None
        return tuple(out)
    return checked


_INT = {int}


def _token_ids(v: Any, vocab: int | None = None) -> list[int]:
    if type(v) is not list and type(v) is not tuple:
        raise FieldError(f"must be a list of token ids, got {type(v).__name__}")
    if v and (not set(map(type, v)) <= _INT or min(v) < 0 or max(v) > INT64_MAX):
        raise FieldError("must be a list of token ids")
    if v and vocab is not None and max(v) >= vocab:
        raise FieldError(f"holds a token id outside the vocabulary [0, {vocab})")
    return list(v)


def _token(v: Any, vocab: int | None = None) -> int:
    return _token_ids([v], vocab)[0]


def _field(check: Check, v: Any, name: str, vocab: int | None = None) -> Any:
    """``check(v)``, its error naming ``name``."""
    try:
        return check(v, vocab)
    except FieldError as exc:
        raise exc.within(name) from None


def _show(v: Any, limit: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "..."


# ---- positional records ----------------------------------------------------------------------------
class _Record:
    """A dataclass sent as a list of its fields in declaration order (``_checks``: one per field;
    nested records go as their own lists). A report's ``inst`` and ``gen`` travel in the header."""

    __slots__ = ()
    tag: ClassVar[str]
    _checks: ClassVar[tuple[Check, ...]]

    def to_wire(self) -> list:
        return [_wire(getattr(self, n)) for n in _names(type(self))]

    @classmethod
    def from_wire(cls, v: Any, vocab: int | None = None, **sender: int):
        """The record ``v`` holds (``FieldError`` naming the field relative to it otherwise)."""
        return _from_wire(cls, v, vocab, sender)

    def _check(self) -> None:
        """Checks across fields, after each field's own (``FieldError``)."""


def _from_wire(cls: type, v: Any, vocab: int | None, sender: dict[str, int]):
    names = _names(cls)
    values = _list(v)
    if len(values) < len(names):
        raise FieldError(f"is missing ({len(values)} of {len(names)} fields)", names[len(values)])
    if len(values) > len(names):
        raise FieldError(f"has {len(values)} fields, expected {len(names)}")
    args = []
    for check, x, n in zip(cls._checks, values, names):
        try:
            args.append(check(x, vocab))
        except FieldError as exc:
            raise exc.within(n) from None
    record = cls(*args, **sender)
    record._check()
    return record


@cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.name not in ("inst", "gen"))


def _wire(v: Any) -> Any:
    if isinstance(v, (_Record, RequestDesc, DecodeSummary)):
        return v.to_wire()
    if isinstance(v, tuple):
        return [_wire(e) for e in v]
    return v


# ---- the request -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StartInfo(_Record):
    """How a request's prefill went, for the router (policies) and the API (queue time, cached
    tokens, prompt logprobs): sent with its first tokens and with its hand-off."""

    prefill_start: float | None = None
    prefill_end: float | None = None
    preemptions: int = 0
    cached: int = 0
    prompt_logprobs: list | None = None       # vLLM's prompt_logprobs, when asked for

    _checks = (_opt(_real), _opt(_real), _count, _count, _opt(_list))

    def event(self) -> dict[str, Any]:
        """The map the API reads from a request's events (``server/api.py``)."""
        return {"prefill_start": self.prefill_start, "preemptions": self.preemptions, "cached": self.cached,
                "plp": self.prompt_logprobs}


@dataclass(frozen=True, slots=True)
class RequestDesc:
    """One request as it crosses the wire: what an instance needs to build its :class:`Request`.
    Sent as a short-keyed map, the SLO as ``{"ttft", "tpot"}``; checked by :meth:`from_wire`
    (once, where it is decoded). ``prompt`` is shared with the requests built from it, not copied."""

    rid: int
    prompt: list[int]
    sampling: SamplingParams
    arrival: float
    slo: SLO = SLO()
    slo_class: str = "default"
    priority: int = 0

    @classmethod
    def describe(cls, req: Request) -> RequestDesc:
        return cls(req.request_id, req.prompt_token_ids, req.sampling, req.arrival_time, req.slo,
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
                      prompt_len=len(self.prompt), max_output_tokens=sampling.max_tokens, slo=self.slo,
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

    def to_wire(self) -> dict[str, Any]:
        return {"rid": self.rid, "prompt": self.prompt, "sp": sampling_to_dict(self.sampling),
                "arrival": self.arrival, "slo": {"ttft": self.slo.ttft, "tpot": self.slo.tpot},
                "cls": self.slo_class, "prio": self.priority}

    @classmethod
    def from_wire(cls, v: Any, vocab: int | None = None) -> RequestDesc:
        """The description ``v`` holds, every field checked (``vocab`` bounds the token ids)."""
        m = _map(v)
        for key in ("rid", "prompt", "sp", "arrival", "slo"):
            if key not in m:
                raise FieldError("is missing", key)
        prompt = _field(_token_ids, m["prompt"], "prompt", vocab)
        if not prompt:
            raise FieldError("must hold at least one token", "prompt")
        try:
            sampling = sampling_from_dict(m["sp"])
        except ValueError as exc:
            raise FieldError(f"is not valid: {exc}", "sp") from None
        if vocab is not None and any(t >= vocab for t, _ in sampling.logit_bias):
            raise FieldError(f"holds a token id outside the vocabulary [0, {vocab})", "sp.logit_bias")
        slo = _field(lambda x, _: _map(x), m["slo"], "slo")
        ttft, tpot = (_field(_opt(_real), slo.get(k), f"slo.{k}") for k in ("ttft", "tpot"))
        for k, t in (("ttft", ttft), ("tpot", tpot)):
            if t is not None and not t > 0:
                raise FieldError(f"must be > 0 seconds, got {t!r}", f"slo.{k}")
        return cls(_field(_int, m["rid"], "rid"), prompt, sampling, _field(_real, m["arrival"], "arrival"),
                   SLO(ttft, tpot), _field(_str, m.get("cls", "default"), "cls"),
                   _field(_int, m.get("prio", 0), "prio"))


@dataclass(frozen=True, slots=True)
class SampleStart(_Record):
    """A sample of an n-sample request going to a decode instance: its request id, its index
    (its seed) and its first token."""

    rid: int
    index: int
    token: int

    _checks = (_int, _count, _token)


@dataclass(frozen=True, slots=True)
class SampleFirst(_Record):
    """A sample's first token as its prefill instance sampled it; ``finish`` set if that ended it."""

    rid: int
    index: int
    token: int
    finish: str | None = None
    logprobs: list | None = None

    _checks = (_int, _count, _count, _opt(_str), _any)


@dataclass(slots=True)
class TokenItem(_Record):
    """A request's new tokens: ``finish`` reason when it ended, ``logprobs`` when asked for
    (``[[logprob, [[id, logprob], ...]], ...]``), ``info`` with its first tokens and at its end.
    Not frozen, unlike the other records: there is one per request and step, and a frozen
    dataclass's constructor costs about 7x a plain one's (CPython 3.11)."""

    rid: int
    tokens: list[int]
    finish: str | None = None
    logprobs: list | None = None
    info: StartInfo | None = None

    _checks = (_int, _token_ids, _opt(_str), _any, _opt(StartInfo.from_wire))

    # one per request and step: a fast path for the usual item, the general one for the rest
    def to_wire(self) -> list:
        info = self.info
        return [self.rid, self.tokens, self.finish, self.logprobs, None if info is None else info.to_wire()]

    @classmethod
    def from_wire(cls, v: Any, vocab: int | None = None) -> TokenItem:
        if type(v) is list and len(v) == 5 and vocab is None:
            rid, tokens, finish, logprobs, info = v
            if (type(rid) is int and INT64_MIN <= rid <= INT64_MAX and (finish is None or type(finish) is str)
                    and info is None and type(tokens) is list
                    and all(type(t) is int and 0 <= t <= INT64_MAX for t in tokens)):
                return cls(rid, tokens, finish, logprobs)
        return _from_wire(cls, v, vocab, {})


@dataclass(frozen=True, slots=True)
class InstanceInfo(_Record):
    """An instance's limits and identity, sent once it is ready."""

    max_model_len: int
    kv_blocks: int
    block_size: int
    vocab_size: int
    pid: int
    policy: str
    role: str
    device: str
    prefix_caching: bool = False
    prefix_root: Any = None                    # the prefix hash chain's root (core/prefix_summary.py)
    stub: bool = False
    tensor_parallel_size: int = 1              # ranks (engine/tp); rank 0 is ``pid``
    rank_pids: Any = None                      # the processes of ranks 1..N-1 (a list; None: one rank)

    _checks = (_count, _count, _count, _count, _count, _str, _str, _str, _bool, _any, _bool, _count, _any)


# ---- messages ---------------------------------------------------------------------------------------
_KINDS: dict[str, type] = {}


def _kind(tag: str):
    def register(cls):
        cls.tag = tag
        _KINDS[tag] = cls
        return cls
    return register


@dataclass(frozen=True, slots=True)
class Report(_Record):
    """A message from an instance: ``inst`` its id, ``gen`` its incarnation (filled in by the sender)."""

    inst: int = field(default=-1, kw_only=True)
    gen: int = field(default=0, kw_only=True)


@_kind("add")
@dataclass(frozen=True, slots=True)
class Add(_Record):
    request: RequestDesc
    kids: tuple[int, ...] = ()

    _checks = (RequestDesc.from_wire, _seq(_int))

    def _check(self) -> None:
        n = self.request.sampling.n
        if (n > 1 or self.kids) and len(self.kids) != n - 1:
            raise FieldError(f"must list n - 1 request ids ({n - 1}), got {len(self.kids)}", "kids")


@_kind("transfer")
@dataclass(frozen=True, slots=True)
class Transfer(_Record):
    request: RequestDesc
    out: list[int]
    computed: int
    t_first: float
    kv: Any = None
    info: StartInfo | None = None
    samples: tuple[SampleStart, ...] | None = None

    _checks = (RequestDesc.from_wire, _token_ids, _count, _real, _any, _opt(StartInfo.from_wire),
               _opt(_seq(SampleStart.from_wire)))

    def _check(self) -> None:
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


@_kind("abort")
@dataclass(frozen=True, slots=True)
class Abort(_Record):
    rids: tuple[int, ...]

    _checks = (_seq(_int),)


@_kind("lane")
@dataclass(frozen=True, slots=True)
class Lane(_Record):
    lane: str

    _checks = (_str,)


@_kind("stop")
@dataclass(frozen=True, slots=True)
class Stop(_Record):
    _checks = ()


@_kind("ready")
@dataclass(frozen=True, slots=True)
class Ready(Report):
    info: InstanceInfo

    _checks = (InstanceInfo.from_wire,)


@_kind("tok")
@dataclass(frozen=True, slots=True)
class Tokens(Report):
    items: tuple[TokenItem, ...]

    _checks = (_seq(TokenItem.from_wire),)


@_kind("handoff")
@dataclass(frozen=True, slots=True)
class Handoff(Report):
    rid: int
    out: list[int]
    computed: int
    kv: Any
    t_first: float
    logprobs: list | None = None
    info: StartInfo = StartInfo()
    samples: tuple[SampleFirst, ...] | None = None

    _checks = (_int, _token_ids, _count, _any, _real, _any, StartInfo.from_wire, _opt(_seq(SampleFirst.from_wire)))


@_kind("stats")
@dataclass(frozen=True, slots=True)
class Stats(Report):
    added: int = 0                     # ADDs and transfers received
    waiting: int = 0
    running: int = 0
    queued_tokens: int = 0
    kv_usage: float = 0.0
    kv_free: int = 0
    kv_total: int = 0
    host_free: int | None = None
    host_total: int | None = None
    preemptions: int = 0
    prefix_queries: int | None = None          # None: no prefix cache figures (the stub)
    prefix_hits: int | None = None
    steps: int = 0
    busy: float = 0.0
    live: int = 0
    incoming: int = 0
    kv_held: int = 0
    kv_events: list = field(default_factory=list)
    kv_forks: int = 0
    decode: DecodeSummary | None = None          # decode: its next step
    last_decode: tuple | None = None             # decode: its last pure decode step + that step's number

    _checks = (_count, _count, _count, _count, _real, _count, _count, _opt(_count), _opt(_count), _count,
               _opt(_count), _opt(_count), _count, _real, _count, _count, _count, lambda v, n, _=None: list(_list(v, n)),
               _count, _opt(lambda v, n, _=None: _summary(v, n)),
               _opt(lambda v, n, _=None: _last_decode(v, n)))


@_kind("err")
@dataclass(frozen=True, slots=True)
class Failed(Report):
    rids: tuple[int, ...]
    message: str

    _checks = (_seq(_int), _str)


@_kind("fatal")
@dataclass(frozen=True, slots=True)
class Fatal(Report):
    message: str

    _checks = (_str,)


@_kind("hb")
@dataclass(frozen=True, slots=True)
class Heartbeat(Report):
    _checks = ()


def _summary(v: Any, vocab: int | None = None) -> DecodeSummary:
    try:
        return DecodeSummary.from_wire(v)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FieldError(f"must be [count, total, longest, [[tpot, count], ...]]: {exc}") from None


def _last_decode(v: Any, vocab: int | None = None) -> tuple:
    if not (type(v) is list and len(v) == 5 and all(map(is_real, v))):
        raise FieldError("must be [requests, context sum, longest context, seconds, step number]")
    return tuple(v)


# ---- the codec -------------------------------------------------------------------------------------
Message = Add | Transfer | Abort | Lane | Stop | Report


def encode(msg: Message) -> bytes:
    """``msg`` as msgpack: ``[tag, field, ...]``, ``[tag, inst, gen, field, ...]`` for a report."""
    head = [msg.tag, msg.inst, msg.gen] if isinstance(msg, Report) else [msg.tag]
    return msgpack.packb(head + msg.to_wire(), use_bin_type=True)


def decode(data: bytes, *, vocab_size: int | None = None) -> Message:
    """The message ``data`` encodes; :class:`InvalidMessage` naming the bad field otherwise.
    ``vocab_size``, when given, bounds the token ids of requests (an out-of-range id would index
    past the embedding table)."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - any malformed bytes
        raise InvalidMessage(f"not a msgpack message: {type(exc).__name__}") from None
    if not isinstance(raw, list) or not raw or raw[0] not in _KINDS:
        raise InvalidMessage(f"not a message: {_show(raw)}")
    cls = _KINDS[raw[0]]
    try:
        if issubclass(cls, Report):
            if len(raw) < 3:
                raise FieldError("lacks the sender's 'inst' and 'gen'")
            return cls.from_wire(raw[3:], vocab_size, inst=_field(_int, raw[1], "inst"),
                                 gen=_field(_int, raw[2], "gen"))
        return cls.from_wire(raw[1:], vocab_size)
    except FieldError as exc:
        why = str(exc) if exc.path else f"a '{cls.tag}' message {exc.reason}"
        raise InvalidMessage(why, cls.tag, *_named(raw)) from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        raise InvalidMessage(f"malformed '{cls.tag}' message: {type(exc).__name__}: {exc}", cls.tag,
                             *_named(raw)) from None


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

"""The ``ray`` KV transport: a prefilled request's KV crosses machines through Ray's object store.

Put (prefill actor): the KV bytes go into the local object store (``ray.put``); the actor keeps
the ObjectRef in a lease table under a fresh key for at most ``lease`` seconds, and the descriptor
names the owner actor and the key — never the ObjectRef itself. An ObjectRef serialised out of
band (into a ZeroMQ message) would be pinned by Ray for the owner's whole lifetime: a leak per
request.

Get (decode actor): ``claim(key)`` on the owner actor pops the entry and returns ``[ref]``, an
in-band hand-over (the decode side becomes a borrower, so the object lives exactly until it has
read it); then ``ray.get`` pulls the bytes node to node. Both calls have a deadline
(``timeout``); a key that is gone (lease expired, released, owner dead) raises an error that says
so, which the decode worker turns into an ``err`` for that request. Nothing waits forever.

Release: an aborted or orphaned transfer (``discard``, on either side or in the router) asks the
owner to drop the key; a key nobody claims is dropped when its lease runs out (a reaper thread).
Either way the object's last reference goes and the store frees it.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import ray

from laneserve.cluster.transport import _dtype_name, register_transport, tensor_from_bytes, tensor_to_bytes

KV_LEASE_S = 60.0          # how long a prefill actor keeps an unclaimed KV object
KV_GET_TIMEOUT_S = 20.0    # how long a decode actor waits for the owner's answer and the bytes


class KVLeases:
    """ObjectRefs this process owns for other instances, each until claimed, released or expired."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[Any, float]] = {}
        self._reaper: threading.Thread | None = None
        self.expired = 0

    def hold(self, ref: Any, lease: float) -> str:
        key = uuid.uuid4().hex
        with self._lock:
            self._held[key] = (ref, time.monotonic() + lease)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap_forever, daemon=True, name="kv-lease-reaper")
                self._reaper.start()
        return key

    def claim(self, key: str) -> list | None:
        with self._lock:
            entry = self._held.pop(key, None)
        return None if entry is None else [entry[0]]

    def release(self, key: str) -> bool:
        with self._lock:
            return self._held.pop(key, None) is not None

    def __len__(self) -> int:
        return len(self._held)

    def reap(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [k for k, (_, deadline) in self._held.items() if deadline <= now]
            for k in gone:
                del self._held[k]
        self.expired += len(gone)
        return len(gone)

    def _reap_forever(self) -> None:
        while True:
            time.sleep(0.5)
            self.reap()


LEASES = KVLeases()        # one table per process: the actor's ``claim`` / ``release`` methods use it

_owners: dict[str, Any] = {}


def _owner(name: str):
    handle = _owners.get(name)
    if handle is None:
        handle = _owners[name] = ray.get_actor(name)
    return handle


def release(desc: dict[str, Any]) -> None:
    """Ask the owner of ``desc`` to drop it (fire and forget; an owner that is gone took it along)."""
    try:
        _owner(desc["owner"]).release_kv.remote(desc["key"])
    except Exception:  # noqa: BLE001 - a dead owner's objects are gone with it
        _owners.pop(desc.get("owner"), None)


@register_transport("ray")
class RayObjectTransport:
    """KV through the object store of the Ray cluster this process belongs to (an actor's)."""

    def __init__(self, directory: str | None = None, *, lease: float = KV_LEASE_S,
                 timeout: float = KV_GET_TIMEOUT_S, owner: str | None = None, leases: KVLeases = LEASES) -> None:
        self.lease = lease
        self.timeout = timeout
        self.leases = leases
        self.owner = owner or ray.get_runtime_context().get_actor_name()

    def put(self, rid: int, payload) -> dict[str, Any]:
        kv = payload.kv
        ref = ray.put(tensor_to_bytes(kv))
        key = self.leases.hold(ref, self.lease)
        return {"t": self.name, "owner": self.owner, "key": key, "rid": rid, "shape": list(kv.shape),
                "dtype": _dtype_name(kv), "n": payload.num_tokens, "bytes": kv.numel() * kv.element_size()}

    def get(self, desc: dict[str, Any]):
        from laneserve.engine.kv_cache import KVPayload
        deadline = time.monotonic() + self.timeout
        what = f"KV of request {desc.get('rid')} (held by {desc['owner']})"
        try:
            refs = ray.get(_owner(desc["owner"]).claim_kv.remote(desc["key"]), timeout=self.timeout)
            if refs is None:
                raise RuntimeError(f"{what} is gone: its lease expired or it was released")
            data = ray.get(refs[0], timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what} did not arrive within {self.timeout:g} s") from None
        except ray.exceptions.RayError as exc:
            _owners.pop(desc["owner"], None)
            raise RuntimeError(f"{what} cannot be fetched: {type(exc).__name__}") from None
        return KVPayload(int(desc["n"]), tensor_from_bytes(data, desc["dtype"], desc["shape"]))

    def discard(self, desc: dict[str, Any] | None) -> None:
        if not desc:
            return
        if desc["owner"] == self.owner:
            self.leases.release(desc["key"])
        else:
            release(desc)

    @staticmethod
    def release_descriptor(desc: dict[str, Any]) -> None:
        release(desc)

    def held(self) -> int:
        return len(self.leases)

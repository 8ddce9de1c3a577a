"""The edge's end of federated training's ``fl`` channel: its devices' updates to the task's aggregator worker.

The router subscribes to ``synergy/v1/devices/+/fl`` on the devices' link (the broker's ACL lets the edge read only
its own devices). An update must be a valid ``Envelope[FlUpdateBody]`` within the message size limit, and name
exactly the device it came from as its one contributor (a device speaks only for itself); it goes to the
``aggregator`` worker of its task on this node (:mod:`device.tasks.federated`), which registered with
:meth:`FlRouter.serve`. An update for a task this node aggregates nothing of is dropped and counted (the hub's
round closes with k of n without it).

**Whole models** (a hierarchical ``federated_training`` task with an algorithm): a device's update is a file, too
large for a message. The device sends it (``PUT``) to this edge's device server at ``/api/v1/fl/updates``
(:class:`UpdateIntake`) with its round grant as the bearer credential: the hub's signature is checked with the keys
this node pinned (the same grant the hub would accept for the device's own upload), and the file is kept only for
a task whose aggregator runs here and registered an inbox (:meth:`UpdateIntake.open`), at most that inbox's size
limit, named after the device and the grant's round attempt. The answer is the file's SHA-256, which the device's
``fl`` update then names (``parameters``); the aggregator takes the file with :meth:`UpdateIntake.take`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiomqtt
from pydantic import ValidationError

from device.ota.verify import signed_by
from edge.link import Link
from interfaces import API_PREFIX
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.messages import MAX_MESSAGE_BYTES
from interfaces.tasks import FL_UPDATES_PATH, FlUpdate, fl_update_identity
from interfaces.topics import DEVICE_FL
from interfaces.uploads import PUBLISH_TOKEN_PREFIX, PublishClaims, decode_publish_token, publish_signing_bytes

log = logging.getLogger("aisynergy.edge.fl")

Offer = Callable[[FlUpdate], None]
"""An aggregator's intake (called on the event loop: it must only store the update and return)."""


class FlRouter:
    """Routes the devices' federated updates to the aggregator workers; see the module docstring."""

    def __init__(self, identity: str) -> None:
        self.identity = identity
        self.intake = UpdateIntake()  # whole models: the devices' update files (the device server's FL_UPDATES_PATH)
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self.counters = {"received": 0, "routed": 0, "dropped": 0, "rejected": 0}

    def attach(self, link: Link) -> None:
        link.route(DEVICE_FL, self._on_update)

    def serve(self, task_id: str, offer: Offer) -> None:
        with self._lock:
            if task_id in self._offers and self._offers[task_id] != offer:
                raise ValueError(f"task {task_id} already has an aggregator on this edge")
            self._offers[task_id] = offer

    def unserve(self, task_id: str, offer: Offer) -> None:
        with self._lock:
            if self._offers.get(task_id) == offer:
                del self._offers[task_id]

    async def _on_update(self, client: aiomqtt.Client, message: aiomqtt.Message, ids: dict[str, str]) -> None:
        self.counters["received"] += 1
        device_id = ids["device_id"]
        payload = message.payload if isinstance(message.payload, bytes) else bytes(message.payload or b"")  # type: ignore[arg-type]
        try:
            if len(payload) > MAX_MESSAGE_BYTES:
                raise ValueError(f"{len(payload)} bytes exceed the {MAX_MESSAGE_BYTES} byte limit")
            update = DEVICE_FL.payload.model_validate_json(payload).body.update
            if update.contributors != [device_id]:
                raise ValueError(f"it names contributors {update.contributors[:5]}, not the device it came from")
        except (ValidationError, ValueError) as exc:
            self.counters["rejected"] += 1
            log.warning("rejected a federated update from %s: %s", device_id, str(exc).splitlines()[0])
            return
        with self._lock:
            offer = self._offers.get(update.task_id)
        if offer is None:
            self.counters["dropped"] += 1
            log.info("dropped %s's update for task %s: this node runs no aggregator of it", device_id, update.task_id)
            return
        offer(update)
        self.counters["routed"] += 1


# --- whole models: the devices' update files ------------------------------------------------------------

PIECE = 1 << 20
VERSION = re.compile(r"^([1-9][0-9]{0,17})\.([1-9][0-9]{0,17})$")


class Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


@dataclass(frozen=True)
class IntakeAnswer:
    """What the device is answered (``close``: the body was not read, the connection cannot carry another request)."""

    status: int
    body: bytes
    content_type: str = "application/json"
    close: bool = False


@dataclass(frozen=True)
class Received:
    path: Path
    sha256: str
    size: int


def _problem(status: int, code: str, title: str, detail: str, close: bool = False) -> IntakeAnswer:
    document = {"type": ERROR_TYPE_PREFIX + code, "title": title, "status": status, "code": code, "detail": detail}
    return IntakeAnswer(status, json.dumps(document).encode(), PROBLEM_MEDIA_TYPE, close=close)


class UpdateIntake:
    """Takes devices' whole-model update files for the aggregators of this edge (see the module docstring).
    ``keys`` (set by the agent): the hub's signing keys this node trusts (``device.ota.verify.TrustedKeys``), or
    None while none is pinned. Thread-safe."""

    path = API_PREFIX + FL_UPDATES_PATH

    def __init__(self) -> None:
        self.keys: Callable[[], Any] | None = None
        self._lock = threading.Lock()
        self._inboxes: dict[str, tuple[Path, int]] = {}
        self._received: dict[tuple[str, str, int, int], Received] = {}
        self.counters = {"received": 0, "refused": 0}

    def handles(self, path: str) -> bool:
        return path == self.path

    def open(self, task_id: str, directory: Path, max_bytes: int) -> None:
        """Keep the update files of task ``task_id``'s devices in ``directory``, each at most ``max_bytes``."""
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._inboxes[task_id] = (directory, max_bytes)

    def close(self, task_id: str) -> None:
        with self._lock:
            self._inboxes.pop(task_id, None)
            for key in [k for k in self._received if k[0] == task_id]:
                del self._received[key]

    def take(self, task_id: str, device_id: str, round: int, attempt: int, sha256: str) -> Received | None:
        """The file ``device_id`` handed over for (round, attempt) when its SHA-256 is ``sha256``; else None."""
        with self._lock:
            got = self._received.get((task_id, device_id, round, attempt))
        return got if got is not None and got.sha256 == sha256 and got.path.exists() else None

    def forget_before(self, task_id: str, round: int, attempt: int) -> None:
        """Drop (and delete) the files of the task's round attempts before (round, attempt)."""
        with self._lock:
            old = [k for k in self._received if k[0] == task_id and (k[2], k[3]) < (round, attempt)]
            gone = [self._received.pop(k) for k in old]
        for received in gone:
            received.path.unlink(missing_ok=True)

    def _claims(self, headers: dict[str, str]) -> PublishClaims | IntakeAnswer:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.startswith(PUBLISH_TOKEN_PREFIX):
            return _problem(401, ErrorCode.UNAUTHENTICATED.value, "Unauthenticated", "an update is handed over with its round's publish grant", close=True)
        try:
            claims, signature = decode_publish_token(token)
        except ValueError as exc:
            return _problem(401, ErrorCode.UNAUTHENTICATED.value, "Unauthenticated", str(exc), close=True)
        keys = self.keys() if self.keys is not None else None
        if keys is None:
            return _problem(503, ErrorCode.HUB_UNREACHABLE.value, "No signing key yet", "this edge has not pinned the hub's signing key yet", close=True)
        if not signed_by(keys, signature, publish_signing_bytes(claims)):
            return _problem(401, ErrorCode.UNAUTHENTICATED.value, "Unauthenticated", "the publish grant's signature is not the hub's", close=True)
        if claims.exp < time.time():
            return _problem(401, ErrorCode.UNAUTHENTICATED.value, "Unauthenticated", "the publish grant has expired", close=True)
        return claims

    def receive(self, method: str, headers: dict[str, str], body: Readable) -> IntakeAnswer:
        """One device request (``headers`` lower-case): the file kept and its SHA-256 answered (201), or a problem."""
        if method != "PUT":
            return _problem(405, ErrorCode.METHOD_NOT_ALLOWED.value, "Method not allowed", f"{method} {self.path}: use PUT", close=True)
        claims = self._claims(headers)
        if isinstance(claims, IntakeAnswer):
            self.counters["refused"] += 1
            return claims
        version = VERSION.match(claims.version)
        name, _ = fl_update_identity(claims.task_id, claims.target_id, 1, 1)
        if version is None or claims.names != [name]:
            self.counters["refused"] += 1
            return _problem(403, ErrorCode.FORBIDDEN.value, "Forbidden", "the grant is not for a federated update of a round attempt", close=True)
        with self._lock:
            inbox = self._inboxes.get(claims.task_id)
        if inbox is None:  # the aggregator has not started (or has its first global model still to fetch): the device retries
            return _problem(503, ErrorCode.BUSY.value, "No aggregator yet", f"this edge runs no aggregator of task {claims.task_id} (yet)", close=True)
        directory, limit = inbox
        length = headers.get("content-length")
        if length is None or not length.isdigit():
            return _problem(411, ErrorCode.MALFORMED_REQUEST.value, "Content-Length required", "PUT an update with its Content-Length", close=True)
        size = int(length)
        if size > limit:
            self.counters["refused"] += 1
            return _problem(413, ErrorCode.PAYLOAD_TOO_LARGE.value, "Update too large", f"{size} bytes is more than the {limit} an update of this model takes", close=True)
        round_, attempt = int(version.group(1)), int(version.group(2))
        fd, temp = tempfile.mkstemp(prefix=".intake-", dir=directory)
        digest, left = hashlib.sha256(), size
        try:
            with os.fdopen(fd, "wb") as out:
                while left:
                    piece = body.read(min(PIECE, left))
                    if not piece:
                        raise EOFError(f"the body ended after {size - left} of {size} bytes")
                    digest.update(piece)
                    out.write(piece)
                    left -= len(piece)
            target = directory / f"{claims.target_id}.r{round_}.a{attempt}.safetensors"
            os.replace(temp, target)
        except EOFError as exc:
            os.unlink(temp)
            return _problem(400, ErrorCode.MALFORMED_REQUEST.value, "Body ended early", str(exc), close=True)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise
        received = Received(target, digest.hexdigest(), size)
        with self._lock:
            if claims.task_id not in self._inboxes:  # the aggregator stopped meanwhile
                target.unlink(missing_ok=True)
                return _problem(503, ErrorCode.BUSY.value, "No aggregator", f"the aggregator of task {claims.task_id} stopped", close=False)
            self._received[(claims.task_id, claims.target_id, round_, attempt)] = received
        self.counters["received"] += 1
        log.info("kept %s's round %d.%d update of task %s (%d bytes)", claims.target_id, round_, attempt, claims.task_id, size)
        return IntakeAnswer(201, json.dumps({"id": received.sha256, "size": size}).encode())

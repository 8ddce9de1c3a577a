"""The device enrolment proxy: devices enrol through their edge, which may be all they can reach.

``POST /api/v1/devices/{device_id}/certificate`` (a ``CertificateRequest``, at most 64 KiB) is forwarded
to the hub's route of the same path, and so is ``POST /api/v1/devices/{device_id}/certificate/renewal`` (a
``CertificateRenewal``: a device renews through the edge it enrolled with, DESIGN §6). The hub's answer must be a ``DeviceCertificateIssued`` for this
node (403 ``forbidden`` otherwise); the device then joins the edge's registry and ``mqtt_url`` becomes
the broker the edge's devices use. The hub's refusals pass through unchanged (status and body); an
unreachable hub is 503 ``hub_unreachable``. Errors are RFC 9457 problem documents (DESIGN §4).

With an ``ArtifactCache`` the same server also answers ``GET|HEAD /api/v1/artifacts/{id}/content`` and
``.../delta?from=`` from the edge's artefact cache (:mod:`edge.artifacts`), so devices need not reach the hub; with an
``UploadRelay`` it forwards the chunked upload API (``/api/v1/artifacts/uploads...``) for a training device's publish
grant (:mod:`edge.upload_relay`), and with an ``UpdateIntake`` it keeps the devices' whole-model updates of hierarchical
federated rounds for this node's aggregators (``PUT /api/v1/fl/updates``, :mod:`edge.fl`).

It serves HTTPS only (the bootstrap tokens and the trust it hands out must not travel in clear), with the
node's own certificate, which the hub CA issues for the node id (devices check that name: ``tls_server_name``),
TLS 1.2 at least and AEAD suites only; the TLS handshake runs in the handler pool, within the idle timeout.
An address whose enrolments were refused :data:`FAILURES_PER_ADDRESS` times within :data:`FAILURE_WINDOW_S`
waits (429 ``too_many_requests`` with ``Retry-After``; nothing forwarded to the hub): see :class:`FailureLimit`.
``GET /api/v1/ca.crt`` answers the hub CA, as the hub does: a device compares its fingerprint with the one it
was given before it sends its token (:mod:`device.enrol`).

Runs a stdlib ``ThreadingHTTPServer`` in a thread of its own; ``on_enrolled`` is called from it.

It stays one module: the forwarding, the failure limit, the TLS set-up and the artefact and upload routes are the one
HTTPS server's, and share its handler.
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import ssl
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from pydantic import ValidationError

from device.tls import tls_verify
from edge.artifacts.answers import Answer
from edge.artifacts.cache import ArtifactCache
from edge.fl import UpdateIntake
from edge.upload_relay import UploadRelay
from interfaces import API_PREFIX
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE, ErrorCode
from interfaces.ids import new_id
from interfaces.nodes import DeviceCertificateIssued
from interfaces.topics import DEVICE_STATE

log = logging.getLogger("aisynergy.edge.enrol_proxy")

MAX_BODY_BYTES = 64 * 1024
FAILURES_PER_ADDRESS = 10  # refused enrolments from one address within FAILURE_WINDOW_S, then it waits (429)
FAILURE_WINDOW_S = 60.0
MAX_ADDRESSES = 10_000  # addresses whose failures are remembered
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"  # what the listener offers over TLS 1.2 (1.3 is preferred)
CA_PATH = f"{API_PREFIX}/ca.crt"
MAX_HANDLERS = 64  # requests handled at once (downloads go out with sendfile: a thread is busy briefly)
IDLE_TIMEOUT_S = 30.0  # a connection silent this long is closed
HUB_UNREACHABLE = ErrorCode.HUB_UNREACHABLE.value
INVALID_RESPONSE = ErrorCode.INVALID_RESPONSE.value
_PATH = re.compile(rf"^{re.escape(API_PREFIX)}/devices/([^/]+)/(certificate(?:/renewal)?)$")
_FORWARDED_HEADERS = ("content-type", "accept", "idempotency-key")


class ListenError(Exception):
    """The proxy cannot listen where it was asked to."""


def server_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """The listener's TLS: the node's certificate and key; TLS 1.2 at least, forward-secret AEAD suites only.
    :class:`ListenError` when the certificate cannot serve TLS (issued before node certificates could)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        usages = x509.load_pem_x509_certificate(cert_path.read_bytes()).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (OSError, ValueError, x509.ExtensionNotFound) as exc:
        raise ListenError(f"cannot read the node certificate {cert_path}: {exc}") from exc
    if ExtendedKeyUsageOID.SERVER_AUTH not in usages:
        raise ListenError(
            f"the node certificate {cert_path} cannot serve TLS to devices (it was issued before node certificates "
            "could): re-enrol the node with a new bootstrap token (POST /nodes/{id}/bootstrap-token), or --device-listen off"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    try:
        context.load_cert_chain(str(cert_path), str(key_path))
    except (OSError, ssl.SSLError) as exc:
        raise ListenError(f"cannot load the node certificate and key: {exc}") from exc
    return context


@dataclass(frozen=True)
class ProxyAnswer:
    status: int
    body: bytes
    content_type: str
    retry_after_s: int | None = None  # a Retry-After header (429)
    location: str | None = None  # a Location header (a relayed upload session or artefact)


class FailureLimit:
    """Refused enrolments per client address in a sliding window: an address with ``limit`` of them within
    ``window_s`` waits until the oldest leaves the window (429), and its requests are not forwarded to the hub,
    so that nobody on the LAN can try tokens or CSRs at the rate of the network. At most ``max_addresses`` are
    remembered (the one seen longest ago is forgotten first). Thread-safe."""

    def __init__(self, limit: int = FAILURES_PER_ADDRESS, window_s: float = FAILURE_WINDOW_S,
                 max_addresses: int = MAX_ADDRESSES, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.limit, self.window_s, self.max_addresses, self._clock = limit, window_s, max_addresses, clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()
        self.refused = 0  # requests answered 429 (metrics, tests)

    def retry_after(self, address: str) -> int | None:
        """Seconds ``address`` must wait, or ``None`` when it may try."""
        with self._lock:
            failures = self._recent(address)
            if failures is None or len(failures) < self.limit:
                return None
            self.refused += 1
            return max(1, math.ceil(failures[0] + self.window_s - self._clock()))

    def failed(self, address: str) -> None:
        with self._lock:
            failures = self._recent(address)
            if failures is None:
                failures = self._failures[address] = deque(maxlen=self.limit)
                while len(self._failures) > self.max_addresses:
                    self._failures.popitem(last=False)
            self._failures.move_to_end(address)
            failures.append(self._clock())

    def _recent(self, address: str) -> deque[float] | None:
        failures = self._failures.get(address)
        if failures is not None:
            while failures and failures[0] <= self._clock() - self.window_s:
                failures.popleft()
        return failures


def problem(status: int, code: str, title: str, detail: str | None = None) -> ProxyAnswer:
    document = {"type": ERROR_TYPE_PREFIX + code, "title": title, "status": status, "code": code, "detail": detail}
    return ProxyAnswer(status, json.dumps(document).encode(), PROBLEM_MEDIA_TYPE)


def parse_listen(value: str) -> tuple[str, int] | None:
    """``HOST:PORT`` -> (host, port); ``off`` -> ``None``."""
    if value.strip().lower() == "off":
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT or off")
    return host.strip("[]"), int(port)


class EnrolmentProxy:
    """Forwards device certificate requests to the hub; see the module docstring."""

    def __init__(
        self,
        listen: tuple[str, int],
        *,
        hub_url: str,
        node_id: str,
        device_mqtt_url: str,
        on_enrolled: Callable[[str], object],
        tls: ssl.SSLContext,
        ca_pem: str,
        verify: ssl.SSLContext | str | bool = True,
        timeout_s: float = 15.0,
        artifacts: ArtifactCache | None = None,
        failures: FailureLimit | None = None,
        uploads: UploadRelay | None = None,
        fl_intake: UpdateIntake | None = None,
    ) -> None:
        """``tls``: the listener's (:func:`server_context`); ``ca_pem``: the hub CA, answered on ``GET /api/v1/ca.crt``;
        ``verify``: how the hub is checked when a request is forwarded to it; ``failures``: the limit on refused
        enrolments per address (default :class:`FailureLimit`); ``uploads``: the relay of the chunked upload API
        (:mod:`edge.upload_relay`); ``fl_intake``: the devices' whole-model update files for this node's aggregators
        (``PUT /api/v1/fl/updates``, :class:`edge.fl.UpdateIntake`)."""
        self.failures = failures or FailureLimit()
        self.hub_url = hub_url.rstrip("/")
        self.ca_pem = ca_pem.encode()
        self.node_id = node_id
        self.device_mqtt_url = device_mqtt_url
        self._on_enrolled = on_enrolled
        self._verify = verify
        self._timeout_s = timeout_s
        self.artifacts = artifacts
        self.uploads = uploads
        self.fl_intake = fl_intake
        try:
            self._server = _Server(listen, _Handler, tls)
        except OSError as exc:
            raise ListenError(f"cannot listen on {listen[0]}:{listen[1]}: {exc}") from exc
        self._server.proxy = self
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="enrol-proxy", daemon=True)
        self._thread.start()
        log.info("device enrolment proxy on https://%s:%s forwards to %s", *self.address, self.hub_url)

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()
        if self.uploads is not None:
            self.uploads.close()

    def enrol(self, device_id: str, body: bytes, headers: dict[str, str], route: str = "certificate") -> ProxyAnswer:
        """Forward one certificate request (``route`` ``certificate``) or renewal (``certificate/renewal``) to the
        hub and check, record and rewrite its answer."""
        url = f"{self.hub_url}{API_PREFIX}/devices/{device_id}/{route}"
        forwarded = {name: headers[name] for name in _FORWARDED_HEADERS if name in headers}
        log.info("forwarding the certificate request of device %s to %s", device_id, url)
        try:
            with httpx.Client(verify=tls_verify(self._verify), timeout=self._timeout_s) as client:
                response = client.post(url, content=body, headers=forwarded)
        except httpx.TransportError as exc:
            log.warning("the hub is unreachable for the enrolment of %s: %s", device_id, exc)
            return problem(503, HUB_UNREACHABLE, "The hub cannot be reached", f"{type(exc).__name__}: {exc}")
        if not response.is_success:
            log.info("the hub refused the enrolment of %s: %s", device_id, response.status_code)
            return ProxyAnswer(
                response.status_code, response.content, response.headers.get("content-type", PROBLEM_MEDIA_TYPE)
            )
        try:
            issued = DeviceCertificateIssued.model_validate_json(response.content)
        except ValidationError as exc:
            log.error("the hub's answer for %s is not a DeviceCertificateIssued: %s", device_id, exc.error_count())
            return problem(502, INVALID_RESPONSE, "The hub answered something else than a certificate", str(exc)[:1024])
        if issued.device_id != device_id:
            return problem(502, INVALID_RESPONSE, "The hub issued a certificate for another device", issued.device_id)
        if issued.node_id != self.node_id:
            log.warning(
                "refused the enrolment of %s: it belongs to node %s, not %s", device_id, issued.node_id, self.node_id
            )
            return problem(
                403,
                ErrorCode.FORBIDDEN.value,
                "Not a device of this edge",
                f"device {device_id!r} belongs to another node",
            )
        self._on_enrolled(device_id)
        log.info("device %s enrolled through this edge (serial %s)", device_id, issued.serial)
        rewritten = issued.model_copy(update={"mqtt_url": self.device_mqtt_url})
        return ProxyAnswer(response.status_code, rewritten.model_dump_json().encode(), "application/json")


class _Server(ThreadingHTTPServer):
    """Requests are handled by a pool of :data:`MAX_HANDLERS` threads; more wait, accepted, in its queue.

    One thread per connection let a rollout's 1,000 concurrent downloads run 1,000 threads, which took the
    interpreter lock from the edge's event loop for seconds at a time (every MQTT message waited).
    """

    daemon_threads = True
    proxy: EnrolmentProxy

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext) -> None:
        # made first: a failed bind calls server_close() from within the base class's __init__
        self._pool = ThreadPoolExecutor(MAX_HANDLERS, thread_name_prefix="edge-device-http")
        self._tls = tls
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:  # type: ignore[override]
        try:
            self._pool.submit(self._handshake_then_handle, request, client_address)
        except RuntimeError:  # shutting down
            self.shutdown_request(request)

    def _handshake_then_handle(self, raw: socket.socket, client_address: Any) -> None:
        """The TLS handshake, here in the pool rather than in accept(): a client that never finishes it holds one
        handler for :data:`IDLE_TIMEOUT_S` at most, and the listener keeps accepting."""
        try:
            raw.settimeout(IDLE_TIMEOUT_S)
            request = self._tls.wrap_socket(raw, server_side=True)
        except OSError as exc:  # ssl.SSLError included: plain HTTP, an unknown CA, no common suite ...
            log.info("TLS handshake with %s failed: %s", client_address[0], exc)
            self.shutdown_request(raw)
            return
        self.process_request_thread(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S  # a silent connection (idle keep-alive, a stalled client) gives its thread back

    def do_POST(self) -> None:
        if self._relayed():
            return
        match = _PATH.match(urlsplit(self.path).path)
        if match is None:
            self._not_allowed()
            return
        limit, address = self.server.proxy.failures, self.client_address[0]
        if (wait := limit.retry_after(address)) is not None:
            detail = f"{limit.limit} refused enrolments from {address} within {limit.window_s:g} s; try again in {wait} s"
            log.warning("%s", detail)
            self._send(replace(problem(429, ErrorCode.TOO_MANY_REQUESTS.value, "Too many refused enrolments", detail), retry_after_s=wait), close=True)
            return
        answer, close = self._enrol(match.group(1), match.group(2))
        if 400 <= answer.status < 500:
            limit.failed(address)
        self._send(answer, close=close)

    def _enrol(self, device_id: str, route: str) -> tuple[ProxyAnswer, bool]:
        """The answer to one certificate request or renewal, and whether the connection closes after it."""
        try:
            DEVICE_STATE.topic(device_id=device_id)
        except ValueError as exc:
            return problem(422, ErrorCode.VALIDATION_FAILED.value, "Invalid device id", str(exc)), True
        length = self.headers.get("content-length")
        if length is None or not length.isdigit():
            return problem(411, ErrorCode.MALFORMED_REQUEST.value, "Content-Length required"), True
        if int(length) > MAX_BODY_BYTES:
            detail = f"{length} bytes is more than {MAX_BODY_BYTES}"
            return problem(413, ErrorCode.PAYLOAD_TOO_LARGE.value, "Request body too large", detail), True
        body = self.rfile.read(int(length))
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            return self.server.proxy.enrol(device_id, body, headers, route), False
        except Exception:  # a bug here must still answer the device
            incident = new_id("inc")
            log.exception("enrolment of %s failed (%s)", device_id, incident)
            return problem(500, ErrorCode.INTERNAL.value, "Internal error", incident), False

    def _not_allowed(self) -> None:
        path = urlsplit(self.path).path
        cache = self.server.proxy.artifacts
        relay, intake = self.server.proxy.uploads, self.server.proxy.fl_intake
        if (_PATH.match(path) and self.command != "POST") or (cache is not None and cache.handles(path)) or (relay is not None and relay.handles(path)) or (
            intake is not None and intake.handles(path)
        ):
            self._send(problem(405, ErrorCode.METHOD_NOT_ALLOWED.value, "Method not allowed", self.command), close=True)
        else:
            self._send(problem(404, ErrorCode.NOT_FOUND.value, "Not found", self.path), close=True)

    def _relayed(self) -> bool:
        """A request of the chunked upload API, forwarded to the hub and answered here (True), or another (False)."""
        relay = self.server.proxy.uploads
        return relay is not None and self._served(relay.handles, lambda path, headers: relay.forward(self.command, path, headers, self.rfile), "the upload request")

    def do_PUT(self) -> None:
        if not self._relayed() and not self._handed_over():
            self._not_allowed()

    def _handed_over(self) -> bool:
        """A device's whole-model update for this node's aggregator, kept and answered here (True), or another (False)."""
        intake = self.server.proxy.fl_intake
        return intake is not None and self._served(intake.handles, lambda path, headers: intake.receive(self.command, headers, self.rfile), "the update hand-over")

    def _served(self, handles: Callable[[str], bool], answer_for: Callable[[str, dict[str, str]], Any], what: str) -> bool:
        """Answer the request with ``answer_for(path, headers)`` (lower-case headers) when ``handles(path)`` and it has no
        query (True), else leave it (False). The answer has ``status``, ``body``, ``content_type``, ``close`` and maybe ``location``."""
        path = urlsplit(self.path).path
        if not handles(path) or urlsplit(self.path).query:
            return False
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            answer = answer_for(path, headers)
        except Exception:  # a bug here must still answer the device
            incident = new_id("inc")
            log.exception("%s %s failed (%s)", what, path, incident)
            self._send(problem(500, ErrorCode.INTERNAL.value, "Internal error", incident), close=True)
            return True
        self._send(ProxyAnswer(answer.status, answer.body, answer.content_type, location=getattr(answer, "location", None)), close=answer.close)
        return True

    do_DELETE = do_PUT
    do_PATCH = _not_allowed

    def do_GET(self) -> None:
        if self.command == "GET" and self._relayed():
            return
        if urlsplit(self.path).path == CA_PATH:  # public, as at the hub: what a device checks its pin against
            self._send(ProxyAnswer(200, self.server.proxy.ca_pem, "application/x-pem-file"))
            return
        cache = self.server.proxy.artifacts
        if cache is None or not cache.handles(self.path):
            self._not_allowed()
            return
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            answer = cache.answer(self.command, self.path, headers)
        except Exception:  # a bug here must still answer the device
            incident = new_id("inc")
            log.exception("the artefact request %s failed (%s)", self.path, incident)
            self._send(problem(500, ErrorCode.INTERNAL.value, "Internal error", incident))
            return
        try:
            self._send_artifact(answer)
        finally:
            answer.release()

    do_HEAD = do_GET

    def _send_artifact(self, answer: Answer) -> None:
        try:
            self.send_response(answer.status)
            for name, value in answer.headers.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                answer.write_body(self.wfile, self.connection)
        except (BrokenPipeError, ConnectionResetError) as exc:  # the device went away mid-transfer
            log.info("a device left during %s: %s", self.path, exc)
            self.close_connection = True

    def end_headers(self) -> None:
        self.send_header("X-Content-Type-Options", "nosniff")  # every answer: its Content-Type is the truth
        super().end_headers()

    def _send(self, answer: ProxyAnswer, close: bool = False) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("Cache-Control", "no-store")  # an enrolment answer is for this device only
        self.send_header("Content-Length", str(len(answer.body)))
        if answer.retry_after_s is not None:
            self.send_header("Retry-After", str(answer.retry_after_s))
        if answer.location is not None:
            self.send_header("Location", answer.location)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(answer.body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

"""Devices download artefacts from their edge: the edge checks their download tokens offline, fetches a blob
from a (stand-in) hub once, verifies it, keeps it within a budget and serves it, with Range, even while the
hub is gone."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from click.testing import CliRunner

from cloud.signing import SigningKey, rotate
from device.ota.verify import TrustedKeys
from edge.agent import AgentConfig, EdgeAgent
from edge.artifacts.cache import ArtifactCache
from edge.artifacts.store import parse_size
from edge.cli import edge as edge_cli
from edge.enrol_proxy import EnrolmentProxy, server_context
from edge.identity import IdentityStore
from edge.relay import DeviceRelay
from edge.store import EdgeStore
from interfaces.deployments import (
    DELTA_MEDIA_TYPE,
    DOWNLOAD_TOKEN_HEADER,
    ArtifactFormat,
    ArtifactKind,
    ArtifactManifest,
    DeltaOffer,
    DeploymentOrder,
    KeyTransitions,
)
from interfaces.messages import DesiredBody, envelope
from interfaces.ranges import RangeNotSatisfiable, parse_byte_range
from tests.edge.support import ThrowawayCA, enrol_node, free_port
from tests.support import wait_for

NODE = "nd-edge7"
DEVICE = "dev-a"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HubArtefacts:
    """The hub's artefact routes: content and deltas with Range, checking tokens; ways to misbehave."""

    def __init__(self, signing: SigningKey) -> None:
        self.signing = signing
        self.blobs: dict[str, bytes] = {}  # artifact id -> content
        self.deltas: dict[tuple[str, str], bytes] = {}  # (artifact id, base sha) -> patch
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.drop_after: int | None = None  # the next content answer breaks off after this many bytes
        self.wrong_bytes: bytes | None = None  # served instead of the blob, under the blob's ETag
        self.delay_s = 0.0
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                split = urlsplit(self.path)
                with hub.lock:
                    hub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                if split.path == "/api/v1/signing-key.pub":
                    self.reply(200, hub.signing.public_pem.encode(), "application/x-pem-file")
                    return
                if split.path == "/api/v1/signing-key/transitions":
                    chain = KeyTransitions(current_key_id=hub.signing.key_id, transitions=list(hub.signing.transitions))
                    self.reply(200, chain.model_dump_json().encode(), "application/json")
                    return
                match = re.match(r"^/api/v1/artifacts/([^/]+)/(content|delta)$", split.path)
                if match is None:
                    self.problem(404, "not_found")
                    return
                artifact_id, route = match.groups()
                time.sleep(hub.delay_s)
                try:
                    hub.signing.verify_download_token(self.headers.get(DOWNLOAD_TOKEN_HEADER, ""), artifact_id)
                except ValueError:
                    self.problem(401, "invalid_download_token")
                    return
                if route == "content":
                    data = hub.blobs.get(artifact_id)
                else:
                    data = hub.deltas.get((artifact_id, parse_qs(split.query).get("from", [""])[0]))
                if data is None:
                    self.problem(404, "not_found")
                    return
                self.send_range(data)

            def send_range(self, data: bytes) -> None:
                etag, body, status, extra = f'"{sha(data)}"', data, 200, {}
                if hub.wrong_bytes is not None:
                    body = hub.wrong_bytes
                wanted = self.headers.get("range")
                if wanted:
                    first = int(wanted.removeprefix("bytes=").split("-")[0])
                    status, body = 206, body[first:]
                    extra = {"Content-Range": f"bytes {first}-{len(data) - 1}/{len(data)}"}
                self.send_response(status)
                for name, value in {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **extra}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if hub.drop_after is not None:
                    cut, hub.drop_after = hub.drop_after, None
                    self.wfile.write(body[:cut])
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def problem(self, status: int, code: str) -> None:
                document = {"type": f"urn:aisynergy:error:{code}", "title": code, "status": status, "code": code}
                self.reply(status, json.dumps(document).encode(), "application/problem+json")

            def reply(self, status: int, body: bytes, media_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.handler, self.port, self.running = Handler, 0, False
        self.start()

    def start(self) -> None:
        """Listen; after :meth:`stop`, on the same port again (the hub is back)."""
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.running = True

    def token(self, artifact_id: str, ttl_s: int = 600, device: str = DEVICE, base: str | None = None) -> str:
        return self.signing.issue_download_token(artifact_id, sha(self.blobs[artifact_id]), device, ttl_s, base_sha256=base)

    def fetches(self, route: str = "/content") -> list[dict[str, str]]:
        return [headers for path, headers in self.requests if urlsplit(path).path.endswith(route)]

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def signing(tmp_path: Path) -> SigningKey:
    return SigningKey.load_or_create(tmp_path / "hub-pki")


@pytest.fixture
def hub(signing: SigningKey) -> Iterator[HubArtefacts]:
    stand_in = HubArtefacts(signing)
    stand_in.blobs = {"art-1": os.urandom(300_000), "art-2": b"second artefact " * 64}
    yield stand_in
    stand_in.stop()


class Edge:
    """An edge's device listener with its artefact cache."""

    def __init__(self, cache: ArtifactCache, hub_url: str) -> None:
        self.cache = cache
        ca, node = ThrowawayCA.create(), IdentityStore(cache.root.parent / "listener-identity")
        node.save(ca.issue(node.make_csr(NODE), NODE), hub_url)  # the listener serves HTTPS with the node's certificate
        self.proxy = EnrolmentProxy(
            ("127.0.0.1", 0), hub_url=hub_url, node_id=NODE, device_mqtt_url="mqtts://gw:8883", on_enrolled=lambda d: None,
            tls=server_context(node.cert_path, node.key_path), ca_pem=ca.pem, artifacts=cache,
        )  # fmt: skip
        self.proxy.start()
        self.base = "https://{}:{}".format(*self.proxy.address)
        self.device_tls = ssl.create_default_context(cadata=ca.pem)  # a device trusts the hub CA ...
        self.node_id = NODE

    def get(self, path: str, token: str | None, method: str = "GET", **headers: str) -> httpx.Response:
        if token is not None:
            headers[DOWNLOAD_TOKEN_HEADER] = token
        with httpx.Client(verify=self.device_tls, timeout=20) as client:  # ... and checks its edge's node id
            return client.request(method, self.base + path, headers=headers, extensions={"sni_hostname": NODE})

    def content(self, artifact_id: str, token: str | None, **headers: str) -> httpx.Response:
        return self.get(f"/api/v1/artifacts/{artifact_id}/content", token, **headers)

    def close(self) -> None:
        self.proxy.close()
        self.cache.close()


def make_edge(tmp_path: Path, hub: HubArtefacts, signing: SigningKey | None, **options: Any) -> Edge:
    key = signing.public_key if signing is not None else None
    return Edge(ArtifactCache(tmp_path / "edge" / "artifacts", hub_url=hub.url, signing_key=key, **options), hub.url)


@pytest.fixture
def edge(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> Iterator[Edge]:
    running = make_edge(tmp_path, hub, signing)
    yield running
    running.close()


def cached(cache: ArtifactCache) -> set[str]:
    return {p.name for p in cache.root.iterdir() if p.is_file()}


def test_a_device_gets_the_exact_bytes_and_then_from_the_cache_while_the_hub_is_gone(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data, token = hub.blobs["art-1"], hub.token("art-1")

    # Execute
    first = edge.content("art-1", token)
    hub.stop()
    second = edge.content("art-1", token)

    # Assert
    assert first.status_code == 200, first.text
    assert first.content == data and second.content == data
    assert second.status_code == 200
    assert (second.headers["etag"], second.headers["accept-ranges"], second.headers["content-length"]) == (f'"{sha(data)}"', "bytes", str(len(data)))
    assert len(hub.fetches()) == 1
    assert hub.fetches()[0][DOWNLOAD_TOKEN_HEADER.lower()] == token
    assert cached(edge.cache) == {sha(data)}
    assert (edge.cache.root / sha(data)).read_bytes() == data


def test_a_range_of_thousands_of_digits_is_416_and_leaves_the_entry_free(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare: the blob cached
    token = hub.token("art-2")
    assert edge.content("art-2", token).status_code == 200

    # Execute
    beyond = edge.content("art-2", token, Range="bytes=" + "9" * 5000 + "-")
    to_the_end = edge.content("art-2", token, Range="bytes=0-" + "9" * 5000)

    # Assert: an answer, and no request keeps the blob pinned (it could not be evicted or repaired again)
    assert (beyond.status_code, beyond.json()["code"]) == (416, "range_not_satisfiable")
    assert (to_the_end.status_code, to_the_end.content) == (206, hub.blobs["art-2"])
    assert to_the_end.headers["x-content-type-options"] == "nosniff"
    assert sum(edge.cache.store.pins.values()) == 0


def test_range_requests_are_served_from_the_cache(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data, token = hub.blobs["art-2"], hub.token("art-2")
    assert edge.content("art-2", token).status_code == 200
    hub.stop()
    size = len(data)

    # Execute
    middle = edge.content("art-2", token, Range="bytes=10-19")
    suffix = edge.content("art-2", token, Range="bytes=-7")
    open_ended = edge.content("art-2", token, Range=f"bytes={size - 3}-")
    beyond = edge.content("art-2", token, Range=f"bytes={size}-")
    stale = edge.content("art-2", token, Range="bytes=0-3", **{"If-Range": '"' + "0" * 64 + '"'})
    head = edge.get("/api/v1/artifacts/art-2/content", token, method="HEAD", Range="bytes=0-99")

    # Assert
    assert (middle.status_code, middle.content, middle.headers["content-range"]) == (206, data[10:20], f"bytes 10-19/{size}")
    assert (suffix.status_code, suffix.content) == (206, data[-7:])
    assert (open_ended.status_code, open_ended.content) == (206, data[-3:])
    assert (beyond.status_code, beyond.headers["content-range"], beyond.json()["code"]) == (416, f"bytes */{size}", "range_not_satisfiable")
    assert (stale.status_code, stale.content) == (200, data)
    assert (head.status_code, head.content, head.headers["content-length"]) == (206, b"", "100")


@pytest.mark.parametrize("kind", ["forged", "expired", "other_artefact", "missing", "garbage"])
def test_a_bad_token_is_401_and_nothing_is_fetched(tmp_path: Path, hub: HubArtefacts, edge: Edge, kind: str) -> None:
    # Prepare
    tokens = {
        "forged": lambda: SigningKey.load_or_create(tmp_path / "other-pki").issue_download_token("art-1", sha(hub.blobs["art-1"]), DEVICE, 600),
        "expired": lambda: hub.token("art-1", ttl_s=-10),
        "other_artefact": lambda: hub.token("art-2"),
        "missing": lambda: None,
        "garbage": lambda: "not.a-token",
    }
    token = tokens[kind]()

    # Execute
    response = edge.content("art-1", token)

    # Assert
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["code"] == "invalid_download_token"
    assert hub.requests == []
    assert cached(edge.cache) == set()


def test_a_transfer_broken_half_way_is_resumed_with_a_range_request(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data = hub.blobs["art-1"]
    hub.drop_after = 100_000

    # Execute
    response = edge.content("art-1", hub.token("art-1"))

    # Assert
    assert response.status_code == 200
    assert response.content == data
    fetches = hub.fetches()
    assert len(fetches) == 2
    assert "range" not in fetches[0]
    assert fetches[1]["range"] == "bytes=100000-"
    assert cached(edge.cache) == {sha(data)}
    assert sha((edge.cache.root / sha(data)).read_bytes()) == sha(data)


def test_a_partial_download_left_by_an_earlier_run_is_resumed(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data = hub.blobs["art-1"]
    (edge.cache.root / f"{sha(data)}.part").write_bytes(data[:12_345])

    # Execute
    response = edge.content("art-1", hub.token("art-1"))

    # Assert
    assert (response.status_code, response.content) == (200, data)
    assert [f.get("range") for f in hub.fetches()] == ["bytes=12345-"]
    assert cached(edge.cache) == {sha(data)}


def test_bytes_that_do_not_match_the_grant_are_502_and_not_cached(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    hub.wrong_bytes = b"x" * len(hub.blobs["art-2"])

    # Execute
    response = edge.content("art-2", hub.token("art-2"))
    again = edge.content("art-2", hub.token("art-2"))

    # Assert
    assert response.status_code == 502
    assert response.json()["code"] == "invalid_response"
    assert again.status_code == 502
    assert len(hub.fetches()) == 2  # nothing kept: the second request went to the hub again
    assert cached(edge.cache) == set()


def test_a_hub_offering_another_blob_is_502_before_any_download(hub: HubArtefacts, edge: Edge, signing: SigningKey) -> None:
    # Prepare: the token grants other bytes than the hub holds for this artefact
    token = signing.issue_download_token("art-2", sha(b"something else"), DEVICE, 600)

    # Execute
    response = edge.content("art-2", token)

    # Assert
    assert (response.status_code, response.json()["code"]) == (502, "invalid_response")
    assert cached(edge.cache) == set()


def test_concurrent_requests_for_one_blob_share_one_download(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    data, token = hub.blobs["art-1"], hub.token("art-1")
    hub.delay_s = 0.5

    # Execute
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: edge.content("art-1", token), range(8)))

    # Assert
    assert [r.status_code for r in responses] == [200] * 8
    assert all(r.content == data for r in responses)
    assert len(hub.fetches()) == 1


def test_hub_down_and_not_cached_is_503(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    token = hub.token("art-1")
    hub.stop()

    # Execute
    response = edge.content("art-1", token)

    # Assert
    assert response.status_code == 503
    assert response.json()["code"] == "hub_unreachable"
    assert cached(edge.cache) == set()


def test_the_least_recently_used_blob_is_evicted_to_keep_the_budget(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> None:
    # Prepare
    hub.blobs = {name: os.urandom(1000) for name in ("a", "b", "c")}
    running = make_edge(tmp_path, hub, signing, budget_bytes=2500)
    try:
        for name in ("a", "b"):
            assert running.content(name, hub.token(name)).status_code == 200
            time.sleep(0.01)
        assert running.content("a", hub.token("a")).status_code == 200  # a is now more recent than b
        time.sleep(0.01)

        # Execute
        response = running.content("c", hub.token("c"))

        # Assert
        assert response.status_code == 200 and response.content == hub.blobs["c"]
        assert cached(running.cache) == {sha(hub.blobs["a"]), sha(hub.blobs["c"])}
        assert running.cache.usage() <= 2500
    finally:
        running.close()


def test_deltas_are_fetched_once_and_an_unknown_delta_is_404(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    base = sha(b"version 1")
    patch = b"BSDIFF40 patch bytes " * 20
    hub.deltas[("art-2", base)] = patch
    token = hub.token("art-2", base=base)
    path = f"/api/v1/artifacts/art-2/delta?from={base}"

    # Execute
    unknown = edge.get(f"/api/v1/artifacts/art-2/delta?from={'1' * 64}", hub.token("art-2", base="1" * 64))
    first = edge.get(path, token)
    hub.stop()
    second = edge.get(path, token)
    ranged = edge.get(path, token, Range="bytes=0-7")

    # Assert
    assert (unknown.status_code, unknown.json()["code"]) == (404, "not_found")
    assert (first.status_code, first.content, first.headers["content-type"]) == (200, patch, DELTA_MEDIA_TYPE)
    assert (second.status_code, second.content, second.headers["etag"]) == (200, patch, f'"{sha(patch)}"')
    assert (ranged.status_code, ranged.content) == (206, patch[:8])
    assert len(hub.fetches("/delta")) == 2
    assert cached(edge.cache) == {sha(patch)}


def order_for(hub: HubArtefacts, artifact_id: str, delta: DeltaOffer | None = None) -> DeploymentOrder:
    data = hub.blobs[artifact_id]
    manifest = ArtifactManifest(
        name="model", version="1.0.0", kind=ArtifactKind.MODEL, format=ArtifactFormat.ONNX,
        sha256=sha(data), size=len(data), created_at=datetime.now(UTC),
    )
    return DeploymentOrder(
        execution_id="ex-1",
        deployment_id="dp-1",
        artifact_id=artifact_id,
        signed_manifest=hub.signing.sign_manifest(manifest),
        path=f"/artifacts/{artifact_id}/content",
        token=hub.token(artifact_id, base=delta.base_sha256 if delta else None),
        delta=delta,
    )


def test_prefetch_lets_devices_download_after_the_hub_is_gone(hub: HubArtefacts, edge: Edge) -> None:
    # Prepare
    base, patch = sha(b"version 1"), b"a patch " * 10
    hub.deltas[("art-1", base)] = patch
    offer = DeltaOffer(base_sha256=base, sha256=sha(patch), size=len(patch), path=f"/artifacts/art-1/delta?from={base}")
    order = order_for(hub, "art-1", offer)

    # Execute
    future = edge.cache.prefetch(order)
    assert future is not None
    future.result(timeout=20)
    hub.stop()
    content = edge.content("art-1", order.token)
    delta = edge.get(f"/api/v1/artifacts/art-1/delta?from={base}", order.token)

    # Assert
    assert (content.status_code, content.content) == (200, hub.blobs["art-1"])
    assert (delta.status_code, delta.content) == (200, patch)
    assert cached(edge.cache) == {sha(hub.blobs["art-1"]), sha(patch)}


class FakeLink:
    def __init__(self) -> None:
        self.routes: dict[str, Any] = {}
        self.published: list[tuple[str, bytes]] = []
        self.connected = asyncio.Event()

    def route(self, topic: Any, handler: Any, **fixed: str) -> None:
        self.routes[topic.pattern] = handler

    def during_session(self, task: Any) -> None:
        pass

    async def publish(self, topic: str, payload: bytes, **kwargs: Any) -> None:
        self.published.append((topic, payload))


def test_the_relay_hands_deployment_orders_to_prefetch(tmp_path: Path, hub: HubArtefacts) -> None:
    # Prepare
    orders: list[DeploymentOrder] = []
    store = EdgeStore(tmp_path / "edge.db")
    link = FakeLink()
    relay = DeviceRelay(NODE, store, link, link, prefetch=orders.append)  # type: ignore[arg-type]
    order = order_for(hub, "art-2")
    document = envelope("hub", DesiredBody(version=3, deployments=[order], deployments_version=1)).model_dump_json().encode()
    message = SimpleNamespace(payload=document, topic=SimpleNamespace(value=f"synergy/v1/nodes/{NODE}/devices/{DEVICE}/desired"))

    async def deliver() -> None:
        await relay._on_relay_desired(None, message, {"device_id": DEVICE})  # type: ignore[arg-type]
        await relay.close()  # the relay's desired writer stores and relays what the handler handed it

    # Execute
    try:
        asyncio.run(deliver())
    finally:
        store.close()

    # Assert
    assert orders == [order]
    assert [topic for topic, _ in link.published] == [f"synergy/v1/devices/{DEVICE}/desired"]


def test_an_identity_without_a_signing_key_fetches_and_pins_it_once(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> None:
    # Prepare
    identity = IdentityStore(tmp_path / "node")
    cache = ArtifactCache(identity.data_dir / "artifacts", hub_url=hub.url, pin_signing_key=identity.pin_signing_key)
    running = Edge(cache, hub.url)
    try:
        # Execute
        first = running.content("art-2", hub.token("art-2"))
        second = running.content("art-1", hub.token("art-1"))
    finally:
        running.close()

    # Assert
    assert (first.status_code, second.status_code) == (200, 200)
    assert [path for path, _ in hub.requests].count("/api/v1/signing-key.pub") == 1
    assert identity.signing_key_path.read_text() == signing.public_pem
    assert identity.load_signing_key() is not None


def test_no_signing_key_and_no_hub_is_503(tmp_path: Path) -> None:
    # Prepare
    cache = ArtifactCache(tmp_path / "artifacts", hub_url=f"http://127.0.0.1:{free_port()}")
    running = Edge(cache, cache.hub_url)
    try:
        # Execute
        response = running.content("art-1", "anything")
    finally:
        running.close()

    # Assert
    assert (response.status_code, response.json()["code"]) == (503, "hub_unreachable")


def test_the_enrolment_answer_s_signing_key_is_stored_with_the_identity(tmp_path: Path, test_ca: ThrowawayCA, signing: SigningKey) -> None:
    # Prepare
    store = IdentityStore(tmp_path / "node")
    issued = test_ca.issue(store.make_csr(NODE), NODE).model_copy(update={"signing_key_pem": signing.public_pem})

    # Execute
    store.save(issued, "http://hub")

    # Assert
    assert store.signing_key_path.read_text() == signing.public_pem
    loaded = store.load_signing_key()
    assert loaded is not None and loaded.public_bytes_raw() == signing.public_key.public_bytes_raw()


def test_other_methods_on_artefact_routes_are_405(edge: Edge) -> None:
    response = edge.get("/api/v1/artifacts/art-1/content", None, method="POST")

    assert (response.status_code, response.json()["code"]) == (405, "method_not_allowed")


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("bytes=0-9", (0, 9)),
        ("bytes=5-", (5, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=90-500", (90, 99)),
        ("bytes=100-", False),
        ("bytes=-0", False),
        ("bytes=9-3", None),
        ("bytes=0-1,5-6", None),
        ("items=0-1", None),
        ("bytes=a-b", None),
        ("bytes=" + "9" * 5000 + "-", False),  # beyond any content, not a ValueError from int()
        ("bytes=0-" + "9" * 5000, (0, 99)),
        ("bytes=-" + "9" * 5000, (0, 99)),
        ("bytes=" + "0" * 5000 + "7-8", (7, 8)),
        ("bytes=\u0661-\u0662", None),  # Arabic-Indic digits are no byte positions
    ],
)
def test_parse_range(header: str, expected: object) -> None:
    if expected is False:
        with pytest.raises(RangeNotSatisfiable):
            parse_byte_range(header, 100)
    else:
        assert parse_byte_range(header, 100) == expected


def test_parse_size() -> None:
    assert (parse_size("2GiB"), parse_size("500MB"), parse_size("1048576")) == (2 * 1024**3, 500 * 1000**2, 1048576)
    with pytest.raises(ValueError):
        parse_size("lots")


def test_waiters_see_the_hub_refusal_too(hub: HubArtefacts, edge: Edge, signing: SigningKey) -> None:
    # Prepare: an artefact the hub does not know, asked for by several devices at once
    token = signing.issue_download_token("art-9", sha(b"gone"), DEVICE, 600)
    hub.delay_s = 0.3

    # Execute
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: edge.content("art-9", token), range(4)))

    # Assert
    assert [r.status_code for r in responses] == [404] * 4
    assert all(r.json()["code"] == "not_found" for r in responses)
    assert len(hub.fetches()) == 1


def test_the_agent_serves_artefacts_on_its_device_listener(tmp_path: Path, hub: HubArtefacts, signing: SigningKey, test_ca: ThrowawayCA) -> None:
    # Prepare: an enrolled node whose identity pinned the hub's signing key
    node_dir = tmp_path / "node"
    enrol_node(node_dir, test_ca, NODE, "mqtts://127.0.0.1:1", hub_url=hub.url).pin_signing_key(signing.public_pem)
    config = AgentConfig(
        node_id=NODE, mqtt_url="mqtts://127.0.0.1:1", data_dir=node_dir, device_listen=("127.0.0.1", 0), hub_url=hub.url, artifact_cache_bytes=10**6
    )
    agent = EdgeAgent(config)
    assert agent.proxy is not None and agent.artifacts is not None
    agent.proxy.start()
    try:
        # Execute
        url = "https://{}:{}/api/v1/artifacts/art-2/content".format(*agent.proxy.address)
        with httpx.Client(verify=ssl.create_default_context(cadata=test_ca.pem), timeout=20) as client:
            response = client.get(url, headers={DOWNLOAD_TOKEN_HEADER: hub.token("art-2")}, extensions={"sni_hostname": NODE})
    finally:
        agent.proxy.close()
        agent.artifacts.close()
        agent.store.close()

    # Assert
    assert (response.status_code, response.content) == (200, hub.blobs["art-2"])
    assert (node_dir / "artifacts" / sha(hub.blobs["art-2"])).read_bytes() == hub.blobs["art-2"]
    assert agent.artifacts.store.budget_bytes == 10**6
    assert [path for path, _ in hub.requests] == ["/api/v1/artifacts/art-2/content"]  # the key was not fetched


def test_a_bad_cache_size_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(edge_cli, ["run", "--node-id", NODE, "--data-dir", str(tmp_path), "--artifact-cache-size", "lots"])

    assert result.exit_code == 2
    assert "--artifact-cache-size" in result.output


# ---- a rotation of the hub's signing key -----------------------------------------------------------------


def test_once_the_hub_announces_a_rotated_key_the_edge_serves_tokens_it_signed_and_pins_it(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> None:
    # Prepare: an edge that pins the first key; the hub rotates (its key object follows the files)
    first = signing.key_id
    pinned: list[str] = []
    running = Edge(ArtifactCache(tmp_path / "edge" / "artifacts", hub_url=hub.url, signing_key=signing.public_key, pin_signing_key=pinned.append), hub.url)
    try:
        old_token = hub.token("art-2")  # signed by the first key, before the rotation
        rotate(tmp_path / "hub-pki")
        token = hub.token("art-1")  # signed by the new key
        assert signing.key_id != first

        # Execute + Assert: before the hub says so, the edge does not know the key and asks nobody
        refused = running.content("art-1", token)
        assert refused.status_code == 401 and hub.requests == []

        # Execute: the hub's retained state names its new key
        running.cache.hub_signing_key(signing.key_id)
        wait_for(lambda: bool(pinned), 10, what="the edge pinning the new key")
        served = running.content("art-1", token)

        # Assert: it followed the hand-over once, pinned both keys, and serves the token
        assert served.status_code == 200, served.text
        assert served.content == hub.blobs["art-1"]
        assert TrustedKeys.from_pem(pinned[-1]).ids() == [signing.key_id, first]
        assert [path for path, _ in hub.requests].count("/api/v1/signing-key/transitions") == 1
        # a token the old key signed (issued before the rotation, still unexpired) is still served
        assert running.content("art-2", old_token).status_code == 200
    finally:
        running.close()


def test_a_forged_token_makes_no_request_to_the_hub_when_the_announced_key_is_pinned(tmp_path: Path, hub: HubArtefacts, signing: SigningKey, edge: Edge) -> None:
    # Prepare: the hub announced the key the edge pins
    edge.cache.hub_signing_key(signing.key_id)
    forged = SigningKey.load_or_create(tmp_path / "other-pki").issue_download_token("art-1", sha(hub.blobs["art-1"]), DEVICE, 600)

    # Execute
    response = edge.content("art-1", forged)

    # Assert
    assert response.status_code == 401
    assert hub.requests == []


def test_a_hand_over_the_pinned_key_did_not_sign_is_not_followed(tmp_path: Path, hub: HubArtefacts, signing: SigningKey) -> None:
    # Prepare: the stand-in hub now serves another PKI's chain (a hub, or a man in the middle, that never had the
    # pinned key) and announces its key
    pinned: list[str] = []
    running = Edge(ArtifactCache(tmp_path / "edge" / "artifacts", hub_url=hub.url, signing_key=signing.public_key, pin_signing_key=pinned.append), hub.url)
    try:
        impostor = SigningKey.load_or_create(tmp_path / "impostor-pki")
        rotate(tmp_path / "impostor-pki")
        hub.signing = impostor
        token = hub.token("art-1")

        # Execute
        running.cache.hub_signing_key(impostor.key_id)
        wait_for(lambda: any(p == "/api/v1/signing-key/transitions" for p, _ in hub.requests), 10, what="the edge asking for the chain")
        response = running.content("art-1", token)

        # Assert
        assert response.status_code == 401
        assert pinned == []
    finally:
        running.close()

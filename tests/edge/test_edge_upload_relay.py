"""The edge's relay of the chunked upload API for its devices (edge/upload_relay.py): a device that trained publishes
through the edge's HTTPS listener with its publish grant and the artefact is stored at the hub; any other credential
stops at the edge; the hub's refusals pass through; an unreachable hub is 503."""

from __future__ import annotations

import hashlib
import os
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from device.upload import UploadRefused, upload_artifact
from edge.enrol_proxy import EnrolmentProxy, server_context
from edge.identity import IdentityStore
from edge.upload_relay import UploadRelay
from interfaces.auth import Role
from interfaces.uploads import PublishClaims
from tests.edge.support import ThrowawayCA
from tests.hub.conftest import HubUnderTest, hub_settings, running_hub
from tests.hub.live import serve
from tests.support import free_port

NODE = "nd-relay1"
CHUNK = 64 * 1024


class Listener:
    """An edge's device listener (HTTPS with the node's certificate) relaying uploads to ``hub_url``."""

    def __init__(self, root: Path, hub_url: str) -> None:
        ca, node = ThrowawayCA.create(), IdentityStore(root / "identity")
        node.save(ca.issue(node.make_csr(NODE), NODE), hub_url)
        self.relay = UploadRelay(hub_url, timeout_s=10)
        self.proxy = EnrolmentProxy(
            ("127.0.0.1", 0), hub_url=hub_url, node_id=NODE, device_mqtt_url="mqtts://gw:8883", on_enrolled=lambda d: None,
            tls=server_context(node.cert_path, node.key_path), ca_pem=ca.pem, uploads=self.relay,
        )  # fmt: skip
        self.proxy.start()
        self.base = "https://{}:{}".format(*self.proxy.address)
        self.device_tls = ssl.create_default_context(cadata=ca.pem)

    def request(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        with httpx.Client(verify=self.device_tls, timeout=20) as client:
            return client.request(method, self.base + path, extensions={"sni_hostname": NODE}, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        self.proxy.close()


@pytest.fixture
def hub(sqlite_url: str, tmp_path: Path) -> Iterator[HubUnderTest]:
    yield from running_hub(hub_settings(tmp_path / "hub", sqlite_url, upload_chunk_bytes=CHUNK))


@pytest.fixture
def edge(hub: HubUnderTest, tmp_path: Path) -> Iterator[Listener]:
    with serve(hub.app) as url:
        listener = Listener(tmp_path / "edge", url)
        yield listener
        listener.close()


def grant(hub: HubUnderTest, names: list[str], version: str = "1.0.0") -> str:
    claims = PublishClaims(task_id="task-1", worker_id="wrk-1", target_id="dev-1", names=names, version=version, exp=int(time.time()) + 600)
    return hub.state.signing.issue_publish_token(claims)


def test_a_device_publishes_through_its_edge_with_its_grant(hub: HubUnderTest, edge: Listener, tmp_path: Path) -> None:
    # Prepare
    data = os.urandom(3 * CHUNK + 17)
    source = tmp_path / "model.onnx"
    source.write_bytes(data)

    # Execute
    artifact = upload_artifact(edge.base, grant(hub, ["trained"]), source, kind="model", name="trained", version="1.0.0", format="onnx",
                               verify=edge.device_tls, server_name=NODE, state_file=tmp_path / "upload.json")  # fmt: skip

    # Assert
    assert (artifact.sha256, artifact.size) == (hashlib.sha256(data).hexdigest(), len(data))
    assert hub.get(f"/artifacts/{artifact.id}/content").content == data
    assert edge.relay.forwarded == 1 + 4 + 1  # the session, four chunks, the commit


@pytest.mark.parametrize("credential", ["operator token", "none", "basic"])
def test_any_other_credential_stops_at_the_edge(hub: HubUnderTest, edge: Listener, credential: str) -> None:
    # Prepare
    headers = {"operator token": {"Authorization": f"Bearer {hub.tokens[Role.OPERATOR]}"}, "none": {},
               "basic": {"Authorization": "Basic YWRtaW46YWRtaW4="}}[credential]  # fmt: skip
    before = hub.snapshot()

    # Execute
    r = edge.request("POST", "/api/v1/artifacts/uploads", headers=headers, json={"kind": "model", "name": "x", "version": "1.0.0", "format": "onnx", "size": 10})

    # Assert
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    assert edge.relay.forwarded == 0 and hub.snapshot() == before


def test_the_hubs_refusal_passes_through(hub: HubUnderTest, edge: Listener, tmp_path: Path) -> None:
    # Prepare: a grant for other names
    source = tmp_path / "model.onnx"
    source.write_bytes(b"x" * 100)

    # Execute
    with pytest.raises(UploadRefused) as refused:
        upload_artifact(edge.base, grant(hub, ["other"]), source, kind="model", name="trained", version="1.0.0", format="onnx",
                        verify=edge.device_tls, server_name=NODE)  # fmt: skip

    # Assert
    assert refused.value.status == 403 and refused.value.problem["code"] == "forbidden"
    assert hub.snapshot()["artifact_uploads"] == []


def test_bad_requests_are_answered_at_the_edge(hub: HubUnderTest, edge: Listener) -> None:
    # Prepare
    bearer = {"Authorization": f"Bearer {grant(hub, ['trained'])}"}

    # Execute
    wrong_method = edge.request("PATCH", "/api/v1/artifacts/uploads/upl-1", headers=bearer)
    put_post = edge.request("POST", "/api/v1/artifacts/uploads/upl-1/chunks/0", headers=bearer, content=b"x")
    no_length = edge.request("PUT", "/api/v1/artifacts/uploads/upl-1/chunks/0", headers=bearer, content=iter([b"x"]))
    too_large = edge.request("POST", "/api/v1/artifacts/uploads", headers=bearer, content=b"{" + b" " * (64 * 1024) + b"}")
    get_with_body = edge.request("GET", "/api/v1/artifacts/uploads/upl-1", headers=bearer, content=b"{}")

    # Assert
    assert (wrong_method.status_code, put_post.status_code, no_length.status_code, too_large.status_code) == (405, 405, 411, 413)
    assert get_with_body.status_code == 400
    assert edge.relay.forwarded == 0


def test_an_unreachable_hub_is_503(hub: HubUnderTest, tmp_path: Path) -> None:
    # Prepare: a relay to a port nobody listens on
    listener = Listener(tmp_path / "edge", f"http://127.0.0.1:{free_port()}")
    try:
        # Execute
        r = listener.request("POST", "/api/v1/artifacts/uploads", headers={"Authorization": f"Bearer {grant(hub, ['trained'])}"},
                             json={"kind": "model", "name": "trained", "version": "1.0.0", "format": "onnx", "size": 10})  # fmt: skip
    finally:
        listener.close()

    # Assert
    assert r.status_code == 503 and r.json()["code"] == "hub_unreachable"

"""The edge's intake of devices' whole-model update files for hierarchical rounds (``edge.fl.UpdateIntake``): only a
grant the hub signed, unexpired, for a federated update of a round attempt, for a task whose aggregator opened an
inbox here, within its size; the file kept under the device's name and the grant's round attempt, its SHA-256
answered and checked again when the aggregator takes it."""

from __future__ import annotations

import hashlib
import io
import json
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from device.ota.verify import TrustedKeys
from edge.fl import UpdateIntake
from interfaces.tasks import fl_update_identity
from interfaces.uploads import PublishClaims, encode_publish_token, publish_signing_bytes

HUB_KEY = Ed25519PrivateKey.generate()


def grant(task: str = "task-1", device: str = "dev-1", version: str = "3.1", key: Ed25519PrivateKey = HUB_KEY, exp: float | None = None,
          names: list[str] | None = None) -> str:  # fmt: skip
    name, _ = fl_update_identity(task, device, 1, 1)
    claims = PublishClaims(task_id=task, worker_id="wk-1", target_id=device, names=names or [name], version=version, exp=int(exp or time.time() + 600))
    return encode_publish_token(claims, key.sign(publish_signing_bytes(claims)))


def put(intake: UpdateIntake, token: str, body: bytes, length: int | None = None) -> tuple[int, dict]:  # type: ignore[type-arg]
    headers = {"authorization": f"Bearer {token}", "content-length": str(len(body) if length is None else length)}
    answer = intake.receive("PUT", headers, io.BytesIO(body))
    return answer.status, json.loads(answer.body)


@pytest.fixture
def intake(tmp_path: Path) -> UpdateIntake:
    intake = UpdateIntake()
    intake.keys = lambda: TrustedKeys([HUB_KEY.public_key()])
    intake.open("task-1", tmp_path / "inbox", max_bytes=1000)
    return intake


def test_a_device_file_is_kept_under_its_round_attempt_and_taken_by_its_sha256(intake: UpdateIntake, tmp_path: Path) -> None:
    body = b"\x01" * 600
    status, answer = put(intake, grant(), body)
    assert status == 201 and answer == {"id": hashlib.sha256(body).hexdigest(), "size": 600}
    kept = intake.take("task-1", "dev-1", 3, 1, answer["id"])
    assert kept is not None and kept.path == tmp_path / "inbox" / "dev-1.r3.a1.safetensors" and kept.path.read_bytes() == body
    assert intake.take("task-1", "dev-1", 3, 1, "0" * 64) is None  # another file than the one named
    assert intake.take("task-1", "dev-1", 3, 2, answer["id"]) is None  # another attempt
    intake.forget_before("task-1", 3, 2)
    assert intake.take("task-1", "dev-1", 3, 1, answer["id"]) is None and not kept.path.exists()


def test_what_is_refused_is_not_kept(intake: UpdateIntake, tmp_path: Path) -> None:
    forged = grant(key=Ed25519PrivateKey.generate())
    cases = [
        ("no grant", {"authorization": "Bearer op-token", "content-length": "3"}, 401),
        ("forged", {"authorization": f"Bearer {forged}", "content-length": "3"}, 401),
        ("expired", {"authorization": f"Bearer {grant(exp=time.time() - 5)}", "content-length": "3"}, 401),
        ("another model", {"authorization": f"Bearer {grant(names=['digits-parameters'])}", "content-length": "3"}, 403),
        ("not a round attempt", {"authorization": f"Bearer {grant(version='1.0.0')}", "content-length": "3"}, 403),
        ("no aggregator of the task here", {"authorization": f"Bearer {grant(task='task-2')}", "content-length": "3"}, 503),
        ("no length", {"authorization": f"Bearer {grant()}"}, 411),
        ("too large", {"authorization": f"Bearer {grant()}", "content-length": "1001"}, 413),
    ]
    for what, headers, status in cases:
        answer = intake.receive("PUT", headers, io.BytesIO(b"abc"))
        assert answer.status == status and answer.close, (what, answer)
        assert json.loads(answer.body)["status"] == status
    assert intake.receive("POST", {}, io.BytesIO(b"")).status == 405
    # a body shorter than its length: nothing kept
    status, _ = put(intake, grant(), b"abc", length=10)
    assert status == 400
    assert list((tmp_path / "inbox").iterdir()) == []


def test_without_a_pinned_signing_key_the_device_is_asked_to_come_back(tmp_path: Path) -> None:
    intake = UpdateIntake()
    intake.keys = lambda: None
    intake.open("task-1", tmp_path / "inbox", max_bytes=1000)
    assert intake.receive("PUT", {"authorization": f"Bearer {grant()}", "content-length": "3"}, io.BytesIO(b"abc")).status == 503


def test_a_closed_inbox_takes_nothing_more_and_forgets_what_it_had(intake: UpdateIntake) -> None:
    status, answer = put(intake, grant(), b"xyz")
    assert status == 201
    intake.close("task-1")
    assert intake.take("task-1", "dev-1", 3, 1, answer["id"]) is None
    assert put(intake, grant(), b"xyz")[0] == 503

"""Property-based API testing: schemathesis generates requests from the COMMITTED interfaces/openapi.json.

Every operation gets positive (schema-conforming) and negative (schema-violating) cases, sent with an
admin token to the app in-process, on SQLite. Path ids are drawn half from the generator and half from
nodes and devices seeded beforehand, so that operations reach real rows and not only 404s. Assertions:
no 5xx (schemathesis' ``not_a_server_error``), and every 4xx is an RFC 9457 problem document.
Hypothesis runs derandomised: the same cases every run.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

import interfaces
from interfaces.auth import Role
from interfaces.errors import ERROR_TYPE_PREFIX, PROBLEM_MEDIA_TYPE, ErrorCode
from tests.hub.conftest import HubUnderTest

COMMITTED_SCHEMA = Path(interfaces.__file__).parent / "openapi.json"
EXAMPLES_PER_MODE = 20  # per operation and generation mode: 18 operations with inputs x 2 modes x 20 = 720
MIN_CASES = 500
# Deletions last, so that the seeded rows serve every other operation first.
METHOD_ORDER = {"get": 0, "post": 1, "put": 2, "patch": 3, "delete": 4}

SETTINGS = settings(
    max_examples=EXAMPLES_PER_MODE,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)


def _problem_errors(response: httpx.Response) -> list[str]:
    """Why an error response is not a proper problem document (empty if it is one)."""
    if response.status_code < 400:
        return []
    ctype = response.headers.get("content-type", "").split(";")[0]
    if ctype != PROBLEM_MEDIA_TYPE:
        return [f"content-type {ctype!r}"]
    try:
        doc = response.json()
    except json.JSONDecodeError:
        return ["body is not JSON"]
    out = []
    if doc.get("status") != response.status_code:
        out.append(f"status {doc.get('status')} != {response.status_code}")
    if doc.get("code") not in {c.value for c in ErrorCode}:
        out.append(f"unknown code {doc.get('code')!r}")
    elif doc.get("type") != ERROR_TYPE_PREFIX + doc["code"]:
        out.append(f"type {doc.get('type')!r}")
    if not doc.get("title"):
        out.append("no title")
    return out


def _send(client: httpx.Client, kwargs: dict[str, Any], auth: dict[str, str], sequence: int) -> httpx.Response:
    """A schemathesis request (requests-style keyword arguments) through the TestClient.

    Every case carries the admin token (negative generation also drops the security header; 401s are
    covered in test_api_errors) and a non-empty Idempotency-Key is made unique to the case: generated
    keys repeat ("0", "a", ...) and would otherwise replay or refuse instead of reaching the handler
    (replays are covered in test_idempotency).
    """
    headers = {**kwargs["headers"], **auth}
    if headers.get("Idempotency-Key"):
        headers["Idempotency-Key"] = f"{headers['Idempotency-Key']}.{sequence}"
    body: dict[str, Any] = {}
    if "json" in kwargs:
        body["json"] = kwargs["json"]
    data = kwargs.get("data")
    if isinstance(data, (bytes, str)):
        body["content"] = data
    elif data is not None:
        body["data"] = data
    if kwargs.get("files"):
        body["files"] = [_file_part(part) for part in kwargs["files"]]
    response = client.request(
        kwargs["method"], kwargs["url"], headers=headers, params=kwargs.get("params") or None,
        cookies=kwargs.get("cookies") or None, **body,
    )  # fmt: skip
    response.request.read()  # a multipart body is a stream: buffer it so that a failure can be reported with it
    return response


def _file_part(part: tuple[str, Any]) -> tuple[str, Any]:
    """A generated multipart part as httpx sends it: a non-text value (3515, None, ...) goes as its JSON text."""
    name, value = part
    if isinstance(value, tuple):
        filename, content, *rest = value
        if not isinstance(content, (bytes, str)):
            content = json.dumps(content)
        return name, (filename, content, *rest)
    return name, value if isinstance(value, (bytes, str)) else json.dumps(value)


def _seed(hub: HubUnderTest) -> dict[str, list[str]]:
    nodes = [hub.register(f"seed-{i}", {"zone": "a" if i % 2 else "b", "tier": "edge"})["node"]["id"] for i in range(4)]
    devices = [hub.add_device(nodes[i % 3], labels={"kind": "camera"})["id"] for i in range(6)]
    for device_id in devices[:3]:
        hub.request("PUT", f"/devices/{device_id}/twin", json={"desired": {"fps": 10}})
    hub.request("PUT", f"/nodes/{nodes[0]}/admin-state", json={"admin_state": "LOCKED"})
    return {"node_id": nodes, "device_id": devices}


def _strategy(operation: Any, mode: GenerationMode, seeded: dict[str, list[str]]) -> st.SearchStrategy[Any]:
    generated = operation.as_strategy(generation_mode=mode)
    names = [p for p in seeded if "{" + p + "}" in operation.path]
    if not names:
        return generated
    name = names[0]
    real = st.sampled_from(seeded[name]).flatmap(lambda value: operation.as_strategy(generation_mode=mode, path_parameters={name: value}))
    return st.one_of(generated, real)


def _has_inputs(operation: Any) -> bool:
    return bool(operation.path_parameters or operation.query or operation.headers or operation.body)


def _fuzz(hub: HubUnderTest, operation: Any, mode: GenerationMode, seeded: dict[str, list[str]], sent: Counter[str], statuses: Counter[int]) -> None:
    """Send ``EXAMPLES_PER_MODE`` generated cases of one operation; raise on the first bad response."""
    auth = hub.auth(Role.ADMIN)
    label = f"{operation.method.upper()} {operation.path}"

    @SETTINGS
    @given(case=_strategy(operation, mode, seeded))
    def run(case: Any) -> None:
        response = _send(hub.client, case.as_transport_kwargs(base_url=str(hub.client.base_url)), auth, sum(sent.values()))
        sent[label] += 1
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])
        problems = _problem_errors(response)
        assert not problems, f"{case.method} {response.request.url} -> {response.status_code}: {problems}: {response.text[:300]}"

    run()


def test_generated_requests_never_cause_server_errors(sqlite_hub: HubUnderTest) -> None:
    # Prepare
    hub = sqlite_hub
    seeded = _seed(hub)
    schema = schemathesis.openapi.from_path(COMMITTED_SCHEMA)
    operations = sorted((r.ok() for r in schema.get_all_operations()), key=lambda op: (METHOD_ORDER[op.method], op.path))
    sent: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[str] = []

    # Execute
    for operation in operations:
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if _has_inputs(operation) else [GenerationMode.POSITIVE]
        for mode in modes:
            try:
                _fuzz(hub, operation, mode, seeded, sent, statuses)
            except Exception as exc:  # noqa: BLE001 - report every operation's failure, not just the first
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}")

    # Assert
    assert not failures, "\n\n".join(failures)
    assert sum(sent.values()) >= MIN_CASES, sent
    assert len(sent) == len(operations), {f"{op.method.upper()} {op.path}" for op in operations} - set(sent)
    assert any(200 <= s < 300 for s in statuses), statuses  # not everything was refused
    assert statuses[404] < sum(sent.values()) / 2, statuses  # the seeded rows were reached

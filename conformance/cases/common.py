"""What many cases need: a fresh simulated edge (removed afterwards), status polling, the sweep."""

from __future__ import annotations

from itertools import count
from typing import Any

from conformance.agents import Endpoint, SimEdge
from conformance.hub import RUN_LABEL, Target
from conformance.runner import Check
from interfaces.nodes import DeviceStatus, NodeStatus

_names = count(1)
PATIENCE_S = 60.0
"""how long a case waits for what must happen without a documented bound (a busy machine is slow, not wrong)"""


def new_edge(check: Check, start: bool = True, labels: dict[str, str] | None = None) -> SimEdge:
    """Register, enrol and (``start``) connect a simulated edge; deleted after the case."""
    target = check.target
    edge = SimEdge.register(target, f"conf-{target.run_id}-{next(_names)}", labels)
    check.cleanup(f"delete node {edge.node_id}", lambda: _delete(target, f"/nodes/{edge.node_id}"))
    check.cleanup(f"stop node {edge.node_id}", edge.stop)
    if start:
        edge.start()
        wait_node(check, edge.node_id, "ONLINE", PATIENCE_S)
    return edge


def new_device(check: Check, edge: SimEdge, online: bool = True, labels: dict[str, str] | None = None) -> Endpoint:
    ep = edge.add_device(f"conf-{check.target.run_id}-d{next(_names)}", labels)
    check.cleanup(f"delete device {ep.ident}", lambda: _delete(check.target, f"/devices/{ep.ident}"))
    if online:
        edge.device_online(ep)
        wait_device(check, ep.ident, "ONLINE", PATIENCE_S)
    return ep


def _delete(target: Target, path: str) -> None:
    r = target.call("DELETE", path)
    if r.status_code not in (200, 202, 204, 404, 410):
        raise RuntimeError(f"DELETE {path}: HTTP {r.status_code} {r.text[:200]}")


def node_status(target: Target, node_id: str) -> NodeStatus:
    return target.ok("GET", f"/nodes/{node_id}/status", NodeStatus)  # type: ignore[no-any-return]


def device_status(target: Target, device_id: str) -> DeviceStatus:
    return target.ok("GET", f"/devices/{device_id}/status", DeviceStatus)  # type: ignore[no-any-return]


def wait_node(check: Check, node_id: str, state: str, timeout: float) -> NodeStatus:
    return check.wait(lambda: (s := node_status(check.target, node_id)).state == state and s, timeout, f"node {node_id} {state}")  # type: ignore[no-any-return]


def wait_device(check: Check, device_id: str, state: str, timeout: float) -> DeviceStatus:
    return check.wait(lambda: (s := device_status(check.target, device_id)).state == state and s, timeout, f"device {device_id} {state}")  # type: ignore[no-any-return]


def items(target: Target, path: str, **params: Any) -> list[dict[str, Any]]:
    """Every item of a paged list (follows next_cursor)."""
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = target.ok("GET", path, params={**params, **({"cursor": cursor} if cursor else {})})
        out += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return out


def sweep(target: Target) -> list[str]:
    """Delete every device and node this run made that a case left behind; what could not be removed."""
    problems = []
    selector = f"{RUN_LABEL}={target.run_id}"
    for path in ("/devices", "/nodes"):
        try:
            for item in items(target, path, selector=selector):
                r = target.call("DELETE", f"{path}/{item['id']}")
                if r.status_code not in (200, 202, 204, 404, 410):
                    problems.append(f"DELETE {path}/{item['id']}: HTTP {r.status_code}")
        except Exception as exc:  # noqa: BLE001 - report, never mask the run's verdicts
            problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return problems

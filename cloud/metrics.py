"""Prometheus metrics of the hub: ``GET /metrics`` (text exposition format, a viewer token).

Nothing is counted on the request path. At scrape time ``HubCollector`` reads

* gauges from the database, one grouped ``COUNT`` per table in a short-lived session:
  ``aisynergy_tasks{state,type}``, ``aisynergy_task_workers{state}``, ``aisynergy_nodes{state,admin_state}``,
  ``aisynergy_devices{state}``, ``aisynergy_deployments{state}``, ``aisynergy_executions{state}``; every state
  the contract knows is exported (0 when no row has it), so a series does not vanish when its count drops to 0;
* counters from memory, one per key of the components' ``counters`` dicts: ``aisynergy_mqtt_*_total`` (the MQTT
  bridge, when it runs), ``aisynergy_ingest_*_total``, ``aisynergy_rollout_*_total``, ``aisynergy_scheduler_*_total``
  (the task scheduler, when there is one); they start at 0 when this hub process starts, and a key that was never
  incremented may be absent. Plus ``aisynergy_mqtt_connected`` and ``aisynergy_ingest_backlog`` gauges.

Scrape config for Prometheus::

    - job_name: aisynergy
      authorization: {type: Bearer, credentials_file: /etc/prometheus/aisynergy.token}
      static_configs: [{targets: ["hub:8000"]}]
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from enum import StrEnum
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from sqlalchemy import func, select
from sqlmodel import Session

from cloud.api.deps import Viewer
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import HubState, hub_state

PREFIX = "aisynergy"
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")
_REGISTRY_LOCK = threading.Lock()


def _known(enum: type[StrEnum]) -> list[str]:
    return [member.value for member in enum]


def _snapshot(counters: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a counters dict that another thread may be adding keys to."""
    for _ in range(5):
        try:
            return dict(counters)
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return {}


def _counter_families(component: str, counters: Mapping[str, Any], what: str) -> Iterator[Metric]:
    for key, value in sorted(_snapshot(counters).items()):
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        name = f"{PREFIX}_{component}_{_NAME_BAD.sub('_', str(key))}"
        yield CounterMetricFamily(name, f"{what}: {key} (since this hub process started)", value=value)


class HubCollector:
    """A prometheus_client custom collector over one hub's database and in-memory counters."""

    def __init__(self, state: HubState) -> None:
        self.state = state

    def describe(self) -> Iterable[Metric]:
        return []  # names are not fixed up front (counter keys appear as they are first incremented)

    def collect(self) -> Iterator[Metric]:
        state = self.state
        with Session(state.engine) as session:
            yield from self._gauges(session)
        if state.bridge is not None:
            yield GaugeMetricFamily(f"{PREFIX}_mqtt_connected", "1 while the hub's MQTT bridge is connected to the broker", value=int(state.bridge.connected.is_set()))
            yield from _counter_families("mqtt", state.bridge.counters, "MQTT bridge")
        yield GaugeMetricFamily(f"{PREFIX}_ingest_backlog", "status reports buffered in memory, not yet written to the database", value=state.ingest.backlog)
        yield from _counter_families("ingest", state.ingest.counters, "status ingest")
        yield from _counter_families("rollout", state.rollout.counters, "rollout controller")
        yield from _counter_families("scheduler", state.scheduler.counters, "task scheduler")

    def _gauges(self, session: Session) -> Iterator[Metric]:
        from cloud import tables
        from interfaces.deployments import DeploymentState, ExecutionState
        from interfaces.lifecycle import AdminState, NodeState

        node_states = _known(NodeState)
        yield _grouped(session, tables.Node, "nodes", "nodes by lifecycle state and admin state (deleted ones in DELETED)",
                       {"state": node_states, "admin_state": _known(AdminState)})  # fmt: skip
        yield _grouped(session, tables.Device, "devices", "devices by lifecycle state (deleted ones in DELETED)", {"state": node_states})
        yield _grouped(session, tables.Deployment, "deployments", "deployments by state", {"state": _known(DeploymentState)})
        yield _grouped(session, tables.Execution, "executions", "deployment executions (one per target) by state", {"state": _known(ExecutionState)})
        task, worker = getattr(tables, "Task", None), getattr(tables, "TaskWorker", None)  # the task tables may not exist yet
        if task is not None or worker is not None:
            from interfaces.tasks import TaskState, TaskType, WorkerState

            if task is not None:
                yield _grouped(session, task, "tasks", "tasks by state and type", {"state": _known(TaskState), "type": _known(TaskType)})
            if worker is not None:
                yield _grouped(session, worker, "task_workers", "task workers by state", {"state": _known(WorkerState)})


def _grouped(session: Session, table: Any, name: str, documentation: str, labels: dict[str, list[str]]) -> GaugeMetricFamily:
    """``SELECT label..., COUNT(*) FROM table GROUP BY label...`` as a gauge; known label values with no rows are 0."""
    columns = [getattr(table, label) for label in labels]
    counts: dict[tuple[str, ...], int] = {}
    for *values, count in session.execute(select(*columns, func.count()).group_by(*columns)):
        counts[tuple("" if v is None else str(v) for v in values)] = int(count)
    combos: list[tuple[str, ...]] = [()]
    for known in labels.values():
        combos = [(*combo, value) for combo in combos for value in known]
    for combo in combos:
        counts.setdefault(combo, 0)
    family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=list(labels))
    for combo, count in sorted(counts.items()):
        family.add_metric(list(combo), count)
    return family


def registry_for(app: FastAPI) -> CollectorRegistry:
    """The app's own registry (made on first use) holding its ``HubCollector``: no process-global state."""
    state = hub_state(app)
    registry = state.metrics_registry
    if registry is None:
        with _REGISTRY_LOCK:
            registry = state.metrics_registry
            if registry is None:
                registry = CollectorRegistry(auto_describe=False)
                registry.register(HubCollector(state))
                state.metrics_registry = registry
    return registry


def metrics_router() -> APIRouter:
    """``GET /metrics``, to include at the app's root (beside /healthz, outside the API prefix)."""
    router = APIRouter(tags=["meta"])

    @router.get(
        "/metrics", response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text exposition format"},
                   **{status: PROBLEM_RESPONSES[status] for status in (401, 403)}},
    )  # fmt: skip
    def metrics(request: Request, _: Viewer) -> Response:
        """Prometheus metrics: tasks, task workers, nodes, devices, deployments and executions per state (read from
        the database at scrape time), and the counters of the MQTT bridge, ingest, rollout and scheduler."""
        encoder, content_type = choose_encoder(request.headers.get("accept"))  # the text format a Prometheus of any age asks for
        return Response(encoder(registry_for(request.app)), media_type=content_type)

    return router

"""The hub's shared state: one typed object per app, made by the app's lifespan (cloud/api/app.py) and read by the
routes, the dependencies and the metrics through ``hub_state(request)`` or ``hub_state(app)``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CollectorRegistry
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.requests import HTTPConnection

from cloud.artifacts import BlobStore
from cloud.auth import TokenCache
from cloud.bridge import MqttBridge
from cloud.config import Settings
from cloud.ingest import StatusIngest
from cloud.pki import CertificateAuthority
from cloud.rollout import RolloutController
from cloud.scheduler import TaskController
from cloud.signing import SigningKey

if TYPE_CHECKING:
    from cloud.api.routes.tasks import StreamSlots


@dataclass(eq=False)
class HubState:
    """What the hub's parts share while the app runs.

    Set by the lifespan of ``create_app`` once the database is migrated, before the first request:

    * ``settings``: the hub's configuration, as ``create_app`` was given it;
    * ``engine``: the database engine (disposed when the app stops);
    * ``token_cache``: recently verified bearer tokens (``require(role)`` in cloud/api/deps.py);
    * ``ca``: the hub CA that signs node and broker certificates and publishes the CRL;
    * ``signing``: the key that signs artefacts, orders and download tokens;
    * ``blobs``: the artefacts' bytes, content-addressed;
    * ``ingest``: the buffer of status reports from the bridge, flushed to the database in the background;
    * ``rollout`` and ``scheduler``: the controllers the deployment and task loops tick;
    * ``wake_scheduler``: starts the scheduler loop's next tick now (thread-safe; tests replace it to keep the
      loop still);
    * ``bridge``: the MQTT bridge, None when the hub runs without MQTT (``enable_mqtt`` false).

    Made on first use, one per app, by their readers:

    * ``allowed_methods``: each API path's pattern and methods, for the Allow header of a 405 (cloud/api/problems.py);
    * ``log_stream_slots``: the log streams each token holds open (cloud/api/routes/tasks.py);
    * ``metrics_registry``: the Prometheus registry behind GET /metrics (cloud/metrics.py).
    """

    settings: Settings
    engine: Engine
    token_cache: TokenCache
    ca: CertificateAuthority
    signing: SigningKey
    blobs: BlobStore
    ingest: StatusIngest
    rollout: RolloutController
    scheduler: TaskController
    wake_scheduler: Callable[[], None]
    bridge: MqttBridge | None = None
    allowed_methods: list[tuple[re.Pattern[str], set[str]]] | None = None
    log_stream_slots: StreamSlots | None = None
    metrics_registry: CollectorRegistry | None = None


def attach(app: Starlette, state: HubState) -> None:
    """Make ``state`` the app's shared state (its lifespan does, at start)."""
    app.state.hub = state


def hub_state(where: HTTPConnection | Starlette) -> HubState:
    """The shared state of the app that serves this request (or of this app)."""
    app = where.app if isinstance(where, HTTPConnection) else where
    try:
        state = app.state.hub
    except AttributeError:
        raise RuntimeError("the hub app has no state yet: its lifespan has not run (serve the app, or enter a TestClient on it)") from None
    if not isinstance(state, HubState):
        raise TypeError(f"app.state.hub is a {type(state).__name__}, not a HubState")
    return state

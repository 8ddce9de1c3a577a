"""The hub application: REST API plus its background loops (MQTT bridge, ingest, liveness)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud import lease
from cloud import console
from cloud.api import problems, spec
from cloud.api.guards import ConditionalGet, IdempotentReplay, RequestGuard, SecurityHeaders, purge_idempotency, replay_response
from cloud.api.routes import artifacts, deployments, devices, nodes, privacy, tokens, uploads
from cloud.api.routes import tasks as task_routes
from cloud.api.state import HubState, attach, hub_state
from cloud.artifacts import FileBlobStore
from cloud.artifacts.uploads import UploadArea, purge_expired
from cloud.auth import TokenCache
from cloud.bridge import MqttBridge
from cloud.config import Settings
from cloud.db import make_engine, upgrade
from cloud.desired import DesiredPublisher
from cloud.filemodes import secure_data_dir
from cloud.ingest import StatusIngest
from cloud.liveness import mark_silent_nodes_offline
from cloud.metrics import metrics_router
from cloud.pki import CertificateAuthority
from cloud.rollout import RolloutController
from cloud.scheduler import TaskController
from cloud.services import revocation
from cloud.signing import SigningKey
from interfaces import API_PREFIX

log = logging.getLogger("aisynergy.hub")
VERSION = "0.1.0"


async def _in_thread(fn: Any, *args: Any) -> None:
    """Run a blocking ``fn`` in a worker thread. A cancel (the hub stopping) lets the run in hand end first: a
    thread cannot be stopped, and one still in a transaction after the engine is disposed keeps its connection
    open past the hub's end (and holds SQLite's files)."""
    running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await running
        raise


async def _every(interval_s: float, fn: Any, *args: Any) -> None:
    """Run a blocking ``fn`` in a worker thread every ``interval_s``; log and carry on on errors."""
    while True:
        try:
            await _in_thread(fn, *args)
        except Exception:  # noqa: BLE001 - a background loop must survive a bad tick
            log.exception("background task %s failed", getattr(fn, "__name__", fn))
        await asyncio.sleep(interval_s)


def _liveness_tick(engine: Engine, settings: Settings, holder: str) -> None:
    if lease.acquire(engine, "liveness", holder, ttl_s=max(5.0, 5 * settings.liveness_check_interval_s)):
        mark_silent_nodes_offline(engine, settings.offline_timeout_s, settings.offline_after_missed)


def _rollout_tick(engine: Engine, settings: Settings, holder: str, controller: RolloutController) -> None:
    if lease.acquire(engine, "rollout", holder, ttl_s=max(5.0, 5 * settings.rollout_interval_s)):
        controller.tick()


def _scheduler_tick(engine: Engine, settings: Settings, holder: str, controller: TaskController) -> None:
    if lease.acquire(engine, "scheduler", holder, ttl_s=max(5.0, 5 * settings.scheduler_interval_s)):
        controller.tick()


async def _every_or_woken(interval_s: float, wake: asyncio.Event, fn: Any, *args: Any) -> None:
    """Like ``_every``, but a set ``wake`` starts the next run at once."""
    while True:
        wake.clear()
        try:
            await _in_thread(fn, *args)
        except Exception:  # noqa: BLE001 - a background loop must survive a bad tick
            log.exception("background task %s failed", getattr(fn, "__name__", fn))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), interval_s)


def _housekeeping_tick(engine: Engine, settings: Settings, ca: CertificateAuthority) -> None:
    """At start and hourly: forget old idempotency records; sign the CRL again before it expires (an expired CRL
    makes the broker refuse every certificate of the fleet, and the hub's own); remove expired chunked uploads."""
    purge_idempotency(engine, settings.idempotency_ttl_s)
    with Session(engine) as session:
        revocation.publish_crl(session, ca)
    with Session(engine) as session:
        purge_expired(session, UploadArea(settings.data_dir / uploads.UPLOADS_DIR))


def _poke(state: HubState) -> None:
    if state.bridge is not None:
        state.bridge.poke_desired()


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    holder = f"{socket.gethostname()}:{os.getpid()}"

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        assert settings.database_url
        await asyncio.to_thread(secure_data_dir, settings.data_dir, settings.pki_dir, settings.data_dir / "artifacts")
        await asyncio.to_thread(upgrade, settings.database_url)
        engine = make_engine(settings.database_url)
        token_cache = TokenCache(settings.token_cache_ttl_s)
        ca = await asyncio.to_thread(CertificateAuthority.load_or_create, settings.pki_dir)
        signing = await asyncio.to_thread(SigningKey.load_or_create, settings.pki_dir)
        blobs = await asyncio.to_thread(FileBlobStore, settings.data_dir / "artifacts")
        ingest = StatusIngest(engine)
        wake, loop = asyncio.Event(), asyncio.get_running_loop()

        def wake_scheduler() -> None:
            loop.call_soon_threadsafe(wake.set)

        state = HubState(
            settings=settings, engine=engine, token_cache=token_cache, ca=ca, signing=signing, blobs=blobs, ingest=ingest,
            rollout=RolloutController(engine, signing, blobs, on_change=lambda: _poke(state)),
            scheduler=TaskController(engine, signing, on_change=lambda: _poke(state), blobs=blobs),
            wake_scheduler=wake_scheduler,
        )  # fmt: skip
        ingest.on_tasks_changed = state.wake_scheduler
        if settings.enable_mqtt:
            state.bridge = MqttBridge(settings.broker_url, settings.pki_dir, settings.mqtt_client_id, ingest, DesiredPublisher(engine))
            state.bridge.signing_key_id = lambda: state.signing.key_id
        attach(app, state)
        tasks = [
            asyncio.create_task(_every(settings.heartbeat_flush_interval_s, ingest.flush), name="ingest"),
            asyncio.create_task(_every(settings.liveness_check_interval_s, _liveness_tick, engine, settings, holder), name="liveness"),
            asyncio.create_task(_every(3600, _housekeeping_tick, engine, settings, ca), name="housekeeping"),
            asyncio.create_task(_every(settings.rollout_interval_s, _rollout_tick, engine, settings, holder, state.rollout), name="rollout"),
            asyncio.create_task(
                _every_or_woken(settings.scheduler_interval_s, wake, _scheduler_tick, engine, settings, holder, state.scheduler), name="scheduler",
            ),
        ]  # fmt: skip
        if state.bridge is not None:
            tasks.append(asyncio.create_task(state.bridge.run(), name="mqtt"))
        log.info("hub ready: database %s, broker %s", engine.url.render_as_string(hide_password=True), settings.broker_url)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await asyncio.to_thread(ingest.flush)
            engine.dispose()

    app = FastAPI(
        title="AISynergy hub",
        version=VERSION,
        summary="Cloud-edge-device collaboration interfaces (GB/T 45401.2 §8)",
        lifespan=lifespan,
    )
    problems.install(app)
    app.add_exception_handler(IdempotentReplay, replay_response)
    app.add_middleware(ConditionalGet, prefix=API_PREFIX)  # innermost: ETag / 304 on the API's JSON reads (a polling console)
    app.add_middleware(
        RequestGuard, engine=lambda: hub_state(app).engine, max_body_bytes=settings.max_body_bytes, streamed_uploads={API_PREFIX + "/artifacts"},
        streamed_chunks=uploads.STREAMED_CHUNKS,
    )  # fmt: skip
    app.add_middleware(problems.UnexpectedErrors)  # outside the guard: a failed request frees its Idempotency-Key first
    app.add_middleware(SecurityHeaders)  # outermost: on every response, the guard's refusals too

    api = APIRouter(prefix=API_PREFIX)
    api.include_router(nodes.router)
    api.include_router(devices.router)
    api.include_router(privacy.router)
    api.include_router(uploads.router)  # before artifacts: /artifacts/uploads/... is no artefact id
    api.include_router(artifacts.router)
    api.include_router(deployments.router)
    api.include_router(task_routes.router)
    api.include_router(tokens.router)

    @api.get("/ca.crt", response_class=Response, tags=["pki"], openapi_extra={"security": []}, responses=spec.pem_response("PEM"))
    def ca_certificate(request: Request) -> Response:
        """The hub CA certificate (PEM) that signs node and broker certificates."""
        return Response(hub_state(request).ca.ca_pem, media_type=spec.PEM_MEDIA_TYPE)

    app.include_router(api)
    app.include_router(metrics_router())  # GET /metrics beside /healthz (viewer token)
    spec.install(app)
    console.install(app)  # the web console at /console/ (static files; a client of the API above)

    @app.get("/healthz", tags=["meta"])
    def healthz(request: Request) -> dict[str, Any]:
        """Liveness of the hub, its database and its broker connection."""
        state = hub_state(request)
        with state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        bridge = state.bridge
        return {
            "status": "ok",
            "version": VERSION,
            "database": "ok",
            "mqtt": {"connected": bool(bridge and bridge.connected.is_set()), **(dict(bridge.counters) if bridge else {})},
            "ingest": {"backlog": state.ingest.backlog, **dict(state.ingest.counters)},
        }

    return app

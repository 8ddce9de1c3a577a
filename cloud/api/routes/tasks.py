"""Task run management: /tasks (DESIGN §4.3). The scheduler (cloud/scheduler.py) does the placing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from fastapi.sse import format_sse_event
from sqlmodel import Session

from cloud.api.deps import DEFAULT_PAGE, Cursor, IdempotencyKey, Limit, Operator, SessionDep, Viewer, poke_desired
from cloud.api import spec
from cloud.api.problems import PROBLEM_RESPONSES
from cloud.api.state import hub_state
from cloud.errors import NotFound, TooManyRequests
from cloud.services import task_watch
from cloud.services import tasks as service
from cloud.tables import ApiToken
from interfaces.pagination import Page
from interfaces.strict import INT64_MAX
from interfaces.tasks import TASK_FINAL, TaskAction, TaskCreateBody, TaskDetailBody, TaskLogLine, TaskMetrics, TaskOutputs, TaskPublicBody, TaskState, TaskType, WorkerPublic

router = APIRouter(prefix="/tasks", tags=["tasks"], responses=PROBLEM_RESPONSES)
SSE_MEDIA_TYPE = "text/event-stream"
SSE_KEEPALIVE_S = 15.0
SSE_BATCH = 500


def _wake(request: Request) -> None:
    hub_state(request).wake_scheduler()


@router.post("", status_code=status.HTTP_201_CREATED)
def create_task(body: TaskCreateBody, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskDetailBody:
    """Create a task; the scheduler places its workers at once (or when started, if ``start`` is false)."""
    state = hub_state(request)
    task = service.create(session, body, state.blobs, state.signing)
    _wake(request)
    return service.detail(session, task)


@router.get("")
def list_tasks(session: SessionDep, _: Viewer, state: TaskState | None = None, type: TaskType | None = None, limit: Limit = DEFAULT_PAGE,
               cursor: Cursor = None) -> Page[TaskPublicBody]:  # fmt: skip
    """List tasks, oldest first, optionally in one state or of one type."""
    rows, next_cursor = service.list_tasks(session, state, type, limit, cursor)
    return Page[TaskPublicBody](items=service.to_wire(session, rows), next_cursor=next_cursor)


@router.get("/{task_id}")
def get_task(task_id: str, session: SessionDep, _: Viewer) -> TaskDetailBody:
    """A task with its progress and its state history."""
    return service.detail(session, service.get(session, task_id))


@router.delete("/{task_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_task(request: Request, task_id: str, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> Response:
    """Remove a finished task with its workers, logs, metrics and outputs (409 illegal_transition while it is active)."""
    service.delete_task(session, task_id, hub_state(request).blobs)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _act(request: Request, session: Session, task_id: str, action: TaskAction) -> TaskPublicBody:
    task, orders = service.act(session, task_id, action)
    if orders:
        poke_desired(request)
    _wake(request)
    return service.to_wire(session, [task])[0]


@router.post("/{task_id}/start")
def start_task(task_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskPublicBody:
    """Let a task created with ``start: false`` be scheduled (409 illegal_transition otherwise)."""
    return _act(request, session, task_id, TaskAction.START)


@router.post("/{task_id}/stop")
def stop_task(task_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskPublicBody:
    """End an active task now: a service (``inference``) SUCCEEDS, a finite task is CANCELED; outputs so far are kept."""
    return _act(request, session, task_id, TaskAction.STOP)


@router.post("/{task_id}/pause")
def pause_task(task_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskPublicBody:
    """Workers finish the item in hand and wait (SCHEDULED or RUNNING only); the timeout clock stops."""
    return _act(request, session, task_id, TaskAction.PAUSE)


@router.post("/{task_id}/resume")
def resume_task(task_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskPublicBody:
    """Continue a PAUSED task."""
    return _act(request, session, task_id, TaskAction.RESUME)


@router.post("/{task_id}/cancel")
def cancel_task(task_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskPublicBody:
    """Cancel an active task: every active worker is CANCELED and its order withdrawn."""
    return _act(request, session, task_id, TaskAction.CANCEL)


@router.post("/{task_id}/retry")
def retry_task(task_id: str, request: Request, session: SessionDep, _: Operator, __: IdempotencyKey = None) -> TaskPublicBody:
    """Run a FAILED, CANCELED or TIMED_OUT task again (attempt + 1); finished chunks keep their outputs."""
    return _act(request, session, task_id, TaskAction.RETRY)


@router.get("/{task_id}/workers")
def list_workers(task_id: str, session: SessionDep, _: Viewer) -> list[WorkerPublic]:
    """Every worker the task had, in placement order, with its history."""
    return service.workers(session, task_id)


@router.get("/{task_id}/metrics")
def task_metrics(task_id: str, session: SessionDep, _: Viewer, series: bool = False, worker: str | None = Query(default=None, max_length=64)) -> TaskMetrics:
    """Each worker's latest metrics sample and their sums; ``series=true`` adds the samples in order (the last 1,000)."""
    return service.metrics(session, task_id, series, worker)


@router.get("/{task_id}/outputs")
def task_outputs(task_id: str, session: SessionDep, _: Viewer) -> TaskOutputs:
    """What the task produced: for a sharded task, the gathered outputs' tensors and whether every input has one."""
    return service.outputs(session, task_id)


@router.get("/{task_id}/outputs/content", response_class=Response, responses={200: spec.bytes_response("application/octet-stream", "a safetensors file")})
def task_outputs_content(task_id: str, session: SessionDep, _: Viewer) -> Response:
    """Every output in input order as one safetensors file (one tensor per model output); 409 while incomplete."""
    data = service.gather(session, task_id)
    return Response(data, media_type="application/octet-stream", headers={"Content-Disposition": f'attachment; filename="{task_id}-outputs.safetensors"'})


def _lines_and_state(engine: Any, task_id: str, after: int, limit: int) -> tuple[list[TaskLogLine], dict[str, Any] | None]:
    with Session(engine, expire_on_commit=False) as session:
        task = session.get(service.Task, task_id)
        if task is None:
            return [], None
        lines = service.log_lines(session, task_id, after, limit)
        snapshot = {"state": task.state, "reason": task.reason, "progress": service.progress(session, task).model_dump(mode="json")}
        return lines, snapshot


LogCursor = Annotated[int, Query(ge=0, le=INT64_MAX, description="only lines with a larger id")]
LastEventId = Annotated[int | None, Header(alias="Last-Event-ID", ge=0, le=INT64_MAX, description="the id of the last line a stream sent (an SSE reconnect): resume after it; wins over after")]


@router.get(
    "/{task_id}/logs",
    response_model=Page[TaskLogLine],
    responses={200: {"content": {SSE_MEDIA_TYPE: {"schema": {"type": "string"}, "example": 'event: log\nid: 42\ndata: {"id": 42, ...}\n\n'}},
                     "description": "a page of lines, or with Accept: text/event-stream a stream of them"},
               429: PROBLEM_RESPONSES[409] | {"description": "The token holds as many log streams as it may"}},
)  # fmt: skip
async def task_logs(
    task_id: str, request: Request, caller: Viewer, after: LogCursor = 0, limit: Limit = DEFAULT_PAGE,
    accept: Annotated[str | None, Header()] = None, last_event_id: LastEventId = None,
) -> Any:  # fmt: skip
    """The task's log lines (its workers' and the hub's), oldest first.

    Plain: one page after ``after``; ``next_cursor`` is the last line's id (pass it as ``after``), null when
    no more are stored yet. With ``Accept: text/event-stream``: Server-Sent Events, ``event: log`` per line
    (``id`` = the line id; reconnect with ``Last-Event-ID`` to resume), ``event: state`` when the task's
    state or progress changes, ``event: end`` once the task is final and every line was sent; a comment
    every 15 s keeps idle connections open. A token holds at most ``sse_streams_per_token`` streams at once
    (4 by default; 429 ``too_many_requests`` beyond). A stream checks its token again every ``sse_token_check_s``
    (5 s): once the token is revoked the stream ends with ``event: end`` (``state`` null). New lines written by
    this hub are sent at once; those another replica writes within ``sse_poll_s`` (2 s).
    """
    engine = hub_state(request).engine
    start = after if last_event_id is None else last_event_id
    lines, snapshot = await run_in_threadpool(_lines_and_state, engine, task_id, start, limit)
    if snapshot is None:
        raise NotFound(f"task {task_id} does not exist")
    if accept and SSE_MEDIA_TYPE in accept:
        settings = hub_state(request).settings
        slot = _stream_slots(request).take(caller.id, settings.sse_streams_per_token)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return _LogStream(_stream(request, engine, task_id, start, caller.id), slot, media_type=SSE_MEDIA_TYPE, headers=headers)
    next_cursor = str(lines[-1].id) if len(lines) == limit else None
    return Page[TaskLogLine](items=lines, next_cursor=next_cursor)


class StreamSlots:
    """The log streams each token holds open in this process."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def take(self, token_id: str, limit: int) -> Callable[[], None]:
        """A slot for one more stream of ``token_id`` (429 when it holds ``limit``); returns its release (idempotent)."""
        if self.open.get(token_id, 0) >= limit:
            raise TooManyRequests(f"this token holds {limit} log streams already; close one first", limit=limit)
        self.open[token_id] = self.open.get(token_id, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.open.get(token_id, 1) - 1
                if left > 0:
                    self.open[token_id] = left
                else:
                    self.open.pop(token_id, None)

        return release


def _stream_slots(request: Request) -> StreamSlots:
    state = hub_state(request)
    if state.log_stream_slots is None:  # one per app, made on the event loop's thread on first use
        state.log_stream_slots = StreamSlots()
    return state.log_stream_slots


class _LogStream(StreamingResponse):
    """A stream that gives its slot back and closes its generator however it ends (finished, disconnected, failed)."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._content, self._release = content, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as group:
                # a client gone is noticed at once, not at the stream's next write (ASGI 2.4 servers report it only then)
                group.start_soon(_until_disconnect, receive, group.cancel_scope)
                await super().__call__(scope, receive, send)
                group.cancel_scope.cancel()
        finally:
            self._release()
            with anyio.CancelScope(shield=True):
                await self._content.aclose()  # type: ignore[attr-defined]


async def _until_disconnect(receive: Any, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _token_valid(engine: Any, token_id: str) -> bool:
    with Session(engine) as session:
        row = session.get(ApiToken, token_id)
        return row is not None and row.revoked_at is None


async def _stream(request: Request, engine: Any, task_id: str, after: int, token_id: str) -> AsyncIterator[str]:
    """The stream's events. It reads the database when woken (a change of the task committed in this process), at
    the latest every ``sse_poll_s``; it checks its token every ``sse_token_check_s`` (no read of the lines)."""
    settings = hub_state(request).settings
    last_state: dict[str, Any] | None = None
    now = time.monotonic()
    last_sent, next_check, next_poll = now, now + settings.sse_token_check_s, now + settings.sse_poll_s
    changes = task_watch.watch(engine)
    waiter = changes.subscribe(task_id)
    try:
        yield format_sse_event(comment="aisynergy task log", retry=2000)
        read = True
        while True:
            if read:
                lines, snapshot = await run_in_threadpool(_lines_and_state, engine, task_id, after, SSE_BATCH)
                for line in lines:
                    yield format_sse_event(event="log", id=str(line.id), data_str=line.model_dump_json())
                    after = line.id
                if snapshot is None:  # deleted while streaming
                    yield format_sse_event(event="end", data_str='{"state": null, "reason": "the task was deleted"}')
                    return
                if snapshot != last_state:
                    yield format_sse_event(event="state", data_str=_json(snapshot))
                    last_state = snapshot
                    last_sent = time.monotonic()
                if lines:
                    last_sent = time.monotonic()
                    if len(lines) == SSE_BATCH:
                        continue
                if not lines and TaskState(snapshot["state"]) in TASK_FINAL:
                    yield format_sse_event(event="end", data_str=_json(snapshot))
                    return
            if await request.is_disconnected():
                return
            now = time.monotonic()
            if now >= next_check:
                if not await run_in_threadpool(_token_valid, engine, token_id):
                    yield format_sse_event(event="end", data_str='{"state": null, "reason": "the bearer token is no longer valid"}')
                    return
                next_check = time.monotonic() + settings.sse_token_check_s
            if now - last_sent > SSE_KEEPALIVE_S:
                yield format_sse_event(comment="keepalive")
                last_sent = now
            woken = await waiter.wait(max(0.0, min(next_poll, next_check, last_sent + SSE_KEEPALIVE_S) - time.monotonic()))
            read = woken or time.monotonic() >= next_poll
            if read:
                next_poll = time.monotonic() + settings.sse_poll_s
    finally:
        changes.unsubscribe(task_id, waiter)


def _json(doc: dict[str, Any]) -> str:
    import json

    return json.dumps(doc, separators=(",", ":"))

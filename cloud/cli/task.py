"""``aisynergy task``: AI tasks over the hub's REST API (DESIGN §4.3, interfaces/tasks.py).

    aisynergy task create --type batch_inference --model detector:1.2.0 --inputs frames.npy --chunk-size 32 \\
        --selector zone=a --max-nodes 4 --watch
    aisynergy task create --type inference --model detector --nodes --accelerator gpu:1:inference --duration 1h
    aisynergy task list --state RUNNING
    aisynergy task logs -f task-...          # live log lines (Server-Sent Events) until the task is final
    aisynergy task outputs task-... --out outputs.safetensors

Human-readable output by default; ``--json`` prints the hub's documents (``logs --json``: one log line a line).
A problem document from the hub is printed as one line, as ``aisynergy deploy`` does. ``create --watch`` and
``watch`` exit 0 when the task SUCCEEDED, 1 otherwise.

Everything the commands compute is in plain functions (``build_task_body``, ``SSEDecoder``, ``follow``,
``upload_inputs``, ...) so tests call them without the command line.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import httpx
from pydantic import ValidationError

from cloud.cli.deploy import _Hub, _problem_line, hub_options
from interfaces import API_PREFIX
from interfaces.pagination import MAX_LIMIT
from interfaces.tasks import TASK_TYPES, TaskAction, TaskCreate, TaskState, TaskType, WorkerState

FINAL = frozenset(s.value for s in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELED, TaskState.TIMED_OUT))
SSE_MEDIA_TYPE = "text/event-stream"
INPUT_FORMATS = {".npy": "npy", ".safetensors": "safetensors"}
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# which command-line flag sets a field, for error messages
_FLAG_OF = {
    "spec.model": "--model", "spec.inputs": "--inputs", "spec.chunk_size": "--chunk-size", "spec.input_name": "--input-name",
    "spec.duration_s": "--duration", "placement.selector": "--selector", "placement.ids": "--ids", "placement.min_nodes": "--min-nodes",
    "placement.max_nodes": "--max-nodes", "placement.accelerators": "--accelerator", "timeout_s": "--timeout",
    "worker_timeout_s": "--worker-timeout", "heartbeat_s": "--heartbeat", "retry.max_attempts": "--max-attempts",
    "retry.backoff_s": "--backoff", "name": "--name", "type": "--type",
}  # fmt: skip


# --- parsing the command line ----------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``1.5m``, ``2h``, ``1d``, ``500ms``."""
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(f"{text!r}: use seconds or a number with ms, s, m, h or d (90, 90s, 5m, 2h)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


class _Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


DURATION = _Duration()


def parse_model(text: str) -> dict[str, Any]:
    """``NAME`` or ``NAME:VERSION`` as a ``ModelRef`` document."""
    name, sep, version = text.partition(":")
    if not name or (sep and not version):
        raise click.BadParameter(f"{text!r}: use NAME or NAME:VERSION", param_hint="--model")
    return {"name": name, **({"version": version} if version else {})}


def parse_accelerator(text: str) -> dict[str, Any]:
    """``TYPE[:COUNT[:PURPOSE]]`` (``gpu``, ``gpu:2``, ``npu:1:inference``) as an ``AcceleratorRequest``."""
    parts = text.split(":")
    try:
        if 1 <= len(parts) <= 3 and parts[0]:
            request: dict[str, Any] = {"type": parts[0].lower()}
            if len(parts) >= 2:
                request["count"] = int(parts[1])
            if len(parts) == 3:
                if parts[2] not in ("training", "inference"):
                    raise ValueError(parts[2])
                request["purpose"] = parts[2]
            return request
    except ValueError:
        pass
    raise click.BadParameter(f"{text!r}: use TYPE[:COUNT[:training|inference]], e.g. gpu:2 or npu:1:inference", param_hint="--accelerator")


def load_spec(text: str | None) -> dict[str, Any]:
    """``--spec``: a JSON object, or ``@file.json``."""
    if text is None:
        return {}
    source = "--spec"
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--spec") from exc
        source = str(path)
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{source} is not JSON: {exc}", param_hint="--spec") from exc
    if not isinstance(spec, dict):
        raise click.BadParameter(f"{source} must be a JSON object", param_hint="--spec")
    return spec


def _split_ids(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_task_body(
    type: str, spec: dict[str, Any] | None = None, *, model: str | None = None, inputs: str | None = None, chunk_size: int | None = None,
    input_name: str | None = None, duration: float | None = None, selector: str | None = None, ids: str | list[str] | None = None,
    nodes: bool = False, min_nodes: int | None = None, max_nodes: int | None = None, accelerators: Iterable[str] = (),
    timeout: float | None = None, worker_timeout: float | None = None, heartbeat: float | None = None, max_attempts: int | None = None,
    backoff: float | None = None, hold: bool = False, name: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The ``TaskCreate`` body from the options of ``task create`` (``inputs``: the dataset artefact's id).

    The flags fill in (and override) keys of ``spec``; what is not given is left out, so the hub's defaults apply.
    The body is checked against ``TaskCreate`` and the type's spec model; a mistake is a ``click.UsageError``
    naming the flag.
    """
    spec = dict(spec or {})
    if model is not None:
        spec["model"] = parse_model(model)
    for key, value in (("inputs", inputs), ("chunk_size", chunk_size), ("input_name", input_name), ("duration_s", duration)):
        if value is not None:
            spec[key] = value
    placement: dict[str, Any] = {}
    if nodes:
        placement["target"] = "node"
    if selector is not None:
        placement["selector"] = selector
    if ids is not None:
        placement["ids"] = _split_ids(ids) if isinstance(ids, str) else list(ids)
    if min_nodes is not None:
        placement["min_nodes"] = min_nodes
    if max_nodes is not None:
        placement["max_nodes"] = max_nodes
    accelerator_list = [parse_accelerator(a) for a in accelerators]
    if accelerator_list:
        placement["accelerators"] = accelerator_list
    body: dict[str, Any] = {"type": type, "spec": spec}
    if name is not None:
        body["name"] = name
    if placement:
        body["placement"] = placement
    if timeout is not None:
        body["timeout_s"] = max(1, round(timeout))
    if worker_timeout is not None:
        body["worker_timeout_s"] = worker_timeout
    if heartbeat is not None:
        body["heartbeat_s"] = heartbeat
    retry: dict[str, Any] = {}
    if max_attempts is not None:
        retry["max_attempts"] = max_attempts
    if backoff is not None:
        retry["backoff_s"] = backoff
    if retry:
        body["retry"] = retry
    if hold:
        body["start"] = False
    check_task_body(body)
    return body


def check_task_body(body: dict[str, Any]) -> None:
    """``click.UsageError`` when ``body`` is not a valid ``TaskCreate`` (its spec checked by the type's model)."""
    problems: list[str] = []
    try:
        created = TaskCreate.model_validate(body)
    except ValidationError as exc:
        problems += [_error_line(e, ()) for e in exc.errors()]
    else:
        spec_model = TASK_TYPES[created.type].spec
        if spec_model is not None:
            try:
                spec_model.model_validate(created.spec)
            except ValidationError as exc:
                problems += [_error_line(e, ("spec",)) for e in exc.errors()]
    if problems:
        raise click.UsageError("the task is not valid: " + "; ".join(problems[:6]))


def _error_line(error: Any, prefix: tuple[str, ...]) -> str:
    loc = [*prefix, *(str(p) for p in error.get("loc", ()))]
    where = ".".join(loc) or "body"
    flag = next((f for key, f in _FLAG_OF.items() if where == key or where.startswith(key + ".")), None)
    msg = str(error.get("msg", "")).removeprefix("Value error, ")
    return f"{where}{f' ({flag})' if flag else ''}: {msg}"


# --- inputs: a dataset artefact --------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def input_format(path: Path) -> str:
    """``npy`` or ``safetensors`` by the file's suffix."""
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise click.BadParameter(f"{path.name}: inputs must be a .npy or .safetensors file", param_hint="--inputs")
    return fmt


def dataset_identity(path: Path) -> tuple[str, str, str, str]:
    """(name, version, format, sha256) under which ``path`` is uploaded: ``inputs-<16 hex of its SHA-256>``, ``1``."""
    fmt = input_format(path)
    sha256 = file_sha256(path)
    return f"inputs-{sha256[:16]}", "1", fmt, sha256


def upload_inputs(hub: _Hub, path: Path) -> tuple[str, bool]:
    """Upload ``path`` as a dataset artefact, or find the one uploaded before; returns (artifact id, reused).

    The same bytes always get the same name, so a second run (or a concurrent one: 409 ``artifact_exists``,
    which carries the stored id) reuses the stored artefact instead of uploading again.
    """
    name, version, fmt, sha256 = dataset_identity(path)
    page = hub.call("GET", "/artifacts", params={"kind": "dataset", "name": name, "limit": MAX_LIMIT})
    for item in page["items"]:
        if item["version"] == version:
            _check_same_bytes(item.get("sha256"), sha256, item["id"], name)
            return item["id"], True
    with path.open("rb") as stream:
        r = hub.request("POST", "/artifacts", data={"kind": "dataset", "name": name, "version": version, "format": fmt}, files={"file": (path.name, stream)})
    if r.status_code == 409:
        doc = _json_or_none(r)
        if isinstance(doc, dict) and doc.get("code") == "artifact_exists" and doc.get("artifact_id"):
            _check_same_bytes(doc.get("sha256"), sha256, doc["artifact_id"], name)
            return str(doc["artifact_id"]), True
    if r.status_code >= 400:
        raise click.ClickException(_problem_line(r))
    return str(r.json()["id"]), False


def _check_same_bytes(stored: str | None, local: str, artifact_id: str, name: str) -> None:
    if stored and stored != local:
        raise click.ClickException(f"dataset {name} version 1 ({artifact_id}) holds other bytes (sha256 {stored[:16]}...) than this file")


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


# --- Server-Sent Events ----------------------------------------------------------------------------


@dataclass
class SSEEvent:
    event: str
    data: str
    id: str
    """the last event id when the event was dispatched (it carries over from earlier events)"""
    retry_ms: int | None = None

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class SSEDecoder:
    """An incremental parser of ``text/event-stream`` (the WHATWG HTML "event stream interpretation").

    ``feed(bytes)`` returns the events completed so far. Lines end with CRLF, LF or CR (also split across
    chunks); a leading BOM is dropped; ``:`` lines are comments; ``field: value`` loses one leading space;
    ``data`` lines join with LF; an empty line dispatches (nothing when no data came); ``id`` sets the last event
    id (kept across events, ignored when it contains NUL), ``retry`` the reconnection delay in ms (digits only);
    an event not ended by an empty line when the stream closes is dropped.
    """

    last_event_id: str = ""
    retry_ms: int | None = None
    comments: int = 0
    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _has_data: bool = False
    _pending: str = ""
    _skip_lf: bool = False
    _started: bool = False
    _decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        text = self._decoder.decode(chunk)
        if not text:
            return []
        if not self._started:
            self._started = True
            text = text.removeprefix("\ufeff")
        events = []
        for line in self._lines(text):
            event = self.line(line)
            if event is not None:
                events.append(event)
        return events

    def _lines(self, text: str) -> Iterator[str]:
        start = 0
        if self._skip_lf:
            self._skip_lf = False
            if text.startswith("\n"):
                start = 1
        while True:
            cr, lf = text.find("\r", start), text.find("\n", start)
            ends = [i for i in (cr, lf) if i >= 0]
            if not ends:
                self._pending += text[start:]
                return
            end = min(ends)
            line, self._pending = self._pending + text[start:end], ""
            yield line
            start = end + 1
            if text[end] == "\r":
                if start < len(text):
                    if text[start] == "\n":
                        start += 1
                else:
                    self._skip_lf = True  # a CRLF may be split across two chunks

    def line(self, line: str) -> SSEEvent | None:
        """Process one line (without its end); the event it dispatches, if any."""
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            self.comments += 1
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "id":
            if "\0" not in value:
                self.last_event_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit():
                self.retry_ms = int(value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        event, data, has_data = self._event, self._data, self._has_data
        self._event, self._data, self._has_data = "", [], False
        if not has_data:
            return None
        return SSEEvent(event or "message", "\n".join(data), self.last_event_id, self.retry_ms)


def iter_sse(chunks: Iterable[bytes], decoder: SSEDecoder | None = None) -> Iterator[SSEEvent]:
    """The events of a byte stream."""
    decoder = decoder or SSEDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)


class StreamDropped(Exception):
    """The event stream ended or broke before its ``end`` event."""


@dataclass
class LogFollower:
    """Follows ``GET /tasks/{id}/logs`` as Server-Sent Events until ``end``; reconnects with ``Last-Event-ID``.

    ``on_log(line)`` gets every log line once, in order (lines sent again after a reconnection are skipped),
    ``on_state(doc)`` every state change. ``run()`` returns the data of the ``end`` event. A connection that
    fails or drops is retried after the server's ``retry`` delay (else ``delay_s``, doubling up to
    ``max_delay_s``); ``max_failures`` connections in a row that bring nothing end it with a ClickException.
    """

    hub: _Hub
    task_id: str
    on_log: Callable[[dict[str, Any]], None] = lambda line: None
    on_state: Callable[[dict[str, Any]], None] = lambda doc: None
    after: int | None = None
    read_timeout_s: float = 60.0
    """keepalives come every 15 s: a longer silence is a dead connection"""
    delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_failures: int = 8
    sleep: Callable[[float], None] = time.sleep
    last_event_id: str = ""
    last_line_id: int | None = None
    connections: int = 0

    def run(self) -> dict[str, Any]:
        if self.after is not None and self.last_line_id is None:
            self.last_line_id = self.after
        failures = 0
        delay = self.delay_s
        while True:
            retry_ms: int | None = None
            try:
                return self._connect()
            except StreamDropped as exc:
                progressed, retry_ms, why = exc.args
                if progressed:
                    failures, delay = 0, self.delay_s
                else:
                    failures += 1
                    if failures >= self.max_failures:
                        raise click.ClickException(f"lost the log stream of {self.task_id}: {why}") from None
            self.sleep(retry_ms / 1000 if retry_ms is not None else delay)
            if retry_ms is None:
                delay = min(self.max_delay_s, delay * 2)

    def _connect(self) -> dict[str, Any]:
        headers = {"Accept": SSE_MEDIA_TYPE, "Cache-Control": "no-cache"}
        params: dict[str, Any] = {}
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        elif self.after is not None:
            params["after"] = self.after
        decoder = SSEDecoder(last_event_id=self.last_event_id)
        progressed = False
        self.connections += 1
        url = f"{API_PREFIX}/tasks/{self.task_id}/logs"
        try:
            with self.hub.client.stream("GET", url, headers=self.hub.headers(headers), params=params, timeout=httpx.Timeout(30.0, read=self.read_timeout_s)) as r:
                if r.status_code >= 400:
                    r.read()
                    if r.status_code >= 500 or r.status_code == 429:
                        raise StreamDropped(False, None, _problem_line(r))
                    raise click.ClickException(_problem_line(r))
                media = r.headers.get("content-type", "").split(";")[0].strip()
                if media != SSE_MEDIA_TYPE:
                    raise click.ClickException(f"the hub answered {media or 'no content type'}, not an event stream: is it older than the task API?")
                for chunk in r.iter_bytes():
                    progressed = True
                    for event in decoder.feed(chunk):
                        if event.id:
                            self.last_event_id = event.id
                        done = self._handle(event)
                        if done is not None:
                            return done
        except httpx.HTTPError as exc:
            raise StreamDropped(progressed, decoder.retry_ms, f"{type(exc).__name__}: {exc}") from None
        finally:
            if decoder.last_event_id:
                self.last_event_id = decoder.last_event_id
        raise StreamDropped(progressed, decoder.retry_ms, "the hub closed the stream before the task ended")

    def _handle(self, event: SSEEvent) -> dict[str, Any] | None:
        try:
            data = event.json()
        except ValueError:
            return None  # not ours to understand
        if event.event == "log" and isinstance(data, dict):
            line_id = data.get("id")
            if isinstance(line_id, int):
                if self.last_line_id is not None and line_id <= self.last_line_id:
                    return None
                self.last_line_id = line_id
            self.on_log(data)
        elif event.event == "state" and isinstance(data, dict):
            self.on_state(data)
        elif event.event == "end":
            return data if isinstance(data, dict) else {"state": data}
        return None


# --- formatting ------------------------------------------------------------------------------------


def _when(value: str | None) -> str:
    if not value:
        return "-"
    try:
        return datetime.fromisoformat(value).strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return value


def format_log_line(line: dict[str, Any]) -> str:
    """``ts level [target] text``; the target is the worker's target, or ``hub`` for the scheduler's own lines."""
    target = line.get("target_id") or line.get("worker_id") or "hub"
    text = str(line.get("text", ""))
    if target == "hub":
        text = text.removeprefix("[hub] ")  # the hub may tag its own lines already
    return f"{line.get('ts', '')} {line.get('level', 'info'):<7} [{target}] {text}"


def workers_summary(workers: dict[str, int] | None) -> str:
    order = {s.value: i for i, s in enumerate(WorkerState)}
    items = sorted(((s, n) for s, n in (workers or {}).items() if n), key=lambda p: order.get(p[0], 99))
    return ", ".join(f"{state} {n}" for state, n in items) or "no workers"


def progress_summary(progress: dict[str, Any] | None) -> str:
    progress = progress or {}
    parts = []
    if progress.get("items_total") is not None:
        parts.append(f"{progress.get('items_done') or 0}/{progress['items_total']} items")
    if progress.get("chunks_total") is not None:
        parts.append(f"{progress.get('chunks_done') or 0}/{progress['chunks_total']} chunks")
    parts.append(workers_summary(progress.get("workers")))
    return ", ".join(parts)


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=200)  # a pipe or a test: no wrapping of ids
    return console


def _table(*columns: str) -> Any:
    from rich.table import Table

    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for column in table.columns:
        column.overflow = "fold"
    return table


def _print(console: Any, table: Any, title: str | None = None, first: bool = True) -> None:
    """A table, under a title line of its own (a table's title would wrap at the table's width)."""
    if not first:
        console.print()
    if title:
        console.print(title, style="bold", soft_wrap=True)
    console.print(table)


def _echo_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, ensure_ascii=False))


class TaskView:
    """The live display of one task: state, an items bar, workers per state, the latest log lines.

    Fed from the event stream (``task(doc)``, ``state(doc)``, ``log(line)``); rich's Live renders it from
    its own thread (``__rich__``), hence the lock.
    """

    def __init__(self, doc: dict[str, Any], lines: int = 8) -> None:
        self.lock = threading.Lock()
        self.doc = dict(doc)
        self.logs: deque[str] = deque(maxlen=lines)
        self.since = time.monotonic()

    def task(self, doc: dict[str, Any]) -> None:
        with self.lock:
            self.doc = dict(doc)

    def state(self, doc: dict[str, Any]) -> None:
        with self.lock:
            for key in ("state", "reason", "progress"):
                if key in doc:
                    self.doc[key] = doc[key]

    def log(self, line: dict[str, Any]) -> None:
        with self.lock:
            self.logs.append(format_log_line(line))

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self.lock:
            doc, logs = dict(self.doc), list(self.logs)
        state = str(doc.get("state", "?"))
        style = {"SUCCEEDED": "green", "FAILED": "red", "TIMED_OUT": "red", "CANCELED": "yellow", "PAUSED": "yellow"}.get(state, "cyan")
        head = Text.assemble((doc.get("id", ""), "bold"), "  ", doc.get("name") or "", "  ", str(doc.get("type", "")), "  ", (state, style))
        if doc.get("reason"):
            head.append(f"  {doc['reason']}", "dim")
        progress = doc.get("progress") or {}
        rows = Table.grid(padding=(0, 1))
        total, done = progress.get("items_total"), progress.get("items_done") or 0
        elapsed = time.monotonic() - self.since
        clock = f"{int(elapsed // 3600)}:{int(elapsed % 3600 // 60):02d}:{int(elapsed % 60):02d}"
        if total is not None:
            percent = f"{100 * done / total:.0f}%" if total else "-"
            chunks = f"  chunks {progress.get('chunks_done') or 0}/{progress['chunks_total']}" if progress.get("chunks_total") is not None else ""
            rows.add_row("items", ProgressBar(total=max(total, 1), completed=min(done, total) if total else 1, width=40), f"{done}/{total} {percent}{chunks}  {clock}")
        else:
            rows.add_row("elapsed", clock)
        rows.add_row("workers", workers_summary(progress.get("workers")))
        parts: list[Any] = [head, rows]
        if logs:
            parts.append(Text("\n".join(logs), "dim", overflow="ellipsis", no_wrap=True))
        return Group(*parts)


def watch_task(hub: _Hub, task_id: str, *, live: bool = True, follower: LogFollower | None = None) -> dict[str, Any]:
    """Follow the task's event stream until it is final (with a live display when ``live``); its final document."""
    view = TaskView(hub.call("GET", f"/tasks/{task_id}"))
    follower = follower or LogFollower(hub, task_id)
    follower.on_log, follower.on_state = view.log, view.state

    def follow() -> dict[str, Any]:
        view.state(follower.run())
        final: dict[str, Any] = hub.call("GET", f"/tasks/{task_id}")
        view.task(final)  # the last frame shows the final document
        return final

    if not live:
        return follow()
    from rich.live import Live

    console = _console()
    with Live(view, console=console, refresh_per_second=4, transient=False, vertical_overflow="visible" if not console.is_terminal else "ellipsis"):
        final = follow()
    if not console.is_terminal:
        console.line()  # Live ends its last frame with a new line only on a terminal
    return final


def _report_final(doc: dict[str, Any], as_json: bool) -> None:
    """Print the final task; exit 1 unless it SUCCEEDED."""
    if as_json:
        _echo_json(doc)
    else:
        click.echo(f"{doc['id']} {doc['state']}" + (f": {doc['reason']}" if doc.get("reason") else ""))
    if doc.get("state") != TaskState.SUCCEEDED.value:
        raise SystemExit(1)


# --- the commands ----------------------------------------------------------------------------------

_json_option = click.option("--json", "as_json", is_flag=True, help="print the hub's JSON documents")


@click.group()
@hub_options
@click.pass_context
def task(ctx: click.Context, hub_url: str, token: str | None, ca_file: Path | None) -> None:
    """AI tasks: create, watch, logs, metrics, outputs; start, stop, pause, resume, cancel, retry, delete."""
    if not isinstance(ctx.obj, _Hub):  # a test may hand in its own
        ctx.obj = _Hub(hub_url.rstrip("/"), token, ca_file)


@task.command()
@click.option("--type", "task_type", required=True, type=click.Choice([t.value for t in TaskType]), help="the task type")
@click.option("--spec", "spec_text", default=None, metavar="JSON|@FILE", help="the type's spec as JSON, or @file.json; the flags below fill in and override it")
@click.option("--model", default=None, metavar="NAME[:VERSION]", help="spec.model (any version when absent)")
@click.option("--inputs", default=None, metavar="FILE|ARTIFACT_ID", help="batch_inference: a .npy or .safetensors file, uploaded once as a dataset artefact (or the id of one)")
@click.option("--chunk-size", type=int, default=None, help="batch_inference: inputs per chunk")
@click.option("--input-name", default=None, help="batch_inference: the model input fed (and the tensor read from a safetensors dataset)")
@click.option("--duration", type=DURATION, default=None, help="inference, split_inference: how long to serve (90s, 30m, 2h); none: until stopped")
@click.option("--selector", default=None, help="targets by label selector, e.g. zone=a,tier!=x")
@click.option("--ids", default=None, help="targets by comma-separated ids")
@click.option("--nodes", is_flag=True, help="place on nodes (edges) instead of devices")
@click.option("--min-nodes", type=int, default=None, help="wait in PENDING until this many targets qualify")
@click.option("--max-nodes", type=int, default=None, help="use at most this many targets")
@click.option("--accelerator", "accelerators", multiple=True, metavar="TYPE[:COUNT[:PURPOSE]]", help="e.g. gpu:2 or gpu:1:training; repeatable, every one must be free on a target")
@click.option("--timeout", type=DURATION, default=None, help="running time before TIMED_OUT (paused time excluded)")
@click.option("--worker-timeout", type=DURATION, default=None, help="a worker silent this long is TIMED_OUT and its work rescheduled")
@click.option("--heartbeat", type=DURATION, default=None, help="how often a worker reports")
@click.option("--max-attempts", type=int, default=None, help="tries of one piece of work before the task FAILS")
@click.option("--backoff", type=DURATION, default=None, help="wait before the 2nd attempt (doubles each time)")
@click.option("--hold", is_flag=True, help="create it held in PENDING: 'aisynergy task start ID' lets it run")
@click.option("--name", default=None)
@click.option("--watch", is_flag=True, help="live progress until the task is final; exit 0 only if it SUCCEEDED")
@_json_option
@click.pass_obj
def create(hub: _Hub, task_type: str, spec_text: str | None, model: str | None, inputs: str | None, chunk_size: int | None, input_name: str | None,
           duration: float | None, selector: str | None, ids: str | None, nodes: bool, min_nodes: int | None, max_nodes: int | None,
           accelerators: tuple[str, ...], timeout: float | None, worker_timeout: float | None, heartbeat: float | None, max_attempts: int | None,
           backoff: float | None, hold: bool, name: str | None, watch: bool, as_json: bool) -> None:  # fmt: skip
    """Create a task (and start it, unless --hold)."""
    if ids is not None and selector is not None:
        raise click.UsageError("give at most one of --ids or --selector")
    options = dict(
        model=model, chunk_size=chunk_size, input_name=input_name, duration=duration, selector=selector, ids=ids, nodes=nodes, min_nodes=min_nodes,
        max_nodes=max_nodes, accelerators=accelerators, timeout=timeout, worker_timeout=worker_timeout, heartbeat=heartbeat, max_attempts=max_attempts,
        backoff=backoff, hold=hold, name=name,
    )  # fmt: skip
    spec = load_spec(spec_text)
    inputs_path = Path(inputs) if inputs is not None else None
    if inputs_path is not None and not inputs_path.is_file():
        if not inputs.startswith("art-"):  # type: ignore[union-attr]
            raise click.BadParameter(f"{inputs}: no such file (give a .npy or .safetensors file, or a dataset artefact id)", param_hint="--inputs")
        inputs_path = None
    # check everything before a possibly large upload
    body = build_task_body(task_type, spec, inputs=inputs if inputs_path is None else "art-to-upload", **options)  # type: ignore[arg-type]
    if inputs_path is not None:
        input_format(inputs_path)  # a wrong suffix fails before any request
        artifact_id, reused = upload_inputs(hub, inputs_path)
        click.echo(f"inputs: {'reusing' if reused else 'uploaded'} dataset {artifact_id}", err=True)
        body["spec"]["inputs"] = artifact_id
    doc = hub.call("POST", "/tasks", json=body)
    if as_json and not watch:
        _echo_json(doc)
        return
    if not as_json:
        click.echo(f"{doc['id']} {doc['state']}" + (" (held: aisynergy task start " + doc["id"] + ")" if doc.get("held") else ""))
    if watch:
        _report_final(watch_task(hub, doc["id"], live=not as_json), as_json)


@task.command()
@click.argument("task_id")
@_json_option
@click.pass_obj
def watch(hub: _Hub, task_id: str, as_json: bool) -> None:
    """Live progress until the task is final; exit 0 only if it SUCCEEDED."""
    _report_final(watch_task(hub, task_id, live=not as_json), as_json)


@task.command(name="list")
@click.option("--state", default=None, type=click.Choice([s.value for s in TaskState]))
@click.option("--type", "task_type", default=None, type=click.Choice([t.value for t in TaskType]))
@click.option("--limit", type=int, default=100, show_default=True, help="at most this many tasks (0: all)")
@_json_option
@click.pass_obj
def list_(hub: _Hub, state: str | None, task_type: str | None, limit: int, as_json: bool) -> None:
    """List tasks."""
    params = {k: v for k, v in (("state", state), ("type", task_type)) if v}
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page_size = MAX_LIMIT if not limit else min(MAX_LIMIT, limit - len(items))
        page = hub.call("GET", "/tasks", params={**params, "limit": page_size, **({"cursor": cursor} if cursor else {})})
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor or (limit and len(items) >= limit):
            break
    if as_json:
        _echo_json(items)
        return
    table = _table("ID", "NAME", "TYPE", "STATE", "PROGRESS", "CREATED")
    for t in items:
        table.add_row(t["id"], t.get("name") or "", t["type"], t["state"] + (" (held)" if t.get("held") else ""), progress_summary(t.get("progress")), _when(t.get("created_at")))
    _console().print(table)
    if cursor:
        click.echo("(more tasks: --limit 0 lists all)", err=True)


@task.command()
@click.argument("task_id")
@_json_option
@click.pass_obj
def get(hub: _Hub, task_id: str, as_json: bool) -> None:
    """Show a task: spec, placement, progress and its history."""
    doc = hub.call("GET", f"/tasks/{task_id}")
    if as_json:
        _echo_json(doc)
        return
    console = _console()
    about = _table("", "")
    about.show_header = False
    about.columns[0].style = "bold"
    retry = doc.get("retry") or {}
    for key, value in (
        ("name", doc.get("name") or "-"), ("type", doc["type"]), ("reason", doc.get("reason") or "-"),
        ("held", "yes (aisynergy task start)" if doc.get("held") else "no"), ("attempt", doc.get("attempt")),
        ("progress", progress_summary(doc.get("progress"))), ("spec", json.dumps(doc.get("spec", {}), ensure_ascii=False)),
        ("placement", json.dumps({k: v for k, v in (doc.get("placement") or {}).items() if v not in (None, [])}, ensure_ascii=False)),
        ("timeouts", f"task {doc.get('timeout_s') or 'none'} s, worker {doc.get('worker_timeout_s')} s, heartbeat {doc.get('heartbeat_s')} s"),
        ("retry", f"{retry.get('max_attempts')} attempts, backoff {retry.get('backoff_s')} s (max {retry.get('max_backoff_s')} s)"),
        ("created", _when(doc.get("created_at"))), ("started", _when(doc.get("started_at"))), ("finished", _when(doc.get("finished_at"))),
        ("deadline", _when(doc.get("deadline_at"))),
    ):  # fmt: skip
        about.add_row(key, str(value))
    _print(console, about, f"{doc['id']}  {doc['state']}")
    if doc.get("history"):
        history = _table("AT", "FROM", "TO", "REASON")
        for h in doc["history"]:
            history.add_row(_when(h.get("at")), h.get("from_state") or "-", h["to_state"], h.get("reason") or "")
        _print(console, history, "history", first=False)


@task.command()
@click.argument("task_id")
@_json_option
@click.pass_obj
def workers(hub: _Hub, task_id: str, as_json: bool) -> None:
    """List the task's workers (one per target, or per shard)."""
    items = hub.call("GET", f"/tasks/{task_id}/workers")
    if isinstance(items, dict):  # tolerate a page
        items = items.get("items", [])
    if as_json:
        _echo_json(items)
        return
    table = _table("WORKER", "TARGET", "ROLE", "STATE", "ATTEMPT", "ITEMS", "LAST REPORT", "DETAIL")
    for w in items:
        done, assigned = w.get("items_done"), w.get("items_assigned")
        share = "-" if done is None and assigned is None else f"{done or 0}/{assigned if assigned is not None else '?'}"
        table.add_row(w["id"], f"{w['target_kind']} {w['target_id']}", w.get("role", ""), w["state"], str(w.get("attempt", "")), share, _when(w.get("last_report_at")), w.get("detail") or "")
    _console().print(table)


@task.command()
@click.argument("task_id")
@click.option("-f", "--follow", is_flag=True, help="stream new lines until the task is final (reconnects on its own)")
@click.option("--after", type=int, default=None, help="only lines after this line id")
@click.option("--limit", type=int, default=0, help="without --follow: at most this many lines (0: all)")
@_json_option
@click.pass_obj
def logs(hub: _Hub, task_id: str, follow: bool, after: int | None, limit: int, as_json: bool) -> None:
    """Print the task's log lines as 'ts level [target] text' (--json: one TaskLogLine a line)."""
    emit = (lambda line: click.echo(json.dumps(line, ensure_ascii=False))) if as_json else (lambda line: click.echo(format_log_line(line)))
    if follow:
        def on_state(doc: dict[str, Any]) -> None:
            click.echo(f"-- {doc.get('state')}" + (f": {doc['reason']}" if doc.get("reason") else "") + f" ({progress_summary(doc.get('progress'))})", err=True)

        end = LogFollower(hub, task_id, on_log=emit, on_state=on_state, after=after).run()
        click.echo(f"-- {task_id} {end.get('state')}" + (f": {end['reason']}" if end.get("reason") else ""), err=True)
        return
    printed = 0
    cursor: Any = after
    while True:
        page_size = MAX_LIMIT if not limit else min(MAX_LIMIT, limit - printed)
        page = hub.call("GET", f"/tasks/{task_id}/logs", params={"limit": page_size, **({"after": cursor} if cursor is not None else {})})
        items = page["items"][: page_size]
        for line in items:
            emit(line)
        printed += len(items)
        next_cursor = page.get("next_cursor")
        if not next_cursor or not items or (limit and printed >= limit):
            return
        cursor = next_cursor


@task.command()
@click.argument("task_id")
@click.option("--series", is_flag=True, help="every sample in order, not only each worker's latest")
@click.option("--worker", "worker_id", default=None, help="only this worker's samples")
@_json_option
@click.pass_obj
def metrics(hub: _Hub, task_id: str, series: bool, worker_id: str | None, as_json: bool) -> None:
    """The task's metrics: totals over its workers, each worker's latest sample (--series: all)."""
    params: dict[str, Any] = {"series": "true" if series else "false", **({"worker": worker_id} if worker_id else {})}
    doc = hub.call("GET", f"/tasks/{task_id}/metrics", params=params)
    if as_json:
        _echo_json(doc)
        return
    console = _console()
    totals = _table("METRIC", "TOTAL")
    for key, value in sorted((doc.get("totals") or {}).items()):
        totals.add_row(key, _number(value))
    _print(console, totals, f"{doc['task_id']} totals")
    samples = _table("WORKER", "TARGET", "AT", "VALUES")
    for wid, s in sorted((doc.get("workers") or {}).items()):
        samples.add_row(wid, s.get("target_id", ""), _when(s.get("ts")), _values(s.get("values")))
    _print(console, samples, "latest sample per worker", first=False)
    if series:
        table = _table("AT", "WORKER", "VALUES")
        for s in doc.get("series") or []:
            table.add_row(_when(s.get("ts")), s.get("worker_id", ""), _values(s.get("values")))
        _print(console, table, "series", first=False)


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _values(values: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={_number(v)}" for k, v in sorted((values or {}).items()))


@task.command()
@click.argument("task_id")
@click.option("--out", "out", default=None, metavar="FILE", help="download the gathered outputs (one safetensors file); '-' for stdout")
@_json_option
@click.pass_obj
def outputs(hub: _Hub, task_id: str, out: str | None, as_json: bool) -> None:
    """What the task produced; --out FILE downloads the gathered outputs (refused while incomplete)."""
    if out is not None:
        size = download_outputs(hub, task_id, out)
        if out != "-":
            click.echo(f"{out}: {size} bytes", err=as_json)
        return
    doc = hub.call("GET", f"/tasks/{task_id}/outputs")
    if as_json:
        _echo_json(doc)
        return
    total = doc.get("items_total")
    click.echo(f"{doc['task_id']} {doc['state']}  {'complete' if doc.get('complete') else 'incomplete'}"
               + (f"  {doc.get('items_done') or 0}/{total} items" if total is not None else ""))  # fmt: skip
    if doc.get("tensors"):
        table = _table("TENSOR", "DTYPE", "SHAPE")
        for t in doc["tensors"]:
            table.add_row(t["name"], t["dtype"], "x".join(str(d) for d in t["shape"]) or "scalar")
        _console().print(table)
    for artifact_id in doc.get("artifacts") or []:
        click.echo(f"artifact {artifact_id}")
    if doc.get("content_url") and doc.get("complete"):
        click.echo(f"download: aisynergy task outputs {task_id} --out outputs.safetensors")


def download_outputs(hub: _Hub, task_id: str, out: str) -> int:
    """Stream ``GET /tasks/{id}/outputs/content`` to ``out`` (a file written whole or not at all, or ``-``); bytes written."""
    url = f"{API_PREFIX}/tasks/{task_id}/outputs/content"
    target = None if out == "-" else Path(out)
    partial = target.with_name(target.name + ".part") if target is not None else None
    size = 0
    try:
        with hub.client.stream("GET", url, headers=hub.headers()) as r:
            if r.status_code >= 400:
                r.read()
                raise click.ClickException(_problem_line(r))
            sink = sys.stdout.buffer if partial is None else partial.open("wb")
            try:
                for chunk in r.iter_bytes():
                    sink.write(chunk)
                    size += len(chunk)
            finally:
                if partial is None:
                    sink.flush()
                else:
                    sink.close()
    except httpx.HTTPError as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise click.ClickException(f"download from {hub.url} failed: {exc}") from exc
    except BaseException:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise
    if partial is not None and target is not None:
        partial.replace(target)
    return size


def _action(action: TaskAction, doc: str) -> None:
    @task.command(name=action.value, help=doc)
    @click.argument("task_id")
    @_json_option
    @click.pass_obj
    def command(hub: _Hub, task_id: str, as_json: bool) -> None:
        result = hub.call("POST", f"/tasks/{task_id}/{action.value}")
        if as_json:
            _echo_json(result)
        else:
            click.echo(f"{result['id']} {result['state']}" + (f": {result['reason']}" if result.get("reason") else ""))


_action(TaskAction.START, "Let a task created with --hold run.")
_action(TaskAction.STOP, "End it now: a service (inference) SUCCEEDS, a finite task is CANCELED; outputs so far are kept.")
_action(TaskAction.PAUSE, "Workers finish the item in hand, then wait.")
_action(TaskAction.RESUME, "Continue a paused task.")
_action(TaskAction.CANCEL, "Cancel the task and withdraw its workers.")
_action(TaskAction.RETRY, "Run a FAILED, CANCELED or TIMED_OUT task again; finished work is kept.")


@task.command()
@click.argument("task_id")
@_json_option
@click.pass_obj
def delete(hub: _Hub, task_id: str, as_json: bool) -> None:
    """Delete a task that is not active (with its workers, logs, metrics and outputs)."""
    hub.call("DELETE", f"/tasks/{task_id}")
    if as_json:
        _echo_json({"id": task_id, "deleted": True})
    else:
        click.echo(f"{task_id} deleted")

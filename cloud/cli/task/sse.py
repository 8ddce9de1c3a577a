"""Server-Sent Events: an incremental ``text/event-stream`` decoder and the follower of a task's log stream,
which reconnects with ``Last-Event-ID`` until the task's ``end`` event."""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import click
import httpx

from cloud.cli.deploy import _Hub, _problem_line
from interfaces import API_PREFIX

SSE_MEDIA_TYPE = "text/event-stream"


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

"""What the task commands print: log lines, progress summaries, rich tables, and the live view of one task."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from datetime import datetime
from typing import Any

import click

from cloud.cli.deploy import _Hub
from cloud.cli.task.sse import LogFollower
from interfaces.tasks import TaskState, WorkerState

FINAL = frozenset(s.value for s in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELED, TaskState.TIMED_OUT))


def format_time(value: str | None) -> str:
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


def make_console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=200)  # a pipe or a test: no wrapping of ids
    return console


def make_table(*columns: str) -> Any:
    from rich.table import Table

    table = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for column in table.columns:
        column.overflow = "fold"
    return table


def print_table(console: Any, table: Any, title: str | None = None, first: bool = True) -> None:
    """A table, under a title line of its own (a table's title would wrap at the table's width)."""
    if not first:
        console.print()
    if title:
        console.print(title, style="bold", soft_wrap=True)
    console.print(table)


def echo_json(doc: Any) -> None:
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

    console = make_console()
    if not console.is_terminal:  # a pipe or a file: one line per change (a state, its reason, a log line), nothing redrawn
        said: list[str] = []

        def state_line(doc: dict[str, Any]) -> None:
            view.state(doc)
            line = f"{task_id} {doc.get('state', '?')}" + (f": {doc['reason']}" if doc.get("reason") else "") + f" ({progress_summary(doc.get('progress'))})"
            if not said or said[-1] != line:
                said.append(line)
                click.echo(line)

        follower.on_state = state_line
        follower.on_log = lambda line: click.echo(format_log_line(line))
        final = follow()
        state_line(final)
        return final
    with Live(view, console=console, refresh_per_second=4, transient=False, vertical_overflow="visible" if not console.is_terminal else "ellipsis"):
        final = follow()
    if not console.is_terminal:
        console.line()  # Live ends its last frame with a new line only on a terminal
    return final


def report_final(doc: dict[str, Any], as_json: bool) -> None:
    """Print the final task; exit 1 unless it SUCCEEDED."""
    if as_json:
        echo_json(doc)
    else:
        click.echo(f"{doc['id']} {doc['state']}" + (f": {doc['reason']}" if doc.get("reason") else ""))
    if doc.get("state") != TaskState.SUCCEEDED.value:
        raise SystemExit(1)


def format_number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def format_values(values: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={format_number(v)}" for k, v in sorted((values or {}).items()))

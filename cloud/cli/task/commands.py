"""The ``aisynergy task`` click group and its commands; each parses its options, calls the hub and prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from cloud.cli.deploy import _Hub, hub_options
from cloud.cli.task.client import download_outputs, input_format, upload_inputs
from cloud.cli.task.options import DURATION, build_task_body, load_spec
from cloud.cli.task.sse import LogFollower
from cloud.cli.task.view import (
    echo_json,
    format_log_line,
    format_number,
    format_time,
    format_values,
    make_console,
    make_table,
    print_table,
    progress_summary,
    report_final,
    watch_task,
)
from interfaces.pagination import MAX_LIMIT
from interfaces.tasks import FL_STRATEGIES, TaskAction, TaskState, TaskType

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
@click.option("--devices", is_flag=True, help="training, federated_training --algorithm: place on devices (with the frameworks and the datasets) instead of edge sites")
@click.option("--min-nodes", type=int, default=None, help="wait in PENDING until this many targets qualify")
@click.option("--max-nodes", type=int, default=None, help="use at most this many targets")
@click.option("--accelerator", "accelerators", multiple=True, metavar="TYPE[:COUNT[:PURPOSE]]", help="e.g. gpu:2 or gpu:1:training; repeatable, every one must be free on a target")
@click.option("--timeout", type=DURATION, default=None, help="running time before TIMED_OUT (paused time excluded)")
@click.option("--worker-timeout", type=DURATION, default=None, help="a worker silent this long is TIMED_OUT and its work rescheduled")
@click.option("--heartbeat", type=DURATION, default=None, help="how often a worker reports")
@click.option("--max-attempts", type=int, default=None, help="tries of one piece of work before the task FAILS")
@click.option("--backoff", type=DURATION, default=None, help="wait before the 2nd attempt (doubles each time)")
@click.option("--algorithm", default=None, metavar="NAME:VERSION", help="training, federated_training (the whole model): the algorithm artefact (aisynergy algorithm upload)")
@click.option("--dataset", "datasets", multiple=True, metavar="OWN=SITE", help="training, federated_training --algorithm: the algorithm's dataset name = the site's (edge run --dataset, device run --dataset); repeatable")
@click.option("--config", default=None, metavar="JSON|@FILE", help="training, federated_training --algorithm: the algorithm's configuration (checked against its config_schema)")
@click.option("--steps", type=int, default=None, help="training: fit calls")
@click.option("--checkpoint-every", type=int, default=None, help="training: steps between two checkpoints kept on the site")
@click.option("--initial", default=None, metavar="ARTIFACT_ID", help="training, federated_training --algorithm (required there): a safetensors model artefact to start from")
@click.option("--output", default=None, metavar="NAME[:VERSION]", help="training, federated_training: the model published (default: the algorithm's name, a free version)")
@click.option("--rounds", type=int, default=None, help="federated_training: rounds of training and fusion")
@click.option("--strategy", default=None, type=click.Choice(FL_STRATEGIES), help="federated_training: how the hub fuses the updates of a round (default fedavg)")
@click.option("--local-fits", type=int, default=None, help="federated_training --algorithm: fit calls per participant per round (default 1)")
@click.option("--variant", "variants", multiple=True, metavar="SELECTOR=NAME:VERSION",
              help="federated_training --algorithm: participants whose labels match SELECTOR run this algorithm instead; repeatable, the first match wins")
@click.option("--hold", is_flag=True, help="create it held in PENDING: 'aisynergy task start ID' lets it run")
@click.option("--name", default=None)
@click.option("--watch", is_flag=True, help="live progress until the task is final; exit 0 only if it SUCCEEDED")
@_json_option
@click.pass_obj
def create(hub: _Hub, task_type: str, spec_text: str | None, model: str | None, inputs: str | None, chunk_size: int | None, input_name: str | None,
           duration: float | None, selector: str | None, ids: str | None, nodes: bool, devices: bool, min_nodes: int | None, max_nodes: int | None,
           accelerators: tuple[str, ...], timeout: float | None, worker_timeout: float | None, heartbeat: float | None, max_attempts: int | None,
           backoff: float | None, algorithm: str | None, datasets: tuple[str, ...], config: str | None, steps: int | None,
           checkpoint_every: int | None, initial: str | None, output: str | None, rounds: int | None, strategy: str | None, local_fits: int | None,
           variants: tuple[str, ...], hold: bool, name: str | None, watch: bool, as_json: bool) -> None:  # fmt: skip
    """Create a task (and start it, unless --hold)."""
    if ids is not None and selector is not None:
        raise click.UsageError("give at most one of --ids or --selector")
    if nodes and devices:
        raise click.UsageError("give at most one of --nodes or --devices")
    options = dict(
        model=model, chunk_size=chunk_size, input_name=input_name, duration=duration, selector=selector, ids=ids, nodes=nodes, devices=devices, min_nodes=min_nodes,
        max_nodes=max_nodes, accelerators=accelerators, timeout=timeout, worker_timeout=worker_timeout, heartbeat=heartbeat, max_attempts=max_attempts,
        backoff=backoff, hold=hold, name=name, algorithm=algorithm, datasets=datasets, config=config, steps=steps, checkpoint_every=checkpoint_every,
        initial=initial, output=output, rounds=rounds, strategy=strategy, local_fits=local_fits, variants=variants,
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
        echo_json(doc)
        return
    if not as_json:
        click.echo(f"{doc['id']} {doc['state']}" + (" (held: aisynergy task start " + doc["id"] + ")" if doc.get("held") else ""))
    if watch:
        report_final(watch_task(hub, doc["id"], live=not as_json), as_json)


@task.command()
@click.argument("task_id")
@_json_option
@click.pass_obj
def watch(hub: _Hub, task_id: str, as_json: bool) -> None:
    """Live progress until the task is final; exit 0 only if it SUCCEEDED."""
    report_final(watch_task(hub, task_id, live=not as_json), as_json)


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
        echo_json(items)
        return
    table = make_table("ID", "NAME", "TYPE", "STATE", "PROGRESS", "CREATED")
    for t in items:
        table.add_row(t["id"], t.get("name") or "", t["type"], t["state"] + (" (held)" if t.get("held") else ""), progress_summary(t.get("progress")), format_time(t.get("created_at")))
    make_console().print(table)
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
        echo_json(doc)
        return
    console = make_console()
    about = make_table("", "")
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
        ("created", format_time(doc.get("created_at"))), ("started", format_time(doc.get("started_at"))), ("finished", format_time(doc.get("finished_at"))),
        ("deadline", format_time(doc.get("deadline_at"))),
    ):  # fmt: skip
        about.add_row(key, str(value))
    print_table(console, about, f"{doc['id']}  {doc['state']}")
    if doc.get("history"):
        history = make_table("AT", "FROM", "TO", "REASON")
        for h in doc["history"]:
            history.add_row(format_time(h.get("at")), h.get("from_state") or "-", h["to_state"], h.get("reason") or "")
        print_table(console, history, "history", first=False)


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
        echo_json(items)
        return
    table = make_table("WORKER", "TARGET", "ROLE", "STATE", "ATTEMPT", "ITEMS", "LAST REPORT", "DETAIL")
    for w in items:
        done, assigned = w.get("items_done"), w.get("items_assigned")
        share = "-" if done is None and assigned is None else f"{done or 0}/{assigned if assigned is not None else '?'}"
        table.add_row(w["id"], f"{w['target_kind']} {w['target_id']}", w.get("role", ""), w["state"], str(w.get("attempt", "")), share, format_time(w.get("last_report_at")), w.get("detail") or "")
    make_console().print(table)


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
        echo_json(doc)
        return
    console = make_console()
    totals = make_table("METRIC", "TOTAL")
    for key, value in sorted((doc.get("totals") or {}).items()):
        totals.add_row(key, format_number(value))
    print_table(console, totals, f"{doc['task_id']} totals")
    samples = make_table("WORKER", "TARGET", "AT", "VALUES")
    for wid, s in sorted((doc.get("workers") or {}).items()):
        samples.add_row(wid, s.get("target_id", ""), format_time(s.get("ts")), format_values(s.get("values")))
    print_table(console, samples, "latest sample per worker", first=False)
    if series:
        table = make_table("AT", "WORKER", "VALUES")
        for s in doc.get("series") or []:
            table.add_row(format_time(s.get("ts")), s.get("worker_id", ""), format_values(s.get("values")))
        print_table(console, table, "series", first=False)


@task.command()
@click.argument("task_id")
@click.option("--out", "out", default=None, metavar="FILE", help="download the gathered outputs (one safetensors file); '-' for stdout")
@_json_option
@click.pass_obj
def outputs(hub: _Hub, task_id: str, out: str | None, as_json: bool) -> None:
    """What the task produced: gathered outputs, or the published model with what it was trained from and the privacy
    each device spent. --out FILE downloads the gathered outputs (refused while incomplete), or, for a training task,
    its published model."""
    if out is not None:
        r = hub.request("GET", f"/tasks/{task_id}/outputs")
        known = r.json() if r.status_code == 200 else {}
        if not known.get("content_url") and known.get("artifacts"):  # a training task: its published model
            from cloud.cli.fleet import download_artifact

            if out == "-":
                raise click.BadParameter("a published model goes to a file", param_hint="--out")
            model, path = download_artifact(hub, known["artifacts"][0], Path(out))
            click.echo(f"{path}: {model['name']} {model['version']} ({model['format']}), {model['size']} bytes", err=as_json)
            return
        size = download_outputs(hub, task_id, out)
        if out != "-":
            click.echo(f"{out}: {size} bytes", err=as_json)
        return
    doc = hub.call("GET", f"/tasks/{task_id}/outputs")
    if as_json:
        echo_json(doc)
        return
    total = doc.get("items_total")
    click.echo(f"{doc['task_id']} {doc['state']}  {'complete' if doc.get('complete') else 'incomplete'}"
               + (f"  {doc.get('items_done') or 0}/{total} items" if total is not None else ""))  # fmt: skip
    if doc.get("artifacts"):
        _print_lineage(hub, task_id, doc["artifacts"])
    if doc.get("tensors"):
        table = make_table("TENSOR", "DTYPE", "SHAPE")
        for t in doc["tensors"]:
            table.add_row(t["name"], t["dtype"], "x".join(str(d) for d in t["shape"]) or "scalar")
        make_console().print(table)
    if doc.get("privacy"):
        table = make_table("DEVICE", "DATASET", "STATE", "STEPS", "EPSILON")
        for spend in doc["privacy"]:
            table.add_row(spend["device_id"], spend.get("dataset", ""), spend["state"], str(spend.get("steps", "")), f"{spend.get('epsilon') or 0:.4g}")
        make_console().print(table)
    if doc.get("rounds_scored"):
        table = make_table("ROUND", "METRIC", "SCORE", "EVALUATORS", "PARAMETERS")
        for r in doc["rounds_scored"]:
            best = " (published)" if r["round"] == doc.get("best_round") else ""
            table.add_row(f"{r['round']}{best}", r["metric"], "" if r["value"] is None else f"{r['value']:.4f}", str(r["evaluators"]), r["artifact_id"])
        click.echo("the global model's checks (evaluate_every)")
        make_console().print(table)
    if doc.get("trained"):
        table = make_table("SITE", "STEPS", "EXAMPLES", "LOSS", "METRICS")
        for run in doc["trained"]:
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(run["metrics"].items()))
            table.add_row(run["target_id"], str(run["steps"]), str(run["num_examples"]), f"{run['loss']:.4g}", metrics)
        click.echo("the evaluation on the site's own data")
        make_console().print(table)
    if doc.get("evaluation"):
        _print_matrix(doc["evaluation"])
    if doc.get("content_url") and doc.get("complete"):
        click.echo(f"download: aisynergy task outputs {task_id} --out outputs.safetensors")


def _print_lineage(hub: _Hub, task_id: str, artifact_ids: list[str]) -> None:
    """Each published artefact (name, version, format, id) and what the task trained it from: the model version it
    started from (incremental and last-layer federated training), or the initial parameters and the algorithm."""
    found = hub.request("GET", f"/tasks/{task_id}")
    spec = (found.json().get("spec") or {}) if found.status_code == 200 else {}
    for artifact_id in artifact_ids:
        r = hub.request("GET", f"/artifacts/{artifact_id}")
        if r.status_code != 200:
            click.echo(f"artifact {artifact_id}")
            continue
        a = r.json()
        click.echo(f"artifact {a['id']}: published {a['kind']} {a['name']} {a['version']} ({a['format']})")
    base = spec.get("model") or {}
    if base.get("name"):
        click.echo(f"trained from {base['name']} {base.get('version') or '(its installed version)'}")
    elif spec.get("algorithm"):
        algorithm = spec["algorithm"]
        start = spec.get("initial_parameters")
        click.echo(f"trained by {algorithm['name']} {algorithm['version']}" + (f" from the parameters {start}" if start else " from its own initial parameters"))


def _print_matrix(scores: list[dict[str, Any]]) -> None:
    """The cross-site evaluation: a row per participant whose data scored, a column per model (accuracy when the
    algorithm reports one, else loss)."""
    metric = "accuracy" if all("accuracy" in s["metrics"] for s in scores) else "loss"
    models = sorted({s["model"] for s in scores}, key=lambda m: (m != "global", m))
    cells = {(s["evaluator"], s["model"]): s["metrics"]["accuracy"] if metric == "accuracy" else s["loss"] for s in scores}
    table = make_table(f"DATA OF ({metric})", *models)
    for evaluator in sorted({s["evaluator"] for s in scores}):
        table.add_row(evaluator, *("" if cells.get((evaluator, m)) is None else f"{cells[(evaluator, m)]:.4f}" for m in models))
    click.echo("cross-site evaluation (rows: whose data; columns: which model)")
    make_console().print(table)


def _action(action: TaskAction, doc: str) -> None:
    @task.command(name=action.value, help=doc)
    @click.argument("task_id")
    @_json_option
    @click.pass_obj
    def command(hub: _Hub, task_id: str, as_json: bool) -> None:
        result = hub.call("POST", f"/tasks/{task_id}/{action.value}")
        if as_json:
            echo_json(result)
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
        echo_json({"id": task_id, "deleted": True})
    else:
        click.echo(f"{task_id} deleted")

"""``aisynergy deploy``: artefacts and deployments over the hub's REST API (DESIGN §4.2).

    aisynergy deploy upload model.onnx --kind model --name detector --version 1.2.0 --format onnx
    aisynergy deploy create --artifact art-... --selector zone=a --strategy canary:10:rolling:5 --wait
    aisynergy deploy watch dep-...      # progress bar until the deployment is final

A problem document from the hub is printed as one line (``409 illegal_transition: ... (current state RUNNING)``).
"""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any

import click
import httpx

from interfaces import API_PREFIX

FINAL = ("SUCCEEDED", "FAILED", "CANCELED", "ROLLED_BACK")
EXECUTION_DONE = ("ACTIVE", "FAILED", "ROLLED_BACK", "ROLLBACK_FAILED", "CANCELED", "REJECTED", "TIMED_OUT")
UNSUCCESSFUL = ("FAILED", "CANCELED", "ROLLED_BACK")


def _client(hub_url: str, token: str | None, ca_file: Path | None = None) -> httpx.Client:
    # the hub's HTTPS: its CA when given (the local stack's: .data/pki/ca.crt), else the system's
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else True
    return httpx.Client(base_url=hub_url, timeout=httpx.Timeout(30.0, read=600.0), verify=verify)


class _Hub:
    def __init__(self, hub_url: str, token: str | None, ca_file: Path | None = None) -> None:
        self.url = hub_url
        self.token = token
        self.client = _client(hub_url, token, ca_file)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**({"Authorization": f"Bearer {self.token}"} if self.token else {}), **(extra or {})}

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The raw response (any status) of ``path`` below the API prefix; only an unreachable hub raises."""
        headers = self.headers(kwargs.pop("headers", None))
        try:
            return self.client.request(method, API_PREFIX + path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach the hub at {self.url}: {exc}") from exc

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.request(method, path, **kwargs)
        if r.status_code >= 400:
            raise click.ClickException(_problem_line(r))
        return r.json() if r.content else None


def _problem_line(r: httpx.Response) -> str:
    try:
        doc = r.json()
    except ValueError:
        return f"{r.status_code}: {r.text[:200]}"
    if not isinstance(doc, dict):
        return f"{r.status_code}: {doc}"
    line = f"{r.status_code} {doc.get('code', 'error')}: {doc.get('detail') or doc.get('title', '')}"
    if doc.get("current_state"):
        line += f" (current state {doc['current_state']})"
    if doc.get("errors"):
        line += "; " + "; ".join(f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg', '')}" for e in doc["errors"][:3])
    return line


def parse_strategy(text: str) -> dict[str, Any]:
    """``all_at_once`` | ``rolling:N`` | ``canary:P`` | ``canary:P:rolling:N``."""
    parts = text.split(":")
    try:
        if parts == ["all_at_once"]:
            return {"type": "all_at_once"}
        if parts[0] == "rolling" and len(parts) == 2:
            return {"type": "rolling", "batch_size": int(parts[1])}
        if parts[0] == "canary" and len(parts) in (2, 4):
            strategy: dict[str, Any] = {"type": "canary", "percent": float(parts[1])}
            if len(parts) == 4:
                strategy["then"] = parse_strategy(":".join(parts[2:]))
            return strategy
    except ValueError:
        pass
    raise click.BadParameter(f"{text!r}: use all_at_once, rolling:N, canary:P or canary:P:rolling:N", param_hint="--strategy")


def hub_options(fn: Any) -> Any:
    """``--hub`` and ``--token`` (``AISYNERGY_HUB_URL``, ``AISYNERGY_TOKEN``) for a group that talks to the hub's REST API."""
    fn = click.option("--token", envvar="AISYNERGY_TOKEN", default=None, help="an integrator token (aisynergy hub token create)")(fn)
    fn = click.option("--ca-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), envvar="AISYNERGY_CA_FILE", default=None,
                      help="the CA that signed the hub's certificate (the local stack's: .data/pki/ca.crt); default: the system's")(fn)  # fmt: skip
    return click.option("--hub", "hub_url", envvar="AISYNERGY_HUB_URL", default="https://127.0.0.1:8000", show_default=True, help="the hub's base URL")(fn)


@click.group()
@hub_options
@click.pass_context
def deploy(ctx: click.Context, hub_url: str, token: str | None, ca_file: Path | None) -> None:
    """Artefacts and deployments: upload, roll out, watch, pause, resume, cancel, roll back."""
    ctx.obj = _Hub(hub_url.rstrip("/"), token, ca_file)


@deploy.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--kind", required=True, type=click.Choice(["model", "application", "firmware", "algorithm", "dataset"]),
              help="dataset: the inputs of a batch task (npy or safetensors), not deployable")
@click.option("--name", required=True)
@click.option("--version", "version", required=True)
@click.option("--format", "fmt", required=True, help="onnx, tflite, safetensors, firmware, tar.gz, zip, whl, bin, npy")
@click.pass_obj
def upload(hub: _Hub, file: Path, kind: str, name: str, version: str, fmt: str) -> None:
    """Upload an artefact (streamed from disk); the hub signs its manifest."""
    with file.open("rb") as stream:
        doc = hub.call("POST", "/artifacts", data={"kind": kind, "name": name, "version": version, "format": fmt}, files={"file": (file.name, stream)})
    click.echo(f"{doc['id']} {doc['kind']} {doc['name']} {doc['version']} sha256={doc['sha256']} size={doc['size']}")


@deploy.command()
@click.option("--kind", default=None, type=click.Choice(["model", "application", "firmware", "algorithm", "dataset"]))
@click.option("--name", default=None, help="only artefacts of this name")
@click.pass_obj
def artifacts(hub: _Hub, kind: str | None, name: str | None) -> None:
    """List the artefacts (also: aisynergy artifact list)."""
    for item in _all(hub, "/artifacts", {k: v for k, v in (("kind", kind), ("name", name)) if v}):
        click.echo(f"{item['id']}  {item['kind']:<11} {item['name']} {item['version']}  {item['size']} B  {item['sha256'][:12]}")


@deploy.command()
@click.option("--artifact", "artifact_id", required=True)
@click.option("--ids", default=None, help="comma-separated target ids")
@click.option("--selector", default=None, help="label selector, e.g. zone=a,tier!=x")
@click.option("--target-kind", default="device", show_default=True, type=click.Choice(["device", "node"]))
@click.option("--strategy", default="all_at_once", show_default=True, help="all_at_once | rolling:N | canary:P[:rolling:N]")
@click.option("--max-failure-percent", type=float, default=0, show_default=True)
@click.option("--failure-policy", default="halt", show_default=True, type=click.Choice(["halt", "rollback"]))
@click.option("--timeout", "timeout_s", type=int, default=600, show_default=True, help="seconds per target, from release to ACTIVE")
@click.option("--allow-downgrade", is_flag=True)
@click.option("--name", default="")
@click.option("--wait", is_flag=True, help="watch the rollout until it is final")
@click.option("--dry-run", is_flag=True, help="only list the targets the ids or the selector match now (nothing is deployed)")
@click.pass_obj
def create(hub: _Hub, artifact_id: str, ids: str | None, selector: str | None, target_kind: str, strategy: str, max_failure_percent: float,
           failure_policy: str, timeout_s: int, allow_downgrade: bool, name: str, wait: bool, dry_run: bool) -> None:  # fmt: skip
    """Deploy an artefact to targets by ids or by label selector."""
    if (ids is None) == (selector is None):
        raise click.UsageError("give exactly one of --ids or --selector")
    if dry_run:
        _dry_run(hub, target_kind, ids, selector)
        return
    target: dict[str, Any] = {"kind": target_kind}
    if ids is not None:
        target["ids"] = id_list(ids)
    else:
        target["selector"] = selector
    body = {
        "artifact_id": artifact_id, "target": target, "strategy": parse_strategy(strategy), "max_failure_percent": max_failure_percent,
        "failure_policy": failure_policy, "timeout_s": timeout_s, "allow_downgrade": allow_downgrade, "name": name,
    }  # fmt: skip
    doc = hub.call("POST", "/deployments", json=body)
    if doc.get("reason"):
        click.echo(doc["reason"], err=True)
    click.echo(f"{doc['id']} {doc['state']} {doc['total']} targets in {doc['batches']} batches")
    if wait:
        _watch(hub, doc["id"], 1.0)


@deploy.command(name="list")
@click.option("--state", default=None, type=click.Choice(["PENDING", "RUNNING", "PAUSED", *FINAL]))
@click.pass_obj
def list_(hub: _Hub, state: str | None) -> None:
    """List deployments."""
    for item in _all(hub, "/deployments", {"state": state} if state else {}):
        click.echo(f"{item['id']}  {item['state']:<11} {item['artifact']['name']} {item['artifact']['version']}  {_summary(item)}")


@deploy.command()
@click.argument("deployment_id")
@click.pass_obj
def get(hub: _Hub, deployment_id: str) -> None:
    """Show a deployment and its executions."""
    doc = hub.call("GET", f"/deployments/{deployment_id}")
    click.echo(f"{doc['id']}  {doc['state']}  {doc['artifact']['name']} {doc['artifact']['version']}  batch {doc['current_batch'] + 1}/{doc['batches']}")
    if doc.get("reason"):
        click.echo(f"  {doc['reason']}")
    click.echo(f"  {_summary(doc)}")
    for e in doc["executions"]:
        click.echo(f"  {e['target_id']}  batch {e['batch']}  {e['state']:<15} {e['detail']}")


@deploy.command()
@click.argument("deployment_id")
@click.option("--interval", type=float, default=1.0, show_default=True, help="seconds between polls")
@click.pass_obj
def watch(hub: _Hub, deployment_id: str, interval: float) -> None:
    """A progress bar until the deployment is final; exits 1 if it ended FAILED, CANCELED or ROLLED_BACK."""
    _watch(hub, deployment_id, interval)


def _action(name: str, doc: str) -> None:
    @deploy.command(name=name, help=doc)
    @click.argument("deployment_id")
    @click.pass_obj
    def command(hub: _Hub, deployment_id: str) -> None:
        result = hub.call("POST", f"/deployments/{deployment_id}/{name}")
        click.echo(f"{result['id']} {result['state']}")


_action("pause", "Stop releasing further targets.")
_action("resume", "Continue a paused deployment.")
_action("cancel", "Cancel queued and in-flight targets.")


@deploy.command()
@click.argument("deployment_id")
@click.option("--wait/--no-wait", default=True, show_default=True, help="wait until every target is back (ROLLED_BACK)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1, 86400), default=600, show_default=True)
@click.pass_obj
def rollback(hub: _Hub, deployment_id: str, wait: bool, timeout_s: float) -> None:
    """Take the targets back to what they ran before. The deployment keeps its state until every target is back,
    then is ROLLED_BACK; exits 1 if it is not by --timeout."""
    import time

    doc = hub.call("POST", f"/deployments/{deployment_id}/rollback")
    if doc["state"] != "ROLLED_BACK":
        click.echo(f"{doc['id']} rolling back ({_summary(doc)})")
    deadline = time.monotonic() + timeout_s
    while wait and doc["state"] != "ROLLED_BACK" and time.monotonic() < deadline:
        time.sleep(1.0)
        doc = hub.call("GET", f"/deployments/{deployment_id}")
    if doc["state"] == "ROLLED_BACK" or not wait:
        click.echo(f"{doc['id']} {doc['state'] if wait else 'rolling back'}")
        return
    raise click.ClickException(f"{doc['id']} is still {doc['state']} after {timeout_s:g} s ({_summary(doc)}); follow it with: aisynergy deploy watch {doc['id']}")


def id_list(text: str) -> list[str]:
    """``--ids a, b,c`` as a list, blanks dropped."""
    return [i.strip() for i in text.split(",") if i.strip()]


def labels_text(labels: dict[str, str] | None) -> str:
    """Labels as a selector would name them (``k=v,...``), ``-`` for none."""
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "-"


def _dry_run(hub: _Hub, kind: str, ids: str | None, selector: str | None) -> None:
    """The targets a deployment would have now: each named id (or why it would not do), or every match of the selector."""
    plural = "nodes" if kind == "node" else "devices"
    if ids is not None:
        found: list[dict[str, Any]] = []
        for target in id_list(ids):
            r = hub.request("GET", f"/{plural}/{target}")
            found.append(r.json() if r.status_code == 200 else {"id": target, "state": f"not found ({r.status_code})", "name": "", "labels": {}})
    else:
        found = _all(hub, f"/{plural}", {"selector": selector})
    for t in found:
        click.echo(f"{t['id']}  {t['state']:<10} {t.get('name', '')}  {labels_text(t.get('labels'))}")
    click.echo(f"{len(found)} {kind}{'s' if len(found) != 1 else ''} match" + ("" if found or ids else f" {selector!r}; label them with: aisynergy {kind} label ID KEY=VALUE"))


def _all(hub: _Hub, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        page = hub.call("GET", path, params={**params, "limit": 500, **({"cursor": cursor} if cursor else {})})
        items += page["items"]
        cursor = page.get("next_cursor")
        if not cursor:
            return items


def _summary(doc: dict[str, Any]) -> str:
    return ", ".join(f"{state} {n}" for state, n in doc["counts"].items() if n) or "no targets"


def _watch(hub: _Hub, deployment_id: str, interval: float) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.fields[state]:<11}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        bar = progress.add_task("", total=None, state="")
        while True:
            doc = hub.call("GET", f"/deployments/{deployment_id}")
            done = sum(n for state, n in doc["counts"].items() if state in EXECUTION_DONE)
            progress.update(bar, total=doc["total"], completed=done, state=doc["state"], description=_summary(doc))
            if doc["state"] in FINAL:
                break
            time.sleep(interval)
    click.echo(f"{doc['id']} {doc['state']}" + (f": {doc['reason']}" if doc.get("reason") else ""))
    if doc["state"] in UNSUCCESSFUL:
        raise SystemExit(1)

"""What operators do every day, as ``kubectl get nodes`` users expect: ``aisynergy node``, the hub-side commands of
``aisynergy device`` (beside the agent's ``device run``) and ``aisynergy artifact``, over the hub's REST API.

    aisynergy node list --selector zone=a            aisynergy device list --node n-…
    aisynergy node create gw-7 --label zone=a        aisynergy device create cam-3 --node n-… --label site=b
    aisynergy node label n-… zone=b tier-            aisynergy device token d-…   (its bootstrap token)
    aisynergy node lock n-… / unlock n-…             aisynergy artifact list --kind model --name digits
    aisynergy artifact download art-… --out m.onnx   aisynergy artifact delete art-…

Each takes ``--hub``, ``--token``, ``--ca-file`` (``AISYNERGY_HUB_URL``, ``AISYNERGY_TOKEN``, ``AISYNERGY_CA_FILE``) and
``--json`` to print what the hub answered. A refusal is the problem's one line (``_problem_line``), exit 1.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import click

from cloud.cli.deploy import _all, _Hub, hub_options, labels_text

LABEL = re.compile(r"^([^=\s]+)=(.*)$")


def _labels(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        m = LABEL.match(pair)
        if m is None:
            raise click.BadParameter(f"{pair!r}: KEY=VALUE", param_hint="--label")
        out[m.group(1)] = m.group(2)
    return out


def _show(doc: Any, as_json: bool, line: str) -> None:
    click.echo(json.dumps(doc, indent=2) if as_json else line)


def with_hub(fn: Any) -> Any:
    """``--hub``, ``--token``, ``--ca-file`` on the command itself (so that it also works as a subcommand of the
    device agent's group), handed to ``fn`` as ``hub``."""

    @functools.wraps(fn)
    def wrapper(hub_url: str, token: str | None, ca_file: Path | None, **kwargs: Any) -> Any:
        return fn(_Hub(hub_url.rstrip("/"), token, ca_file), **kwargs)

    return hub_options(wrapper)


def _group(kind: str, doc: str) -> click.Group:
    return click.Group(name=kind, help=doc)


def _target_commands(group: click.Group, kind: str) -> None:
    """list, get, label, token, delete for ``nodes`` or ``devices``."""
    plural = f"{kind}s"

    @group.command(name="list")
    @click.option("--selector", default=None, help="label selector, e.g. zone=a,tier!=gpu")
    @click.option("--json", "as_json", is_flag=True)
    @with_hub
    def list_(hub: _Hub, selector: str | None, as_json: bool, **filters: Any) -> None:
        items = _all(hub, f"/{plural}", {k: v for k, v in {"selector": selector, **filters}.items() if v})
        if as_json:
            click.echo(json.dumps(items, indent=2))
            return
        for t in items:
            where = f"  edge {t['node_id']}" if kind == "device" else f"  {t.get('admin_state', '')}"
            click.echo(f"{t['id']}  {t['state']:<10} {t['name']:<24} {labels_text(t.get('labels'))}{where}")
        click.echo(f"{len(items)} {plural}" + (f" match {selector!r}" if selector else ""), err=True)

    list_.help = f"List {plural} (every page), optionally by label selector."
    if kind == "node":
        list_ = click.option("--state", default=None, type=click.Choice(["REGISTERED", "ONLINE", "OFFLINE", "UNHEALTHY"]))(list_)
    else:
        list_ = click.option("--node", "node_id", default=None, help="only the devices behind this edge node")(list_)

    @group.command()
    @click.argument("target_id")
    @click.option("--json", "as_json", is_flag=True)
    @with_hub
    def get(hub: _Hub, target_id: str, as_json: bool) -> None:
        doc = hub.call("GET", f"/{plural}/{target_id}")
        status = hub.call("GET", f"/{plural}/{target_id}/status")
        if as_json:
            click.echo(json.dumps({**doc, "status": status}, indent=2))
            return
        click.echo(f"{doc['id']}  {doc['name']}  {status['state']}" + (f"  {doc['admin_state']}" if "admin_state" in doc else f"  edge {doc.get('node_id')}"))
        click.echo(f"  labels {labels_text(doc.get('labels'))}")
        click.echo(f"  last heartbeat {status.get('last_heartbeat_at') or '-'}  health {status.get('health') or '-'}")
        resources = status.get("resources") or {}
        cpu, memory = resources.get("cpu") or {}, resources.get("memory") or {}
        if cpu or memory:
            used = 1 - memory.get("available_bytes", 0) / memory["total_bytes"] if memory.get("total_bytes") else None
            click.echo(f"  cpu {cpu.get('cores', '-')} cores at {cpu.get('utilisation', 0) * 100:.0f}%"
                       + (f"  memory {used * 100:.0f}% of {memory['total_bytes'] / 2**30:.1f} GiB" if used is not None else "")
                       + f"  accelerators {len(resources.get('accelerators') or [])}")  # fmt: skip

    get.help = f"Show a {kind}, its state, last heartbeat and resources."

    @group.command()
    @click.argument("target_id")
    @click.argument("changes", nargs=-1, required=True)
    @click.option("--json", "as_json", is_flag=True)
    @with_hub
    def label(hub: _Hub, target_id: str, changes: tuple[str, ...], as_json: bool) -> None:
        labels = dict(hub.call("GET", f"/{plural}/{target_id}").get("labels") or {})
        for change in changes:
            if change.endswith("-") and "=" not in change:
                labels.pop(change[:-1], None)
            else:
                labels.update(_labels((change,)))
        doc = hub.call("PATCH", f"/{plural}/{target_id}", json={"labels": labels})
        _show(doc, as_json, f"{doc['id']}  {labels_text(doc.get('labels'))}")

    label.help = f"Set labels of a {kind} (KEY=VALUE) or remove them (KEY-), as kubectl label does."

    @group.command()
    @click.argument("target_id")
    @click.option("--ttl", "ttl_s", type=click.IntRange(60, 7 * 24 * 3600), default=3600, show_default=True, help="seconds the token stays valid")
    @click.option("--json", "as_json", is_flag=True)
    @with_hub
    def token(hub: _Hub, target_id: str, ttl_s: int, as_json: bool) -> None:
        doc = hub.call("POST", f"/{plural}/{target_id}/bootstrap-token", json={"ttl_s": ttl_s})
        _show(doc, as_json, "\n".join(f"{k}={v}" for k, v in doc.items()))

    token.help = f"Issue a one-time bootstrap token with which the {kind} enrols (admin for one that enrolled before)."

    @group.command()
    @click.argument("target_id")
    @click.option("--yes", is_flag=True, help="do not ask")
    @with_hub
    def delete(hub: _Hub, target_id: str, yes: bool) -> None:
        if not yes:
            click.confirm(f"delete {kind} {target_id}" + (" (its certificate is revoked and its devices deleted)" if kind == "node" else "") + "?", abort=True)
        hub.call("DELETE", f"/{plural}/{target_id}")
        click.echo(f"{target_id} deleted")

    delete.help = f"Delete a {kind} (admin): its certificate is revoked, the broker refuses it."


node = _group("node", "Edge nodes at the hub: list, get, create, label, lock, unlock, token, delete.")
_target_commands(node, "node")


@node.command(name="create")
@click.argument("name")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE (repeatable)")
@click.option("--description", default="")
@click.option("--json", "as_json", is_flag=True)
@with_hub
def node_create(hub: _Hub, name: str, labels: tuple[str, ...], description: str, as_json: bool) -> None:
    """Register an edge node; prints its one-time bootstrap token and the CA fingerprint its agent checks."""
    doc = hub.call("POST", "/nodes", json={"name": name, "labels": _labels(labels), "description": description})
    _show(doc, as_json, f"{doc['node']['id']}\nbootstrap_token={doc['bootstrap_token']}\nca_sha256={doc['ca_sha256']}")


def _admin_state(state: str) -> Any:
    @node.command(name="lock" if state == "LOCKED" else "unlock")
    @click.argument("node_id")
    @with_hub
    def command(hub: _Hub, node_id: str) -> None:
        doc = hub.call("PUT", f"/nodes/{node_id}/admin-state", json={"admin_state": state})
        click.echo(f"{node_id} {doc.get('admin_state', state)}")

    command.help = "Lock the node: no new deployment or task goes to it or its devices." if state == "LOCKED" else "Unlock the node."
    return command


_admin_state("LOCKED")
_admin_state("UNLOCKED")


device_commands = _group("device", "Devices at the hub.")
_target_commands(device_commands, "device")


@device_commands.command(name="create")
@click.argument("name")
@click.option("--node", "node_id", required=True, help="the edge node it enrols through")
@click.option("--model", default="board", show_default=True, help="the board's model")
@click.option("--label", "labels", multiple=True, help="KEY=VALUE (repeatable)")
@click.option("--json", "as_json", is_flag=True)
@with_hub
def device_create(hub: _Hub, name: str, node_id: str, model: str, labels: tuple[str, ...], as_json: bool) -> None:
    """Register a device behind an edge node (then: aisynergy device token ID for its bootstrap token)."""
    doc = hub.call("POST", "/devices", json={"node_id": node_id, "name": name, "model": model, "labels": _labels(labels)})
    _show(doc, as_json, f"{doc['id']}  {doc['state']}  edge {doc['node_id']}")


artifact = _group("artifact", "Artefacts at the hub: list, get, download, delete (upload: aisynergy deploy upload).")


@artifact.command(name="list")
@click.option("--kind", default=None, type=click.Choice(["model", "application", "firmware", "algorithm", "dataset"]))
@click.option("--name", default=None)
@click.option("--json", "as_json", is_flag=True)
@with_hub
def artifact_list(hub: _Hub, kind: str | None, name: str | None, as_json: bool) -> None:
    """List artefacts, by kind and name."""
    items = _all(hub, "/artifacts", {k: v for k, v in (("kind", kind), ("name", name)) if v})
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    for a in items:
        click.echo(f"{a['id']}  {a['kind']:<11} {a['name']} {a['version']}  {a['format']}  {a['size']} B  {a['sha256'][:12]}")


@artifact.command(name="get")
@click.argument("artifact_id")
@with_hub
def artifact_get(hub: _Hub, artifact_id: str) -> None:
    """An artefact with its signed manifest (JSON)."""
    click.echo(json.dumps(hub.call("GET", f"/artifacts/{artifact_id}"), indent=2))


@artifact.command(name="download")
@click.argument("artifact_id")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="default: NAME-VERSION.FORMAT here")
@with_hub
def artifact_download(hub: _Hub, artifact_id: str, out: Path | None) -> None:
    """Download an artefact's bytes (streamed), checked against its SHA-256."""
    doc, out = download_artifact(hub, artifact_id, out)
    click.echo(f"{out} {doc['size']} B sha256={doc['sha256']}")


def download_artifact(hub: _Hub, artifact_id: str, out: Path | None) -> tuple[dict[str, Any], Path]:
    """Stream an artefact's bytes to ``out`` (default ``NAME-VERSION.FORMAT``), kept only when their SHA-256 is the
    artefact's; its document and where it went."""
    import hashlib

    from cloud.cli.deploy import _problem_line

    doc = hub.call("GET", f"/artifacts/{artifact_id}")
    out = out or Path(f"{doc['name']}-{doc['version']}.{doc['format']}")
    digest = hashlib.sha256()
    part = out.with_name(out.name + ".part")
    with hub.client.stream("GET", f"/api/v1/artifacts/{artifact_id}/content", headers=hub.headers()) as r:
        if r.status_code != 200:
            r.read()
            raise click.ClickException(_problem_line(r))
        with part.open("wb") as f:
            for block in r.iter_bytes(1 << 20):
                digest.update(block)
                f.write(block)
    if digest.hexdigest() != doc["sha256"]:
        part.unlink()
        raise click.ClickException(f"the bytes received do not have the artefact's SHA-256 {doc['sha256']}; nothing kept")
    part.replace(out)
    return doc, out


@artifact.command(name="delete")
@click.argument("artifact_id")
@with_hub
def artifact_delete(hub: _Hub, artifact_id: str) -> None:
    """Delete an artefact (refused while a deployment or task needs it: the reason is printed)."""
    hub.call("DELETE", f"/artifacts/{artifact_id}")
    click.echo(f"{artifact_id} deleted")

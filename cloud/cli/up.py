"""``aisynergy up``: the local stack (broker + hub + one edge agent) with a live status table."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import click


def _table(stack):  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title=f"AISynergy local stack — {stack.hub_url}  (Ctrl-C stops everything)")
    for col in ("kind", "id", "name", "state", "last heartbeat", "cpu", "memory free", "twin"):
        table.add_column(col)

    def row(kind: str, item: dict, status: dict, twin: dict | None) -> None:  # type: ignore[type-arg]
        res = status.get("resources") or {}
        cpu = f"{res['cpu']['utilisation'] * 100:.0f}%" if res else "-"
        mem = f"{res['memory']['available_bytes'] / 2**30:.1f} GiB" if res else "-"
        colour = {"ONLINE": "green", "OFFLINE": "red", "UNHEALTHY": "yellow"}.get(status.get("state", ""), "white")
        sync = "-" if twin is None else f"v{twin['reported_version']}/{twin['desired_version']}" + ("" if twin["in_sync"] else " …")
        table.add_row(kind, item["id"], item.get("name") or "-", f"[{colour}]{status.get('state', '?')}[/]",
                      (status.get("last_heartbeat_at") or "-")[11:19], cpu, mem, sync)  # fmt: skip

    with stack.api() as api:
        for node in api.get("/nodes", params={"limit": 50}).json().get("items", []):
            row("edge", node, api.get(f"/nodes/{node['id']}/status").json(), api.get(f"/nodes/{node['id']}/twin").json())
            for device in api.get(f"/nodes/{node['id']}/devices", params={"limit": 100}).json().get("items", []):
                row("  device", device, api.get(f"/devices/{device['id']}/status").json(), api.get(f"/devices/{device['id']}/twin").json())
    return table


@click.command()
@click.option("--data-dir", type=click.Path(path_type=Path), default=".data", show_default=True, envvar="AISYNERGY_DATA_DIR")
@click.option("--hub-port", default=8000, show_default=True, type=int)
@click.option("--broker-port", default=8883, show_default=True, type=int)
@click.option("--enrol-port", default=8090, show_default=True, type=int, help="the edge's device enrolment endpoint")
@click.option("--devices", default=2, show_default=True, type=click.IntRange(0, 100), help="devices under the edge")
@click.option("--no-table", is_flag=True, help="print one line per change instead of the live table")
@click.option("--datasets", type=click.Choice(["digits"]), default=None,
              help="digits: each device keeps a non-IID shard of scikit-learn's digits as dataset camera, and the digits model is deployed on them")
def up(data_dir: Path, hub_port: int, broker_port: int, enrol_port: int, devices: int, no_table: bool, datasets: str | None) -> None:
    """Start broker, hub, one edge agent and N devices on this machine; Ctrl-C stops them all."""
    from rich.console import Console
    from rich.live import Live

    from cloud.stack import Stack, StackError

    console = Console()
    stack = Stack(data_dir.resolve(), hub_port=hub_port, broker_port=broker_port, devices=devices, enrol_port=enrol_port, datasets=datasets)
    stopping = False

    def _on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        stack.start()
        console.print(f"[bold]hub[/]     {stack.hub_url}  (API {stack.hub_url}/api/v1, docs {stack.hub_url}/docs)")
        console.print(f"[bold]broker[/]  {stack.broker_url}  (mTLS, CA {stack.data_dir / 'pki' / 'ca.crt'})")
        console.print(f"[bold]admin token[/] {stack.admin_token}")
        console.print(f"[bold]edge node[/]   {stack.node_id}   logs in {stack.data_dir / 'logs'}")
        console.print(f"[bold]devices[/]     {', '.join(stack.device_ids) or '-'}")
        if stack.digits:
            console.print(f"[bold]datasets[/]    camera on every device ({stack.data_dir / 'datasets'}); model digits 1.0.0 {stack.digits['model']} deployed; "
                          f"held-out set digits-held-out {stack.digits['held_out']}")
        if no_table or not console.is_terminal:
            last: dict[str, str] = {}
            while not stopping and stack.failed() is None:
                with stack.api() as api:
                    states = {stack.node_id: api.get(f"/nodes/{stack.node_id}/status").json().get("state")}
                    states.update({d: api.get(f"/devices/{d}/status").json().get("state") for d in stack.device_ids})
                for ident, state in states.items():
                    if last.get(ident) != state:
                        console.print(f"{'edge node' if ident == stack.node_id else 'device'} {ident}: {state}")
                last = states
                time.sleep(1)
        else:
            with Live(_table(stack), console=console, refresh_per_second=1) as live:
                while not stopping and stack.failed() is None:
                    time.sleep(1)
                    live.update(_table(stack))
        failed = stack.failed()
        if failed is not None and not stopping:
            raise click.ClickException(f"{failed.name} exited with {failed.proc.returncode}; see {stack.data_dir / 'logs'}")
    except StackError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        console.print("stopping…")
        stack.stop()
        console.print("stopped")

"""``aisynergy up``: the local stack (broker + hub + one edge agent) with a live status table."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import click


def _table(stack):  # type: ignore[no-untyped-def]
    from rich.table import Table

    table = Table(title=f"AISynergy local stack — {stack.hub_url}  (Ctrl-C stops everything)")
    for col in ("node", "name", "state", "last heartbeat", "cpu", "memory free", "agent"):
        table.add_column(col)
    with stack.api() as api:
        for node in api.get("/nodes", params={"limit": 50}).json().get("items", []):
            st = api.get(f"/nodes/{node['id']}/status").json()
            res = st.get("resources") or {}
            cpu = f"{res['cpu']['utilisation'] * 100:.0f}%" if res else "-"
            mem = f"{res['memory']['available_bytes'] / 2**30:.1f} GiB" if res else "-"
            colour = {"ONLINE": "green", "OFFLINE": "red", "UNHEALTHY": "yellow"}.get(st["state"], "white")
            table.add_row(node["id"], node["name"], f"[{colour}]{st['state']}[/]", (st.get("last_heartbeat_at") or "-")[:19],
                          cpu, mem, st.get("agent_version") or "-")  # fmt: skip
    return table


@click.command()
@click.option("--data-dir", type=click.Path(path_type=Path), default=".data", show_default=True, envvar="AISYNERGY_DATA_DIR")
@click.option("--hub-port", default=8000, show_default=True, type=int)
@click.option("--broker-port", default=8883, show_default=True, type=int)
@click.option("--no-table", is_flag=True, help="print one line per change instead of the live table")
def up(data_dir: Path, hub_port: int, broker_port: int, no_table: bool) -> None:
    """Start broker, hub and one edge agent on this machine; Ctrl-C stops them all."""
    from rich.console import Console
    from rich.live import Live

    from cloud.stack import Stack, StackError

    console = Console()
    stack = Stack(data_dir.resolve(), hub_port=hub_port, broker_port=broker_port)
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
        if no_table or not console.is_terminal:
            last = None
            while not stopping and stack.failed() is None:
                with stack.api() as api:
                    state = api.get(f"/nodes/{stack.node_id}/status").json().get("state")
                if state != last:
                    console.print(f"edge node {stack.node_id}: {state}")
                    last = state
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

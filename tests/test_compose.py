"""docker-compose.yml cannot run here (no Docker engine): check it is valid and matches the CLI."""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from cloud.cli.root import main

COMPOSE = Path(__file__).parent.parent / "docker-compose.yml"


def _resolve(args: list[str]) -> tuple[click.Command, list[str]]:
    command: click.Command = main
    ctx = click.Context(main)
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        sub = command.get_command(ctx, args[0])
        assert sub is not None, f"unknown subcommand {args[0]!r}"
        command, args = sub, args[1:]
    return command, args


def test_compose_services_and_commands_are_valid(monkeypatch) -> None:
    # Prepare
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]

    # Assert: the four processes of the design and the broker's share of the PKI, each command accepted by the CLI
    assert set(services) == {"postgres", "broker-pki", "broker", "hub", "edge"}
    for name in ("broker-pki", "broker", "hub", "edge"):
        for key, value in (services[name].get("environment") or {}).items():
            monkeypatch.setenv(key, "n-example" if str(value).startswith("${") else str(value))
        command, rest = _resolve(list(services[name]["command"]))
        command.make_context(name, rest)  # raises click.UsageError on an unknown option
    assert services["hub"]["environment"]["AISYNERGY_DATABASE_URL"].startswith("postgresql://")
    assert "mqtts://broker:8883" in services["hub"]["command"]
    # HTTPS (the default of hub serve) under the name the edge uses, published on the loopback unless asked
    assert "--no-tls" not in services["hub"]["command"] and "hub" in services["hub"]["command"]
    assert services["hub"]["ports"] == ["${HUB_BIND:-127.0.0.1}:8000:8000"]
    assert "https://hub:8000" in services["edge"]["command"] and "AISYNERGY_CA_SHA256" in services["edge"]["environment"]


def test_the_broker_never_mounts_the_hubs_pki() -> None:
    # Prepare
    services = yaml.safe_load(COMPOSE.read_text())["services"]

    def volumes(name: str) -> dict[str, str]:
        return {v.split(":")[0]: v.split(":", 1)[1] for v in services[name].get("volumes", [])}

    # Assert: the CA key and the signing key live in `pki`, which only the hub's side mounts; the broker reads
    # the share that `broker share` writes, read-only, and runs Mosquitto as its own user
    assert "pki" in volumes("hub") and "pki" in volumes("broker-pki")
    assert "pki" not in volumes("broker")
    assert volumes("broker")["broker-pki"].endswith(":ro")
    share_to = services["broker-pki"]["command"][services["broker-pki"]["command"].index("--to") + 1]
    assert volumes("broker-pki")["broker-pki"] == share_to
    pki_dir = services["broker"]["command"][services["broker"]["command"].index("--pki-dir") + 1]
    assert volumes("broker")["broker-pki"] == f"{pki_dir}:ro"
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "\nUSER aisynergy\n" in dockerfile

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

    # Assert: the four processes of the design, each command accepted by the CLI
    assert set(services) == {"postgres", "broker", "hub", "edge"}
    for name in ("broker", "hub", "edge"):
        for key, value in (services[name].get("environment") or {}).items():
            monkeypatch.setenv(key, "n-example" if str(value).startswith("${") else str(value))
        command, rest = _resolve(list(services[name]["command"]))
        command.make_context(name, rest)  # raises click.UsageError on an unknown option
    assert services["hub"]["environment"]["AISYNERGY_DATABASE_URL"].startswith("postgresql://")
    assert "mqtts://broker:8883" in services["hub"]["command"]

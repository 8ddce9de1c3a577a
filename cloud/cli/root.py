"""The ``aisynergy`` command. Subcommand groups register themselves under the entry-point group
``aisynergy.commands`` so that this root imports nothing but click: a device that installs only the
``[device]`` extra never loads the hub's dependencies."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import click


_EXTRA_FOR = {"broker": "hub", "up": "all", "contracts": "hub", "conformance": "device", "algorithm": "device", "firmware": "device", "deploy": "hub", "task": "hub", "model": "hub", "simulate": "hub", "experiment": "hub", "node": "hub", "artifact": "hub"}


class _PluginGroup(click.Group):
    def _plugins(self) -> dict[str, object]:
        return {ep.name: ep for ep in entry_points(group="aisynergy.commands")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        ep = self._plugins().get(cmd_name)
        if ep is None:
            return None
        try:
            command = ep.load()  # type: ignore[attr-defined]
        except ImportError as exc:
            extra = _EXTRA_FOR.get(cmd_name, cmd_name)
            raise click.ClickException(
                f"'{cmd_name}' needs an extra that is not installed ({exc.name}): pip install 'aisynergy[{extra}]'"
            ) from exc
        if isinstance(command, click.Group):  # more subcommands from elsewhere (the hub-side `device list` beside `device run`)
            for more in entry_points(group="aisynergy.subcommands", name=cmd_name):
                try:
                    extra_group = more.load()
                except ImportError:  # that part's extra is not installed: its subcommands are not offered
                    continue
                for name, sub in extra_group.commands.items():
                    command.commands.setdefault(name, sub)
        return command  # type: ignore[no-any-return]


@click.group(cls=_PluginGroup)
@click.option("--log-level", default="INFO", show_default=True, envvar="AISYNERGY_LOG_LEVEL",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str) -> None:
    """AISynergy: cloud-edge-device orchestration for AI workloads."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("alembic", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


if __name__ == "__main__":
    main()

"""An agent's commands, the same at both tiers: the built-ins (``ping``, answered with the agent's clock; ``infer``
and ``models``, registered by whoever hosts models) and the application's handlers, transport-neutral. The device
and the edge node answer with the same :class:`Commands`.

A command always gets an answer: ``ok`` with the handler's result, or ``ok=false`` with an
:class:`~interfaces.messages.CommandError` code (``unknown_command``, ``failed``); a request that does
not validate is answered ``validation_failed`` by the transport adapter before it gets here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from device.errors import ConfigError
from interfaces.messages import CommandBody, CommandError, CommandResultBody

log = logging.getLogger("aisynergy.device")

CommandHandler = Callable[[dict[str, Any]], dict[str, Any] | None]
MODEL_COMMANDS = ("infer", "models")
"""the built-ins over the served models (``device.ota.models.model_commands``)"""
BUILTIN = frozenset({"ping", *MODEL_COMMANDS})


def failure(code: CommandError, error: str) -> CommandResultBody:
    return CommandResultBody(ok=False, error_code=code.value, error=error[:2048])


class Commands:
    def __init__(self) -> None:
        self._handlers: dict[str, CommandHandler] = {}

    @staticmethod
    def check_name(name: str) -> None:
        if not 1 <= len(name) <= 64:
            raise ConfigError(f"command name {name!r} must be 1 to 64 characters")
        if name in BUILTIN:
            raise ConfigError(f"{name!r} is a built-in command")

    def register(self, name: str, handler: CommandHandler) -> None:
        self.check_name(name)
        self._handlers[name] = handler

    def register_builtin(self, name: str, handler: CommandHandler) -> None:
        """A built-in that runs like an application handler (on the commands worker)."""
        if name not in BUILTIN:
            raise ConfigError(f"{name!r} is not a built-in command")
        self._handlers[name] = handler

    def runs_a_handler(self, command: CommandBody) -> bool:
        """Whether answering ``command`` calls application code (which may be slow)."""
        return command.name in self._handlers

    def execute(self, command: CommandBody) -> CommandResultBody:
        if command.name == "ping":
            return CommandResultBody(ok=True, result={"pong": True, "ts": datetime.now(UTC).isoformat()})
        handler = self._handlers.get(command.name)
        if handler is None:
            return failure(CommandError.UNKNOWN_COMMAND, f"unknown command {command.name!r}")
        try:
            result = handler(dict(command.args))
            if result is not None and not isinstance(result, dict):
                raise TypeError(f"the handler returned {type(result).__name__}, not a dict or None")
            return CommandResultBody(ok=True, result=result)
        except Exception as exc:  # the application's handler: any failure is an answer, not a crash
            log.warning("command %s failed: %s: %s", command.name, type(exc).__name__, exc, exc_info=True)
            return failure(CommandError.FAILED, f"{type(exc).__name__}: {exc}")

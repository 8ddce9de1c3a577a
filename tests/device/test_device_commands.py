"""The command table without a broker: every command gets an answer."""

from __future__ import annotations

from datetime import datetime

import pytest

from device.commands import Commands
from device.errors import ConfigError
from interfaces.messages import CommandBody


def test_ping_is_built_in_and_cannot_be_replaced() -> None:
    commands = Commands()

    result = commands.execute(CommandBody(name="ping")).result
    assert result is not None and result.keys() == {"pong", "ts"} and result["pong"] is True
    assert datetime.fromisoformat(result["ts"]).tzinfo is not None  # the agent's clock, in UTC
    assert not commands.runs_a_handler(CommandBody(name="ping"))
    with pytest.raises(ConfigError):
        commands.register("ping", lambda args: None)


def test_an_unknown_command_is_an_error_answer() -> None:
    result = Commands().execute(CommandBody(name="self-destruct"))

    assert (result.ok, result.error_code) == (False, "unknown_command")
    assert "self-destruct" in (result.error or "")


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (lambda args: {"echo": args}, (True, {"echo": {"x": 1}}, None)),
        (lambda args: None, (True, None, None)),
        (lambda args: [1, 2], (False, None, "failed")),  # not a dict
        (lambda args: 1 / 0, (False, None, "failed")),
        (lambda args: {"text": "nul\x00"}, (False, None, "failed")),  # the wire refuses U+0000
    ],
)
def test_a_handler_result_or_failure_becomes_the_answer(handler, expected) -> None:  # type: ignore[no-untyped-def]
    commands = Commands()
    commands.register("do", handler)

    result = commands.execute(CommandBody(name="do", args={"x": 1}))

    assert (result.ok, result.result, result.error_code) == expected

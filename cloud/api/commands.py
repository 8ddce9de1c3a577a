"""Commands to nodes and devices over MQTT, for the REST routes (on the event loop, beside the bridge)."""

from __future__ import annotations

import time

from fastapi import Request

from cloud.api.state import hub_state
from cloud.bridge import BrokerUnavailable, CommandTimeout
from cloud.errors import ApiError, Conflict
from interfaces.errors import ErrorCode
from interfaces.lifecycle import CONNECTED_STATES, NodeState
from interfaces.messages import CommandBody, CommandError
from interfaces.nodes import CommandRequest, CommandResult


async def send(request: Request, state: str, topic: str, reply_topic: str, body: CommandRequest) -> CommandResult:
    if NodeState(state) not in CONNECTED_STATES:
        raise Conflict(f"the target is {state}, not connected", code=ErrorCode.TARGET_OFFLINE, current_state=state)
    bridge = hub_state(request).bridge
    if bridge is None:
        raise ApiError("this hub runs without MQTT", code=ErrorCode.BROKER_UNAVAILABLE, status=503)
    command = CommandBody(name=body.name, args=body.args, timeout_s=body.timeout_s)
    started = time.monotonic()
    try:
        answer = await bridge.request(topic, reply_topic, command)
    except BrokerUnavailable as exc:
        raise ApiError(str(exc), code=ErrorCode.BROKER_UNAVAILABLE, status=503) from exc
    except CommandTimeout as exc:
        raise ApiError(f"no answer within {body.timeout_s:g} s", code=ErrorCode.COMMAND_TIMEOUT, status=504) from exc
    if not answer.ok and answer.error_code == CommandError.TIMEOUT:
        # the edge is there but its device did not answer in time: the same timeout for the integrator
        raise ApiError(f"the device did not answer within {body.timeout_s:g} s (reported by its edge)", code=ErrorCode.COMMAND_TIMEOUT, status=504)
    return CommandResult(
        ok=answer.ok, result=answer.result, error_code=answer.error_code, error=answer.error,
        duration_ms=round((time.monotonic() - started) * 1000, 3),
    )  # fmt: skip

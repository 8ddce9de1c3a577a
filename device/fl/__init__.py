"""The device's end of federated training's ``fl`` channel (hierarchical rounds: updates to the edge's aggregator)."""

from __future__ import annotations

from collections.abc import Callable

from interfaces.messages import FlUpdateBody
from interfaces.tasks import FlUpdate


class FlChannel:
    """Sends a device's federated updates to its edge on ``synergy/v1/devices/{id}/fl`` (QoS 1, an envelope).

    ``publish(body)`` is the agent's envelope publisher for that topic (it raises when the agent has not started);
    ``identity`` is the device id, the one contributor a device's update may name."""

    def __init__(self, identity: str, publish: Callable[[FlUpdateBody], object]) -> None:
        self.identity = identity
        self._publish = publish

    def send(self, update: FlUpdate) -> None:
        self._publish(FlUpdateBody(update=update))

"""Node lifecycle (DESIGN §4.1) as an enum with its allowed transitions.

    REGISTERED --> ONLINE <--> OFFLINE
                   ONLINE <--> UNHEALTHY --> OFFLINE
    any state  --> DELETED
"""

from __future__ import annotations

from enum import StrEnum


class NodeState(StrEnum):
    REGISTERED = "REGISTERED"
    ONLINE = "ONLINE"
    OFFLINE = "OFFLINE"
    UNHEALTHY = "UNHEALTHY"
    DELETED = "DELETED"


NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.REGISTERED: frozenset({NodeState.ONLINE, NodeState.DELETED}),
    NodeState.ONLINE: frozenset({NodeState.OFFLINE, NodeState.UNHEALTHY, NodeState.DELETED}),
    NodeState.OFFLINE: frozenset({NodeState.ONLINE, NodeState.DELETED}),
    NodeState.UNHEALTHY: frozenset({NodeState.ONLINE, NodeState.OFFLINE, NodeState.DELETED}),
    NodeState.DELETED: frozenset(),
}

# States a node is in while its agent is connected.
CONNECTED_STATES = frozenset({NodeState.ONLINE, NodeState.UNHEALTHY})


class IllegalTransition(ValueError):
    def __init__(self, current: NodeState, target: NodeState) -> None:
        super().__init__(f"node cannot go from {current} to {target}")
        self.current = current
        self.target = target


def can_transition(current: NodeState, target: NodeState) -> bool:
    return target in NODE_TRANSITIONS[current]


def check_transition(current: NodeState, target: NodeState) -> NodeState:
    """Return ``target`` if the move is allowed, else raise :class:`IllegalTransition`."""
    if not can_transition(current, target):
        raise IllegalTransition(current, target)
    return target


def state_after_report(current: NodeState, connected: bool, healthy: bool) -> NodeState:
    """The state a node should be in after its agent reports (state or heartbeat).

    Returns ``current`` when nothing changes. A DELETED node stays deleted. A node that comes back
    unhealthy passes through ONLINE, so the returned state is always reachable in one or two legal steps.
    """
    if current is NodeState.DELETED:
        return current
    if not connected:
        return NodeState.OFFLINE if current in CONNECTED_STATES else current
    return NodeState.ONLINE if healthy else NodeState.UNHEALTHY


def path_to(current: NodeState, target: NodeState) -> list[NodeState]:
    """Legal steps from ``current`` to ``target`` (at most two), or raise :class:`IllegalTransition`."""
    if current == target:
        return []
    if can_transition(current, target):
        return [target]
    for middle in NODE_TRANSITIONS[current]:
        if can_transition(middle, target):
            return [middle, target]
    raise IllegalTransition(current, target)


class AdminState(StrEnum):
    LOCKED = "LOCKED"
    UNLOCKED = "UNLOCKED"

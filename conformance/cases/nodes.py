"""8.1 edge node management (DESIGN §4.1): registration, enrolment, nodes, admin state, status,
lifecycle, devices, twins and commands."""

from __future__ import annotations

from conformance.cases.common import new_edge, node_status, wait_node
from conformance.runner import Check, case
from interfaces.nodes import NodeTransition


@case("8.1.6", "ONLINE on connect, OFFLINE by the last will, ONLINE again on reconnect; every transition in the history")
def lifecycle_will(check: Check) -> None:
    edge = new_edge(check, start=False)
    check.equal(node_status(check.target, edge.node_id).state, "REGISTERED", "state before the agent connects")
    edge.start()
    wait_node(check, edge.node_id, "ONLINE", 15)
    check.note("ONLINE after connect and the retained online state")
    edge.peer.disconnect(with_will=True)
    wait_node(check, edge.node_id, "OFFLINE", 10)
    check.note("OFFLINE after the broker published the last will")
    history = [NodeTransition.model_validate(t) for t in check.target.ok("GET", f"/nodes/{edge.node_id}/history")]
    moves = [(t.from_state, t.to_state) for t in history]
    check.check(("REGISTERED", "ONLINE") in moves and ("ONLINE", "OFFLINE") in moves, f"history records the transitions: {moves}")

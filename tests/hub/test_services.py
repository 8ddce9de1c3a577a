"""Transport-neutral services under interleaving: what two writers at the same moment get.

The interleaving is made deterministic with a ``before_flush`` hook: the second writer runs, and commits,
after the first has read the row and before it writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.db import make_engine, upgrade
from cloud.errors import Conflict
from cloud.services import devices as device_service
from cloud.services import nodes as node_service
from interfaces.nodes import DeviceCreate, NodeCreate, TwinUpdate


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    upgrade(database_url)
    e = make_engine(database_url)
    try:
        yield e
    finally:
        e.dispose()


def _device(engine: Engine) -> str:
    with Session(engine, expire_on_commit=False) as session:
        node, _token, _expires = node_service.register(session, NodeCreate(name="gw"))
        return device_service.create(session, DeviceCreate(node_id=node.id, model="rpi-5")).id


def _interleaved(engine: Engine, first: Callable[[Session], Any], second: Callable[[Session], Any]) -> tuple[object, object]:
    """Run ``first``; just before it first writes (an ORM flush or UPDATE), run ``second`` to completion in
    its own session."""
    outcomes: dict[str, object] = {}

    def run(name: str, fn: Callable[[Session], Any], session: Session) -> None:
        try:
            outcomes[name] = fn(session)
        except Conflict as exc:
            outcomes[name] = exc

    with Session(engine, expire_on_commit=False) as session:
        fired = False

        def _other_writer() -> None:
            nonlocal fired
            if not fired:
                fired = True
                with Session(engine, expire_on_commit=False) as other:
                    run("second", second, other)

        event.listen(session, "before_flush", lambda *_: _other_writer())
        event.listen(session, "do_orm_execute", lambda state: _other_writer() if state.is_update else None)

        run("first", first, session)
    return outcomes["first"], outcomes["second"]


def test_twin_expected_version_admits_one_of_two_concurrent_writers(engine: Engine) -> None:
    # Prepare
    device_id = _device(engine)

    # Execute: both writers read desired_version 0 and ask to replace it
    first, second = _interleaved(
        engine,
        lambda s: device_service.put_twin(s, device_id, TwinUpdate(desired={"writer": "first"}, expected_version=0)),
        lambda s: device_service.put_twin(s, device_id, TwinUpdate(desired={"writer": "second"}, expected_version=0)),
    )

    # Assert: the second won; the first must be told so
    assert not isinstance(second, Conflict)
    assert isinstance(first, Conflict)
    with Session(engine) as session:
        device = device_service.get(session, device_id)
        assert (device.desired, device.desired_version) == ({"writer": "second"}, 1)

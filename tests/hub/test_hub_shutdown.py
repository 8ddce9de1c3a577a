"""A stopping hub lets the controller run in hand end before it disposes of its database engine: a worker thread
cannot be stopped, and one still in a transaction after the dispose keeps a connection open past the hub's end."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import text
from sqlmodel import Session

from tests.hub.conftest import hub_settings, running_hub


def test_the_scheduler_run_in_hand_ends_before_the_engine_is_disposed(tmp_path: Path) -> None:
    # Prepare: a hub whose next scheduler run takes a while, inside a transaction
    events: list[str] = []
    started = threading.Event()
    hubs = running_hub(hub_settings(tmp_path, f"sqlite:///{tmp_path / 'hub.db'}"))
    hub = next(hubs)
    engine, controller = hub.engine, hub.state.scheduler
    dispose = engine.dispose

    def slow_tick() -> None:
        with Session(engine) as session:
            session.execute(text("SELECT 1"))
            started.set()
            time.sleep(0.5)  # the run in hand when the hub is told to stop (its length is the point, not a wait)
            events.append("run ended")

    def disposing() -> None:
        events.append("engine disposed")
        dispose()

    controller.tick = slow_tick  # type: ignore[method-assign]
    engine.dispose = disposing  # type: ignore[method-assign]
    hub.state.wake_scheduler()
    assert started.wait(30), "the scheduler did not run"

    # Execute: the hub stops while the run is in hand
    for _ in hubs:  # the generator's remaining part is the lifespan's end
        pass

    # Assert: the run ended first, and no connection is left checked out
    assert events == ["run ended", "engine disposed"]
    assert engine.pool.checkedout() == 0

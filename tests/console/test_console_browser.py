"""The web console in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium)
against a running stack: hub + brokers + an edge + devices (``tests.integration.devstack``). It signs in, sees the
stack ONLINE, uploads a model and deploys it with a canary whose progress reaches SUCCEEDED on the page without a
reload, creates a batch_inference task from the form and watches its state and log, opens a federated task's round
chart and a split inference task's route shares and cut; at a phone's width nothing scrolls sideways; a viewer sees
no write control and a write forged with its token is refused; a validation error shows next to its field. Each page's screenshot goes to ``$AISYNERGY_CONSOLE_SCREENSHOTS`` when set (``docs/console/`` holds
those of a run)."""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from examples.algorithms.digits import write_digits
from tests.integration.devstack import DevStack, api, start_devstack, upload_artifact
from tests.integration.test_federated_whole import EXAMPLES, _initial_parameters, _ready, _upload_algorithm
from tests.support import wait_for

MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "mlp-1.0.0.onnx"
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif((CHROMIUM is None or DRIVER is None) and not os.environ.get("CI"), reason="Debian's chromium and chromium-driver are not installed (./dev.sh test installs them)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DevStack, list[Any]]]:
    tmp = tmp_path_factory.mktemp("console")
    s = start_devstack(tmp, f"sqlite:///{tmp / 'hub.db'}")
    try:
        devices = []
        for k in range(2):
            train, _ = write_digits(tmp / f"site-{k}", seed=k)
            device = s.add_device(f"board-{k}")
            device.datasets.add("digits-train", train)
            api(s, "PATCH", f"/devices/{device.device_id}", json={"labels": {"stack": "local"}})
            devices.append(device)
        for device in devices:
            _ready(s, device)
        yield s, devices
    finally:
        s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(DRIVER)), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


class Console:
    """The console as a person uses it: a URL, clicks, typing; waits on what the page shows."""

    def __init__(self, driver: Any, base: str) -> None:
        self.driver, self.base = driver, base
        self.shots = Path(os.environ["AISYNERGY_CONSOLE_SCREENSHOTS"]) if os.environ.get("AISYNERGY_CONSOLE_SCREENSHOTS") else None

    def find(self, css: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, css)

    def all(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return list(self.driver.find_elements(By.CSS_SELECTOR, css))

    def wait(self, check: Any, timeout: float = 60, what: str = "the page") -> Any:
        def probe() -> Any:
            try:
                return check()
            except Exception:  # noqa: BLE001 - an element not there yet, or replaced while read
                return None

        return wait_for(probe, timeout, interval=0.25, what=what)

    def text(self, css: str = "main") -> str:
        return str(self.find(css).text)

    def go(self, route: str) -> None:
        self.driver.execute_script("location.hash = arguments[0]", route)
        self.wait(lambda: self.find("main h1").text and self.driver.execute_script("return location.hash") == route, what=f"{route} open")

    def sign_in(self, token: str) -> None:
        self.driver.get(self.base + "/")
        self.wait(lambda: self.find("#token"), what="the sign-in page")
        self.find("#token").clear()
        self.find("#token").send_keys(token)
        self.find("form.signin button[type=submit]").click()
        self.wait(lambda: self.find("#nav a"), what="signed in")

    def sign_out(self) -> None:
        self.find("#signout").click()
        self.wait(lambda: self.find("#token"), what="the sign-in page again")

    def fill(self, name: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        box = self.find(f'.field[data-field="{name}"] input, .field[data-field="{name}"] select, .field[data-field="{name}"] textarea')
        if box.tag_name == "select":
            Select(box).select_by_value(value)
        else:
            box.clear()
            box.send_keys(value)

    def shot(self, name: str) -> None:
        if self.shots is not None:
            self.shots.mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(str(self.shots / f"{name}.png"))


def _npy(rows: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return buf.getvalue()


def test_an_operator_deploys_runs_a_task_and_follows_training_and_a_viewer_can_only_look(stack: tuple[DevStack, list[Any]], browser: Any, tmp_path: Path) -> None:
    s, devices = stack
    ui = Console(browser, s.hub.url)
    model_file = tmp_path / "mlp.onnx"
    model_file.write_bytes(MODEL.read_bytes())

    # Sign in; the stack's edge and devices are ONLINE
    ui.sign_in(s.hub.tokens["operator"])
    ui.wait(lambda: "devices" in ui.text(".grid"), what="the overview's counts")
    ui.shot("overview")
    ui.go("#/nodes")
    ui.wait(lambda: "ONLINE" in ui.text("table") and "heartbeat" in ui.text("table"), what="the edge ONLINE with its heartbeat")
    ui.shot("nodes")
    ui.go("#/devices")
    ui.wait(lambda: ui.text("table").count("ONLINE") >= 2, what="both devices ONLINE")
    ui.shot("devices")
    browser.set_window_size(390, 844)  # a phone's width: the page reflows (tables as cards), nothing scrolls sideways
    ui.wait(lambda: browser.execute_script("return window.innerWidth") < 500, what="the narrow window")
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth + 1"), "the page scrolls sideways at 390 px"
    assert ui.text("table").count("ONLINE") >= 2
    ui.shot("devices-phone")
    browser.set_window_size(1280, 800)
    ui.go(f"#/devices/{devices[0].device_id}")
    ui.wait(lambda: "last heartbeat" in ui.text() and "Desired" in ui.text(), what="a device's detail")
    ui.shot("device")

    # Upload a model (chunked, with its progress) and deploy it with a canary: the progress reaches SUCCEEDED live
    ui.go("#/artifacts")
    ui.find('.field[data-field="file"] input').send_keys(str(model_file))
    ui.fill("kind", "model")
    ui.fill("name", "mlp")
    ui.fill("version", "1.0.0")
    ui.fill("format", "onnx")
    ui.find('form[aria-label="Upload an artefact"] button[type=submit]').click()
    ui.wait(lambda: browser.execute_script("return location.hash").startswith("#/artifacts/art-"), what="the stored artefact's page")
    ui.wait(lambda: "Signed manifest" in ui.text(), what="the manifest")
    ui.shot("artifact")
    ui.find('a[href^="#/deployments/new/"]').click()
    ui.wait(lambda: ui.find('.field[data-field="artifact_id"] select'), what="the deployment form")
    ui.fill("target.selector", "stack=local")
    ui.find("button.secondary").click()  # the preview of who matches
    ui.wait(lambda: "2 match" in ui.text(), what="the preview")
    ui.fill("strategy", "canary")
    ui.fill("strategy.percent", "50")
    ui.shot("deployment-new")
    ui.find('form[aria-label="New deployment"] button[type=submit]').click()
    ui.wait(lambda: ui.text("#deployment-state") == "SUCCEEDED", 120, what="the canary deployment SUCCEEDED on the page")
    assert "2/2 active" in ui.text()
    ui.shot("deployment")

    # A batch_inference task from the form: its state and log live
    rows = np.random.default_rng(0).standard_normal((200, 128)).astype(np.float32)
    inputs = upload_artifact(s, _npy(rows), "dataset", "console-inputs", "1", "npy")
    ui.go("#/tasks/new")
    ui.wait(lambda: ui.find('.field[data-field="type"] select'), what="the task form")
    ui.fill("type", "batch_inference")
    ui.wait(lambda: ui.find('.field[data-field="spec.inputs"] input'), what="the batch_inference spec's fields")
    ui.fill("spec.model", '{"name": "mlp", "version": "1.0.0"}')
    ui.fill("spec.inputs", inputs["id"])
    ui.fill("spec.chunk_size", "0")  # refused: the problem's field error shows next to the field
    ui.fill("placement.selector", "stack=local")
    ui.find('form[aria-label="New task"] button[type=submit]').click()
    ui.wait(lambda: ui.text('.field[data-field="spec.chunk_size"] .error'), what="the validation error next to chunk_size")
    ui.shot("task-new-error")
    ui.fill("spec.chunk_size", "25")
    ui.find('form[aria-label="New task"] button[type=submit]').click()
    ui.wait(lambda: ui.text("#task-state") == "SUCCEEDED", 180, what="the task SUCCEEDED on the page")
    ui.wait(lambda: len(ui.all("#task-log div")) > 0, what="log lines streamed")
    ui.shot("task")

    # A federated task's round chart (a whole-model task on the devices' digits, created through the API)
    algorithm = _upload_algorithm(s, EXAMPLES / "numpy_cnn", tmp_path)
    initial = _initial_parameters(s, tmp_path)
    spec = {"algorithm": {"name": algorithm["name"], "version": algorithm["version"]}, "datasets": {"train": "digits-train"}, "config": {"epochs": 1},
            "initial_parameters": initial["id"], "rounds": 3, "min_participants": 2, "round_timeout_s": 120}  # fmt: skip
    task = api(s, "POST", "/tasks", json={"type": "federated_training", "spec": spec, "heartbeat_s": 0.5,
                                         "placement": {"target": "device", "ids": [d.device_id for d in devices]}})  # fmt: skip
    ui.go(f"#/tasks/{task['id']}")
    ui.wait(lambda: ui.text("#task-state") == "SUCCEEDED", 240, what="the federated task SUCCEEDED")
    ui.wait(lambda: ui.find("#round-chart canvas") and "round" in ui.text("#rounds"), 30, what="the round chart")
    ui.shot("task-federated")

    # A split inference task's route shares and cut over time (mlp is on the devices: the canary above)
    spec = {"model": {"name": "mlp", "version": "1.0.0"}, "timeout_ms": 1000, "report_interval_s": 0.5, "probe_interval_s": 2, "duration_s": 60}
    split = api(s, "POST", "/tasks", json={"type": "split_inference", "spec": spec, "heartbeat_s": 0.5, "placement": {"ids": [devices[0].device_id]}})
    ui.go(f"#/tasks/{split['id']}")
    head = lambda: [v["values"] for k, v in api(s, "GET", f"/tasks/{split['id']}/metrics", "viewer")["workers"].items() if "cut_index" in v["values"]]  # noqa: E731
    wait_for(lambda: any("estimate_ms" in values for values in head()), 90, what="the head calibrated against the edge")
    x = np.random.default_rng(1).standard_normal((1, 128)).astype(np.float32)
    routes = {devices[0].models.infer({"x": x}).route for _ in range(20)}
    assert any(r.startswith("split:") or r in ("edge", "device") for r in routes), routes
    wait_for(lambda: any(values["requests"] >= 20 for values in head()), 30, what="the head's sample counting the requests")
    ui.wait(lambda: ui.find("#split-routes canvas") and ui.find("#split-cut canvas") and "Split inference" in ui.text("#split"), 30, what="the split charts")
    browser.execute_script("document.getElementById('split').scrollIntoView()")
    ui.shot("task-split")
    assert ui.find("#rounds").is_displayed() is False  # no rounds in a split task: the card is hidden
    ui.go("#/tasks")
    ui.wait(lambda: "federated_training" in ui.text("table"), what="the task list")
    ui.shot("tasks")
    ui.go("#/deployments")
    ui.shot("deployments")
    ui.go("#/privacy")
    ui.shot("privacy")

    # Tokens need an admin; a viewer sees no write control, and a write forged with its token is refused
    ui.sign_out()
    ui.sign_in(s.hub.tokens["admin"])
    ui.go("#/tokens")
    ui.wait(lambda: "New token" in ui.text(), what="the tokens page")
    ui.shot("tokens")
    ui.sign_out()
    ui.sign_in(s.hub.tokens["viewer"])
    assert "Tokens" not in ui.text("#nav")
    for route in ("#/nodes", "#/devices", f"#/devices/{devices[0].device_id}", "#/artifacts", "#/deployments", "#/tasks", f"#/tasks/{task['id']}"):
        ui.go(route)
        ui.wait(lambda: "…" not in ui.text("main"), what=f"{route} filled")
        forms = [f.get_attribute("aria-label") for f in ui.all("main form:not([role=search])")]
        buttons = [b.text for b in ui.all("main button") if b.text not in ("Filter", "Previous page", "Next page")]
        assert forms == [] and buttons == [], (route, forms, buttons)
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/api/v1/devices/' + arguments[0], {method: 'PATCH', headers: {'Authorization': 'Bearer ' + sessionStorage.getItem('aisynergy.token'),"
        " 'Content-Type': 'application/json'}, body: JSON.stringify({labels: {forged: 'yes'}})}).then(r => done(r.status));",
        devices[0].device_id,
    )
    assert status == 403
    assert "forged" not in api(s, "GET", f"/devices/{devices[0].device_id}", "viewer")["labels"]

    # A token revoked while the console is open returns it to the sign-in page
    revoked = api(s, "POST", "/tokens", "admin", json={"role": "viewer", "name": "short-lived"})
    ui.sign_out()
    ui.sign_in(revoked["token"])
    with s.hub.client("admin") as client:
        assert client.delete(f"/tokens/{revoked['id']}").status_code == 204
    ui.go("#/overview")
    ui.wait(lambda: ui.find("#token") and "sign in again" in ui.text(".form-error"), 30, what="back at sign-in once the token is revoked")

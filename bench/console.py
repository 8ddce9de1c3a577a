"""The web console under load (issue 20): how long until the nodes page is usable with 10,000 registered nodes,
measured in headless Chromium (Debian's ``chromium`` and ``chromium-driver``), the size of the console's assets,
and the hub's CPU while consoles sit open and idle.

What runs: a broker and a hub (SQLite, plain HTTP on the loopback, as the tests start them); ``--nodes`` nodes
registered through ``POST /nodes`` (8 at a time); then, in one browser:

* **nodes page**: sign in once, then ``--loads`` times: load ``/console/#/nodes`` afresh (a new page load, the
  browser's cache emptied) and time, in the page (``performance.now()``, from navigation start), until its table
  holds a full page of rows (50) and its pager is drawn: the moment an operator can read and act on it. The node
  status column fills in after that (one request a row) and is timed too.
* **idle cost**: ``--tabs`` windows open on the overview (each polls ``/summary`` and four short lists every 5 s
  with ``If-None-Match``), left alone; the hub's CPU time (user + system, psutil) over ``--idle-s`` seconds, as a
  share of one core. Also with no console open (the hub's own housekeeping), for the difference.

Usage::

    python bench/console.py [--nodes 10000] [--loads 5] [--idle-s 60] [--tabs 1 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import start_broker, start_hub, stop  # noqa: E402

STATIC = ROOT / "cloud" / "console" / "static"


def register(hub_url: str, token: str, count: int) -> float:
    started = time.perf_counter()
    with httpx.Client(base_url=hub_url + "/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        def one(k: int) -> None:
            r = client.post("/nodes", json={"name": f"gw-{k:05d}", "labels": {"zone": "abcd"[k % 4], "bench": "console"}})
            r.raise_for_status()

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(count)))
    return time.perf_counter() - started


def browser() -> object:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,800"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)


READY = """
const done = arguments[arguments.length - 1];
const mode = arguments[0];
const t0 = performance.now();
(function check() {
  const rows = document.querySelectorAll("main table tbody tr").length;
  const pager = [...document.querySelectorAll("main button")].some((b) => b.textContent === "Next page" && !b.disabled);
  const filled = [...document.querySelectorAll("main table tbody td div[id^=status-]")].filter((d) => d.textContent !== "…").length;
  if (rows >= 50 && pager && mode === "table") return done(performance.now());
  if (rows >= 50 && filled >= 50 && mode === "status") return done(performance.now());
  if (performance.now() - t0 > 60000) return done(-1);  // not usable within a minute
  setTimeout(check, 5);
})();
"""


def nodes_page(driver: object, base: str, token: str, loads: int) -> tuple[list[float], list[float]]:
    d = driver  # type: ignore[assignment]
    d.get(base + "/console/")  # type: ignore[attr-defined]
    d.execute_script("sessionStorage.setItem('aisynergy.token', arguments[0])", token)  # type: ignore[attr-defined]
    usable, filled = [], []
    for load in range(loads):
        d.execute_cdp_cmd("Network.clearBrowserCache", {})  # type: ignore[attr-defined]
        d.get(f"{base}/console/?load={load}#/nodes")  # type: ignore[attr-defined]  # another URL: a full page load, not a hash change
        d.set_script_timeout(90)  # type: ignore[attr-defined]
        usable.append(float(d.execute_async_script(READY, "table")))  # type: ignore[attr-defined]
        filled.append(float(d.execute_async_script(READY, "status")))  # type: ignore[attr-defined]
    return usable, filled


def idle_cpu(hub_pid: int, seconds: float) -> float:
    proc = psutil.Process(hub_pid)
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    return 100 * ((after.user - before.user) + (after.system - before.system)) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--idle-s", type=float, default=60.0)
    parser.add_argument("--tabs", type=int, nargs="+", default=[1, 10])
    args = parser.parse_args()

    assets = {p.relative_to(STATIC).as_posix(): p.stat().st_size for p in sorted(STATIC.rglob("*")) if p.is_file() and p.suffix in (".html", ".js", ".css")}
    print("console assets:", ", ".join(f"{k} {v:,} B" for k, v in assets.items()), f"(total {sum(assets.values()):,} B)")
    tmp = Path(tempfile.mkdtemp(prefix="bench-console-"))
    broker = start_broker(tmp / "stack")  # the hub and its broker share the PKI of one data directory
    hub = start_hub(tmp / "stack", f"sqlite:///{tmp / 'hub.db'}", broker.url)
    driver = None
    try:
        took = register(hub.url, hub.tokens["operator"], args.nodes)
        print(f"registered {args.nodes} nodes in {took:.1f} s")
        driver = browser()
        usable, filled = nodes_page(driver, hub.url, hub.tokens["viewer"], args.loads)
        print(f"nodes page usable (50 rows and the pager), ms: {', '.join(f'{x:.0f}' for x in usable)}; median {statistics.median(usable):.0f}")
        print(f"its status column filled, ms: {', '.join(f'{x:.0f}' for x in filled)}; median {statistics.median(filled):.0f}")
        driver.quit()  # type: ignore[attr-defined]
        driver = None
        print(f"hub CPU, no console open, {args.idle_s:g} s: {idle_cpu(hub.proc.pid, args.idle_s):.2f} % of a core")
        for tabs in args.tabs:
            driver = browser()
            d = driver
            d.get(hub.url + "/console/")  # type: ignore[attr-defined]
            d.execute_script("sessionStorage.setItem('aisynergy.token', arguments[0])", hub.tokens["viewer"])  # type: ignore[attr-defined]
            d.get(hub.url + "/console/?open=0#/overview")  # type: ignore[attr-defined]
            for tab in range(tabs - 1):
                d.switch_to.new_window("window")  # type: ignore[attr-defined]
                d.get(hub.url + "/console/")  # type: ignore[attr-defined]
                d.execute_script("sessionStorage.setItem('aisynergy.token', arguments[0])", hub.tokens["viewer"])  # type: ignore[attr-defined]
                d.get(f"{hub.url}/console/?open={tab + 1}#/overview")  # type: ignore[attr-defined]
            time.sleep(10)  # past the first full reads
            print(f"hub CPU, {tabs} idle overview page(s) open, {args.idle_s:g} s: {idle_cpu(hub.proc.pid, args.idle_s):.2f} % of a core")
            d.quit()  # type: ignore[attr-defined]
            driver = None
    finally:
        if driver is not None:
            driver.quit()  # type: ignore[attr-defined]
        stop(hub.proc)
        stop(broker.proc)


if __name__ == "__main__":
    main()

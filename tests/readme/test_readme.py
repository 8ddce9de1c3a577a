"""The README's commands, as a newcomer pastes them (issue 20): every ```bash block that follows a
``<!-- README test -->`` line is taken from README.md itself (so the two cannot drift apart), in order, and run as
one bash script (``set -euo pipefail``: the first command that fails fails the test) against a fresh ``aisynergy
up --datasets digits`` (the stack the README's federated, DP and split sections start from), from a working directory laid out like the checkout (``.venv``, ``tests``, ``examples`` and the stack's
``.data``). The README's ports (hub 8000, broker 8883, the edges' device listeners 8090 and 8091) become free ports
of this machine; nothing else of the text is changed. Whatever the script left running (the edges started with
``&``) is stopped with it.

Not run here, each for its reason: ``experiment sites`` (it starts a stack of its own and trains for minutes: run by
hand, figures in BENCHMARKS.md), the whole conformance suite (the README's block runs clause 8.1; every clause runs
in ``tests/conformance``), docker-compose (no container runtime on the test machines) and the SDK's Python
snippet (placeholders for a board's own values)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import AISYNERGY, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^<!-- README test -->\n```bash\n(.*?)^```$", re.MULTILINE | re.DOTALL)
PORTS = ("8000", "8883", "8090", "8091")


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_the_readme_marks_its_runnable_blocks() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 15
    assert all("…" not in b.replace("# ", "#").split("#")[0] for b in blocks)  # no placeholder left to guess in a command


@pytest.mark.timeout(1800)
def test_the_readme_s_commands_run_in_order_on_a_fresh_stack(tmp_path: Path) -> None:
    # Prepare: a fresh `aisynergy up` on free ports, and a working directory laid out like the checkout
    ports = {p: str(free_port()) for p in PORTS}
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("tests", "examples"):
        (work / name).symlink_to(ROOT / name)
    (work / ".venv").symlink_to(Path(sys.prefix))
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen([*AISYNERGY, "up", "--data-dir", str(work / ".data"), "--hub-port", ports["8000"], "--broker-port", ports["8883"],
                           "--enrol-port", ports["8090"], "--no-table", "--datasets", "digits"], stdout=log, stderr=subprocess.STDOUT, cwd=work)  # fmt: skip
    script = "set -euo pipefail\n" + "\n".join(readme_blocks())
    for readme_port, port in ports.items():
        script = re.sub(rf"(?<![0-9]){readme_port}(?![0-9])", port, script)
    (tmp_path / "readme.sh").write_text(script)
    runner = None
    try:
        wait_for(lambda: (tmp_path / "up.log").read_text().count(": ONLINE") >= 3 or up.poll() is not None, 180, interval=0.3, what="the stack ONLINE")
        assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]

        # Execute: the README's blocks, in order, as one script
        env = {k: v for k, v in os.environ.items() if not k.startswith("AISYNERGY_")}
        output = tmp_path / "readme.out"
        with output.open("wb") as sink:  # a file, not a pipe: what the script ran so far stays readable if it hangs
            runner = subprocess.Popen(["bash", "-x", str(tmp_path / "readme.sh")], cwd=work, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # fmt: skip
            try:
                runner.wait(timeout=1500)
            except subprocess.TimeoutExpired:
                raise AssertionError("the README's commands did not end in 1500 s:\n" + output.read_text(errors="replace")[-6000:]) from None
        text = output.read_text(errors="replace")

        # Assert: every command succeeded, and what the README says it shows is there
        assert runner.returncode == 0, text[-6000:]
        assert "ONLINE" in text and "gw-2" in text
        assert '"pong"' in text or "pong" in text
        assert "2 devices match" in text
        assert (work / "y.safetensors").exists()
        assert "round 0 (the starting model): held-out accuracy" in text and "published model digits 1.0.1" in text  # federated, live
        assert "trained from digits 1.0.0" in text and "spent" in text  # DP fine-tuning: lineage and the ε spent
        assert "cut_index" in text  # split inference's metrics
        assert '"name":"mlp-chunked"' in text  # the chunked upload with curl, committed
        assert "published model digits-fl-parameters 1.0.0 (safetensors)" in text  # whole-model rounds on the devices
        assert '"phase": "evaluate"' in text and "my-algo 0.1.0" in text  # an algorithm from the template, run and stored
        assert "published model digits-numpy-cnn 1.0.0 (onnx)" in text and "the evaluation on the site's own data" in text  # on gw-3
        assert "published model digits-numpy-cnn 1.0.1 (onnx)" in text  # on a board
        assert all((work / ".data" / name).exists() for name in ("quality.json", "efficiency.json", "fl.json"))  # simulations
        assert "0 FAIL, 0 ERROR" in text and (work / ".data" / "conformance-report.md").exists()
    finally:
        if runner is not None:
            try:
                os.killpg(runner.pid, signal.SIGTERM)  # an edge the README started with &
            except ProcessLookupError:
                pass
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()

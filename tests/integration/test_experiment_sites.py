"""``aisynergy experiment sites`` (issue 19, deliverable 8): the seed's demo on real processes.

The command starts a broker, a hub and one edge agent per site (plus ``central``) on this machine, runs the
federated task and the local-only and centralised training tasks through the hub, and prints the comparison. The
figures it writes must be the hub's: every site fitted every round, each round moved the model down to and an
update up from every site (no compression: a model-sized file each way), the shards partition the training images.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from cloud.simulation.quality import load_digits
from cloud.simulation.sites import write_shards

ROOT = Path(__file__).resolve().parents[2]


def test_the_shards_partition_the_training_images_non_iid_and_every_arm_shares_the_held_out_set(tmp_path: Path) -> None:
    shards, pooled, test, labels = write_shards(tmp_path, 5, 0.5, seed=0)
    data = load_digits(seed=0)
    ys = [np.load(s)["y"] for s in shards]
    assert sum(len(y) for y in ys) == len(data.y_train) == len(np.load(pooled)["y"])
    assert sorted(np.concatenate(ys).tolist()) == sorted(data.y_train.tolist())
    assert np.load(test)["x"].shape == (len(data.y_test), 1, 8, 8) and np.load(test)["x"].dtype == np.float32
    assert [sum(c.values()) for c in labels] == [len(y) for y in ys]
    # non-IID: each site's most common label is well above a tenth of its images
    assert min(max(c.values()) / sum(c.values()) for c in labels) > 0.2, labels


def test_the_experiment_runs_every_arm_through_the_hub_and_reports_the_measured_figures(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "AISYNERGY_LOG_LEVEL": "WARNING"}
    run = subprocess.run(
        [sys.executable, "-m", "cloud.cli.root", "experiment", "sites", "--sites", "2", "--rounds", "2", "--data-dir", str(tmp_path / "stack"),
         "--link-mbps", "10", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "local-only (mean of 2)" in run.stdout and "federated (fedavg)" in run.stdout and "centralised (pooled)" in run.stdout
    for arm in ("federated_accuracy", "centralised_accuracy", "local_mean_accuracy"):
        assert 0.0 < result[arm] <= 1.0, (arm, result)
    sites = result["sites"]
    assert [s["name"] for s in sites] == ["site-1", "site-2"] and len({s["node_id"] for s in sites}) == 2
    assert all(s["rounds_fitted"] == 2 and s["fit_s"] > 0 and s["local_accuracy"] is not None for s in sites), sites
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [1.0, 2.0]
    model = rounds[0]["model_bytes"]
    assert model > 5_000  # the CNN's 1,370 float32 parameters and the file's header
    for r in rounds:  # every site downloaded the round's model and uploaded a model-sized update
        assert r["contributors"] == 2 and r["bytes_down"] == 2 * model and r["bytes_up"] == 2 * model, r
    # the communication time is the measured bytes on the declared link (10 Mbit/s) plus 20 ms each way a round
    for s in sites:
        assert s["bytes_down"] == s["bytes_up"] == 2 * model
        assert abs(s["communication_s"] - (4 * model * 8 / 10e6 + 2 * 2 * 0.020)) < 1e-9
    c = result["comparison"]
    assert abs(c["federated_minus_local_points"] - 100 * (result["federated_accuracy"] - result["local_mean_accuracy"])) < 1e-9
    assert c["bytes_per_round"] == 4 * model
    assert set(result["task_ids"]["local"]) == {"site-1", "site-2"}

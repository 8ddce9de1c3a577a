"""The algorithm SDK (device.algorithm): the manifest, loading a client and each way it is refused, the results'
checks, safetensors parameters, packages (deterministic, zip-slip refused) and ``aisynergy algorithm``."""

from __future__ import annotations

import json
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from device.algorithm import AlgorithmError, checked_evaluate, checked_fit, load_client, load_parameters, save_parameters
from device.algorithm.cli import algorithm
from device.algorithm.package import build, unpack
from interfaces.algorithms import AlgorithmManifest, check_specifier

SCHEMA = {"type": "object", "properties": {"epochs": {"type": "integer", "minimum": 1, "default": 2}}, "additionalProperties": False}
CLIENT = '''
import numpy as np
from device.algorithm import Client

class Good(Client):
    def initial_parameters(self):
        return {"w": np.zeros(3, np.float32)}
    def fit(self, parameters, config):
        return {"w": parameters["w"] + 1}, 10, {"loss": 0.5}
    def evaluate(self, parameters, config):
        return 0.25, 10, {"accuracy": 1.0}

class NoFit:
    def __init__(self, config, datasets): pass
    def initial_parameters(self): return {}
    def evaluate(self, parameters, config): return 0.0, 1, {}
'''


def _package(root: Path, entry_point: str = "algo_pkg.client:Good", schema: dict[str, Any] | None = None) -> Path:
    (root / "algo_pkg").mkdir(parents=True)
    (root / "algo_pkg" / "__init__.py").write_text("")
    (root / "algo_pkg" / "client.py").write_text(CLIENT)
    manifest = {"name": "algo", "version": "1.0.0", "entry_point": entry_point, "frameworks": {"numpy": ">=1.26"},
                "config_schema": schema or SCHEMA}
    (root / "algorithm.json").write_text(json.dumps(manifest))
    return root


def test_manifest_is_strict() -> None:
    good = {"name": "a", "version": "1.0.0", "entry_point": "a.b:C"}
    assert AlgorithmManifest.model_validate(good).class_name == "C"
    for bad in ({"entry_point": "a.b"}, {"frameworks": {"torch": "=>2"}}, {"config_schema": {"type": "array"}},
                {"config_schema": {"type": "object", "$schema": "http://json-schema.org/draft-07/schema#"}},
                {"resources": {"memory_bytes": "1"}}, {"resources": {"accelerators": -1}}, {"other": 1}, {"version": 1}):
        with pytest.raises(ValidationError):
            AlgorithmManifest.model_validate(good | bad)


@pytest.mark.parametrize("spec", [">=2.0", "==2.*", "~=1.4", ">=1.26,<3", "!=2.1.*", ">=1.0rc1", "", "==1.0+cpu"])
def test_specifiers_pep440_accepts(spec: str) -> None:
    assert check_specifier(spec) == spec


@pytest.mark.parametrize("spec", ["=>1", "1.0", "~=1", ">=1.0.*", ">=1.0+cpu"])
def test_specifiers_pep440_refuses(spec: str) -> None:
    with pytest.raises(ValueError):
        check_specifier(spec)
    packaging = pytest.importorskip("packaging.specifiers")
    with pytest.raises(packaging.InvalidSpecifier):
        packaging.SpecifierSet(spec)


def test_load_fills_defaults_and_runs(tmp_path: Path) -> None:
    manifest, client = load_client(_package(tmp_path / "p"))
    assert manifest.name == "algo" and client.config == {"epochs": 2}
    fitted = checked_fit(client, client.initial_parameters(), {})
    assert fitted.num_examples == 10 and fitted.parameters["w"].tolist() == [1, 1, 1]
    assert checked_evaluate(client, fitted.parameters, {}).loss == 0.25


@pytest.mark.parametrize(("case", "message"), [
    ("no manifest", "no algorithm.json"),
    ("bad manifest", "not a valid manifest"),
    ("bad schema", "not a valid JSON Schema"),
    ("no module", "cannot import"),
    ("no class", "has no class"),
    ("no fit", "lacks fit"),
    ("bad config", "does not satisfy"),
    ("no dataset", "does not exist"),
])
def test_load_errors_say_what_is_wrong(tmp_path: Path, case: str, message: str) -> None:
    root, config, datasets = tmp_path / "p", {}, {}
    if case == "no manifest":
        root.mkdir()
    elif case == "bad manifest":
        _package(root, entry_point="not an entry point")
    elif case == "bad schema":
        _package(root, schema={"type": "object", "properties": {"epochs": {"type": "integr"}}})
    elif case == "no module":
        _package(root, entry_point="missing.client:Good")
    elif case == "no class":
        _package(root, entry_point="algo_pkg.client:Missing")
    elif case == "no fit":
        _package(root, entry_point="algo_pkg.client:NoFit")
    else:
        _package(root)
        config = {"epochs": 0} if case == "bad config" else {}
        datasets = {"train": tmp_path / "absent.npz"} if case == "no dataset" else {}
    with pytest.raises(AlgorithmError, match=message):
        load_client(root, config, datasets)


class _Returns:
    def __init__(self, fit: Any = None, evaluate: Any = None) -> None:
        self._fit, self._evaluate = fit, evaluate

    def fit(self, parameters: Any, config: Any) -> Any:
        return self._fit

    def evaluate(self, parameters: Any, config: Any) -> Any:
        return self._evaluate


GIVEN = {"w": np.zeros((2, 3), np.float32)}


@pytest.mark.parametrize(("result", "message"), [
    ({"w": np.zeros((2, 3), np.float32)}, "returns \\(parameters"),
    (({"v": np.zeros((2, 3), np.float32)}, 1, {}), "other parameter names"),
    (({"w": np.zeros((2, 3), np.float64)}, 1, {}), "float64"),
    (({"w": np.zeros((3, 2), np.float32)}, 1, {}), "\\[3, 2\\]"),
    (({"w": [[0.0] * 3] * 2}, 1, {}), "not a numpy array"),
    ((GIVEN, 0, {}), "positive integer"),
    ((GIVEN, True, {}), "positive integer"),
    ((GIVEN, 1.0, {}), "positive integer"),
    ((GIVEN, 1, {"acc": "high"}), "finite number"),
    ((GIVEN, 1, {"acc": float("nan")}), "finite number"),
    ((GIVEN, 1, [("acc", 1.0)]), "mapping of str to float"),
])
def test_fit_results_are_checked(result: Any, message: str) -> None:
    with pytest.raises(AlgorithmError, match=message):
        checked_fit(_Returns(fit=result), GIVEN, {})


@pytest.mark.parametrize("result", [(float("inf"), 1, {}), ("0.1", 1, {}), (0.1, -1, {}), (0.1, 1)])
def test_evaluate_results_are_checked(result: Any) -> None:
    with pytest.raises(AlgorithmError):
        checked_evaluate(_Returns(evaluate=result), GIVEN, {})


def test_parameters_round_trip_as_safetensors(tmp_path: Path) -> None:
    parameters = {"conv1.weight": np.arange(8, dtype=np.float32).reshape(2, 4), "step": np.array([3], np.int64)}
    save_parameters(parameters, tmp_path / "p.safetensors")
    loaded = load_parameters(tmp_path / "p.safetensors")
    assert {n: (a.dtype, a.tolist()) for n, a in loaded.items()} == {n: (a.dtype, a.tolist()) for n, a in parameters.items()}
    (tmp_path / "bad").write_bytes(b"not safetensors")
    with pytest.raises(AlgorithmError, match="not a safetensors file"):
        load_parameters(tmp_path / "bad")


def test_build_is_deterministic_and_unpacks(tmp_path: Path) -> None:
    source = _package(tmp_path / "src")
    (source / "algo_pkg" / "__pycache__").mkdir()
    (source / "algo_pkg" / "__pycache__" / "client.cpython-311.pyc").write_bytes(b"x")
    first = build(source, tmp_path / "a")
    (source / "algo_pkg" / "client.py").touch()
    second = build(source, tmp_path / "b")
    assert first.name == "algo-1.0.0.zip" and first.read_bytes() == second.read_bytes()
    assert zipfile.ZipFile(first).namelist() == ["algo_pkg/__init__.py", "algo_pkg/client.py", "algorithm.json"]
    _, client = load_client(unpack(first, tmp_path / "out"))
    assert checked_fit(client, client.initial_parameters(), {}).num_examples == 10


def test_build_refuses_an_invalid_manifest(tmp_path: Path) -> None:
    source = _package(tmp_path / "src", entry_point="bad")
    with pytest.raises(AlgorithmError, match="not a valid manifest"):
        build(source, tmp_path / "out")


@pytest.mark.parametrize("name", ["../evil.py", "/etc/evil.py", "a/../../evil.py", "link"])
def test_unpack_refuses_entries_outside(tmp_path: Path, name: str) -> None:
    bad = tmp_path / "bad.zip"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("algorithm.json", "{}")
        info = zipfile.ZipInfo(name)
        if name == "link":
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(info, "/etc/passwd")
    with pytest.raises(AlgorithmError, match="outside the package|symbolic link"):
        unpack(bad, tmp_path / "dest")
    assert not (tmp_path / "evil.py").exists() and not (tmp_path / "dest").exists()


def _digits_npz(path: Path) -> Path:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    x = (np.eye(3)[y] * 2 + rng.normal(0, 0.3, (300, 3))).astype(np.float32)
    np.savez(path, x=x, y=y.astype(np.int64))
    return path


def test_cli_new_then_run_then_build(tmp_path: Path) -> None:
    runner = CliRunner()
    made = runner.invoke(algorithm, ["new", "my-algo", "--dir", str(tmp_path)])
    assert made.exit_code == 0, made.output
    data = _digits_npz(tmp_path / "train.npz")
    ran = runner.invoke(algorithm, ["run", str(tmp_path / "my-algo"), "--dataset", f"train={data}", "--rounds", "2",
                                    "--config", '{"classes": 3, "epochs": 3}', "--save", str(tmp_path / "out.safetensors")])
    assert ran.exit_code == 0, ran.output
    lines = [json.loads(line) for line in ran.output.splitlines()]
    assert [(line["round"], line["phase"]) for line in lines] == [(1, "fit"), (1, "evaluate"), (2, "fit"), (2, "evaluate")]
    assert lines[-1]["metrics"]["accuracy"] >= 0.9
    assert sorted(load_parameters(tmp_path / "out.safetensors")) == ["linear.bias", "linear.weight"]
    built = runner.invoke(algorithm, ["build", str(tmp_path / "my-algo"), "--out", str(tmp_path / "dist")])
    assert built.exit_code == 0 and Path(built.output.strip()).is_file()


def test_cli_run_zero_rounds_saves_the_initial_parameters_without_fitting(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(algorithm, ["new", "my-algo", "--dir", str(tmp_path)]).exit_code == 0
    data = _digits_npz(tmp_path / "train.npz")
    config = '{"classes": 3, "epochs": 3}'
    ran = runner.invoke(algorithm, ["run", str(tmp_path / "my-algo"), "--dataset", f"train={data}", "--rounds", "0", "--config", config,
                                    "--save", str(tmp_path / "initial.safetensors")])  # fmt: skip
    assert ran.exit_code == 0 and ran.output == "", ran.output  # nothing fitted, nothing evaluated
    once = runner.invoke(algorithm, ["run", str(tmp_path / "my-algo"), "--dataset", f"train={data}", "--rounds", "1", "--config", config,
                                     "--save", str(tmp_path / "trained.safetensors")])  # fmt: skip
    assert once.exit_code == 0, once.output
    initial, trained = load_parameters(tmp_path / "initial.safetensors"), load_parameters(tmp_path / "trained.safetensors")
    assert sorted(initial) == sorted(trained) == ["linear.bias", "linear.weight"]
    assert all(initial[k].shape == trained[k].shape for k in initial) and not np.allclose(initial["linear.weight"], trained["linear.weight"])


@pytest.mark.parametrize("args", [["--config", '{"epochs": 0}'], ["--config", "{not json"], ["--dataset", "nopath"],
                                  ["--dataset", "train=/nonexistent.npz"]])
def test_cli_run_bad_input_exits_2(tmp_path: Path, args: list[str]) -> None:
    runner = CliRunner()
    assert runner.invoke(algorithm, ["new", "t", "--dir", str(tmp_path)]).exit_code == 0
    result = runner.invoke(algorithm, ["run", str(tmp_path / "t"), *args])
    assert result.exit_code == 2, result.output
    assert "Error" in result.output

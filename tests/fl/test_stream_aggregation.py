"""Strategy.aggregate_stream over safetensors files: the numpy definitions, aggregate's exact result, bounded memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from interfaces.aggregation import (
    STRATEGIES,
    ClientUpdate,
    DictSource,
    FedAdam,
    FedAvg,
    Strategy,
    StreamUpdate,
    TrimmedMean,
    Weights,
    strategy_from_meta,
    strategy_from_spec,
)
from interfaces.tensorfile import TensorFile, TensorInfo, TensorWriter, write_tensors

SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 72), "fc.bias": (10,), "scale": ()}
COUNTS = [120, 7, 300, 45, 61]
PARAMS = {"fedavg": {}, "fedprox": {"mu": 0.1}, "fedadam": {"eta": 0.03}, "median": {}, "trimmed_mean": {"beta": 0.2}}


def model(rng: np.random.Generator) -> Weights:
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def round_updates(x0: Weights, seed: int) -> list[Weights]:
    """Five participants' models near ``x0``; the fourth sends float16."""
    rng = np.random.default_rng(seed)
    return [
        {name: (a + 0.1 * rng.standard_normal(a.shape)).astype(np.float16 if k == 3 else np.float32)
         for name, a in x0.items()}
        for k in range(len(COUNTS))
    ]


def save(path: Path, weights: Weights) -> Path:
    write_tensors(path, {name: TensorInfo.of(a) for name, a in weights.items()}, weights.__getitem__)
    return path


def load(path: Path) -> Weights:
    with TensorFile(path) as file:
        return {name: file.read(name) for name in file.names}


def stream_round(strategy: Strategy, tmp: Path, x: Weights, updates: list[Weights], tag: str,
                 state_in: Path | None = None) -> tuple[Weights, Path]:
    """One round as the hub runs it: every model a file, the new model and state written as they come."""
    files = [TensorFile(save(tmp / f"{tag}-update-{k}.safetensors", u)) for k, u in enumerate(updates)]
    stream = [StreamUpdate(f, n, participant=f"device-{k}") for k, (f, n) in enumerate(zip(files, COUNTS))]
    state_path = tmp / f"{tag}-state.safetensors"
    with TensorFile(save(tmp / f"{tag}-global.safetensors", x)) as global_file, \
            TensorWriter(tmp / f"{tag}-new.safetensors", global_file.infos()) as writer, \
            TensorWriter(state_path, strategy.state_infos(global_file.infos())) as state_writer:
        previous = TensorFile(state_in) if state_in is not None else None
        strategy.aggregate_stream(global_file, stream, writer.write, state_in=previous, state_out=state_writer.write)
        if previous is not None:
            previous.close()
    for f in files:
        f.close()
    return load(tmp / f"{tag}-new.safetensors"), state_path


def reference(name: str, x: Weights, updates: list[Weights], moments: dict[str, Weights]) -> dict[str, np.ndarray]:
    """The definitions in plain numpy, float64 (FedAdam updates ``moments`` in place)."""
    out = {}
    for tensor in SHAPES:
        stack = np.stack([u[tensor].astype(np.float64) for u in updates])
        if name in ("fedavg", "fedprox", "fedadam"):
            out[tensor] = np.average(stack, weights=np.array(COUNTS, dtype=np.float64), axis=0)
        elif name == "median":
            out[tensor] = np.median(stack, axis=0)
        else:
            out[tensor] = np.sort(stack, axis=0)[1:4].mean(axis=0)  # beta 0.2 of 5: one trimmed at each end
        if name == "fedadam":
            delta = out[tensor] - x[tensor].astype(np.float64)
            m = 0.9 * moments["m"].get(tensor, 0.0) + 0.1 * delta
            v = 0.99 * moments["v"].get(tensor, 0.0) + 0.01 * delta**2
            moments["m"][tensor], moments["v"][tensor] = m, v
            out[tensor] = x[tensor] + 0.03 * m / (np.sqrt(v) + 1e-3)
    return out


# --------------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_streaming_over_files_is_the_definition_and_exactly_aggregate(tmp_path: Path, name: str) -> None:
    x0 = model(np.random.default_rng(3))
    rounds = 3 if name == "fedadam" else 1
    in_memory = strategy_from_spec(name, **PARAMS[name])
    meta = strategy_from_spec(name, **PARAMS[name]).state_meta()
    x_stream, x_memory, x_ref = x0, x0, {k: a.astype(np.float64) for k, a in x0.items()}
    moments: dict[str, Weights] = {"m": {}, "v": {}}
    state: Path | None = None

    for r in range(rounds):
        updates = round_updates(x0, seed=10 + r)
        hub = strategy_from_meta(json.loads(json.dumps(meta)))  # a hub keeps the meta, the moments in a file
        x_stream, state = stream_round(hub, tmp_path, x_stream, updates, f"r{r}", state_in=state)
        meta = hub.state_meta()
        x_memory = in_memory.aggregate(x_memory, [ClientUpdate(u, n) for u, n in zip(updates, COUNTS)])
        x_ref = reference(name, x_ref, updates, moments)
        x_ref = {k: a.astype(np.float32).astype(np.float64) for k, a in x_ref.items()}  # what the round hands on

        for tensor in SHAPES:
            assert x_stream[tensor].dtype == np.float32 and x_stream[tensor].shape == SHAPES[tensor]
            np.testing.assert_array_equal(x_stream[tensor], x_memory[tensor], err_msg=tensor)
            np.testing.assert_allclose(x_stream[tensor].astype(np.float64), x_ref[tensor], rtol=0, atol=1e-6,
                                       err_msg=f"round {r}: {tensor}")

    assert meta["rounds"] == rounds and state is not None
    arrays = in_memory.state()[1]
    assert set(load(state)) == set(arrays)
    for key, array in load(state).items():
        np.testing.assert_array_equal(array, arrays[key], err_msg=key)


def test_without_state_out_fedadam_keeps_its_moments_as_aggregate_does() -> None:
    x0 = model(np.random.default_rng(4))
    streaming, plain = FedAdam(), FedAdam()

    for r in range(2):
        updates = round_updates(x0, seed=20 + r)
        out: Weights = {}
        streaming.aggregate_stream(DictSource(x0), [StreamUpdate(DictSource(u), n) for u, n in zip(updates, COUNTS)],
                                   out.__setitem__)
        expected = plain.aggregate(x0, [ClientUpdate(u, n) for u, n in zip(updates, COUNTS)])
        assert all(np.array_equal(out[k], expected[k]) for k in SHAPES)

    assert streaming.rounds == plain.rounds == 2
    assert all(np.array_equal(a, plain.state()[1][k]) for k, a in streaming.state()[1].items())


# -------------------------------------------------------------------------------------------------------- errors


def dict_updates(updates: list[Weights]) -> list[StreamUpdate]:
    return [StreamUpdate(DictSource(u), n, participant=f"device-{k}") for k, (u, n) in enumerate(zip(updates, COUNTS))]


def test_an_update_missing_a_tensor_is_refused_before_anything_is_read(tmp_path: Path) -> None:
    x0 = model(np.random.default_rng(5))
    updates = round_updates(x0, seed=1)
    del updates[2]["fc.bias"]
    given: list[str] = []

    with pytest.raises(ValueError, match=r"update #2 \('device-2'\).*missing tensors \['fc.bias'\]"):
        FedAvg().aggregate_stream(DictSource(x0), dict_updates(updates), lambda name, a: given.append(name))
    assert given == []


def test_a_tensor_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    x0 = model(np.random.default_rng(5))
    updates = round_updates(x0, seed=1)
    updates[1]["fc.bias"] = np.zeros(11, np.float32)
    files = [TensorFile(save(tmp_path / f"u{k}.safetensors", u)) for k, u in enumerate(updates)]

    with pytest.raises(ValueError, match=r"update #1 \('device-1'\): tensor 'fc.bias'.*\(11,\).*\(10,\)"):
        FedAvg().aggregate_stream(DictSource(x0), [StreamUpdate(f, 1, participant=f"device-{k}")
                                                   for k, f in enumerate(files)], lambda name, a: None)


def test_a_nan_found_while_streaming_names_the_update_and_tensor_and_leaves_no_round(tmp_path: Path) -> None:
    x0 = model(np.random.default_rng(6))
    updates = round_updates(x0, seed=2)
    updates[3]["fc.weight"][4, 5] = np.nan
    strategy = FedAdam()
    target = tmp_path / "new.safetensors"

    with pytest.raises(ValueError, match=r"update #3 \('device-3'\): tensor 'fc.weight' has NaN or infinite"), \
            TensorWriter(target, DictSource(x0).infos()) as writer:
        strategy.aggregate_stream(DictSource(x0), dict_updates(updates), writer.write)

    assert strategy.rounds == 0 and strategy.state()[1] == {}
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_too_few_updates_for_the_trimmed_mean_are_refused() -> None:
    x0 = model(np.random.default_rng(7))

    with pytest.raises(ValueError, match=r"trimmed_mean needs at least 5 updates per round, got 4.*plain mean"):
        TrimmedMean(beta=0.2).aggregate_stream(DictSource(x0), dict_updates(round_updates(x0, seed=3)[:4]),
                                               lambda name, a: None)


def test_moments_of_another_model_and_bad_arguments_are_refused() -> None:
    x0 = model(np.random.default_rng(8))
    updates = dict_updates(round_updates(x0, seed=4))
    stale = {f"{kind}/{name}": np.zeros(3) for kind in "mv" for name in SHAPES}

    with pytest.raises(ValueError, match="moments"):
        FedAdam().aggregate_stream(DictSource(x0), updates, lambda name, a: None, state_in=DictSource(stale))
    with pytest.raises(ValueError, match="global tensor 'scale' has dtype int64"):
        FedAvg().aggregate_stream(DictSource({**x0, "scale": np.array(1)}), updates, lambda name, a: None)
    with pytest.raises(ValueError, match="num_examples"):
        StreamUpdate(DictSource(x0), 0)


# -------------------------------------------------------------------------------------------------------- memory


def test_fedavg_over_files_holds_one_tensor_not_the_participants_models(tmp_path: Path) -> None:
    shapes = {"embed": (4_000_000,), "block.0": (2000, 1500), "block.1": (1000, 2000), "head": (1_000_000,),
              "bias": (64,)}  # 10 M float32: a 40 MB model
    rng = np.random.default_rng(9)

    def random_model(path: Path) -> TensorFile:
        infos = {name: TensorInfo("float32", shape) for name, shape in shapes.items()}
        write_tensors(path, infos, lambda name: rng.random(shapes[name], dtype=np.float32))
        return TensorFile(path)

    global_file = random_model(tmp_path / "global.safetensors")
    files = [random_model(tmp_path / f"update-{k}.safetensors") for k in range(5)]
    updates = [StreamUpdate(f, n) for f, n in zip(files, COUNTS)]
    largest = max(np.prod(shape) for shape in shapes.values()) * 8
    seen: dict[str, tuple[str, tuple[int, ...]]] = {}

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        FedAvg().aggregate_stream(global_file, updates, lambda name, a: seen.__setitem__(name, (a.dtype.name, a.shape)))
        growth = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        for f in [global_file, *files]:
            f.close()

    assert seen == {name: ("float32", shape) for name, shape in shapes.items()}
    assert growth < 2.5 * largest, f"peak grew by {growth / 2**20:.1f} MiB, the largest tensor is {largest / 2**20:.1f} MiB in float64"

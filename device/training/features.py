"""The frozen body of a model, run once over the local data: its features are what the last layer trains on.

The body is an ONNX model (the installed model cut at the input of its last dense layer by the hub) run in
ONNX Runtime on the CPU, in batches of ``batch_rows`` so memory stays bounded on a small board; between
batches ``go_on()`` may stop the work (a withdrawn order).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


class Stopped(Exception):
    """``go_on()`` said stop."""


def body_features(
    path: Path, x: np.ndarray, output: str, *, batch_rows: int = 256, threads: int | None = 1, go_on: Callable[[], bool] | None = None,
    with_ones: bool = False,
) -> np.ndarray:  # fmt: skip
    """``output`` of the ONNX model at ``path`` for every row of ``x`` (fed to its only input), as float32 [rows, d]
    (``with_ones``: [rows, d + 1], a last column of ones, what the trainer works on), written batch by batch into
    one array (no second copy).

    Raises ``ValueError`` when the body does not take one input or does not yield 2-D features, and
    :class:`Stopped` when ``go_on()`` returns False between batches.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise ValueError(f"the body takes {len(inputs)} inputs ({[i.name for i in inputs]}); training feeds one")
    if output not in {o.name for o in session.get_outputs()}:
        raise ValueError(f"the body has no output {output!r}")
    dtype = {"tensor(float)": np.float32, "tensor(double)": np.float64}.get(inputs[0].type, np.float32)
    if not len(x):
        raise ValueError("no rows to run the body on")
    out: np.ndarray | None = None
    for start in range(0, len(x), batch_rows):
        if go_on is not None and not go_on():
            raise Stopped
        (value,) = session.run([output], {inputs[0].name: np.ascontiguousarray(x[start : start + batch_rows], dtype=dtype)})
        if value.ndim != 2:
            raise ValueError(f"the body's output {output!r} has shape {list(value.shape)}; the last dense layer needs [rows, features]")
        if out is None:
            out = np.empty((len(x), value.shape[1] + with_ones), np.float32)
            if with_ones:
                out[:, -1] = 1
        out[start : start + len(value), : value.shape[1]] = value
    assert out is not None
    return out

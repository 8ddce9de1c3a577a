"""The algorithm SDK (issue 18): what a user's training package imports, and the tools that load and pack it.

``from device.algorithm import Client, Parameters, FitResult, EvaluateResult`` — the client API is
:mod:`device.algorithm.client`; :mod:`~device.algorithm.loader` builds a client from a package folder,
:mod:`~device.algorithm.package` zips and unzips packages, :mod:`~device.algorithm.cli` is ``aisynergy algorithm``.
"""

from device.algorithm.client import (
    AlgorithmError,
    Client,
    EvaluateResult,
    FitResult,
    Parameters,
    checked_evaluate,
    checked_fit,
    load_parameters,
    parameters_from_bytes,
    parameters_to_bytes,
    save_parameters,
)
from device.algorithm.loader import load_client, read_manifest

__all__ = [
    "AlgorithmError", "Client", "EvaluateResult", "FitResult", "Parameters", "checked_evaluate", "checked_fit",
    "load_client", "load_parameters", "parameters_from_bytes", "parameters_to_bytes", "read_manifest", "save_parameters",
]

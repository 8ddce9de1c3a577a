"""Federated-training simulation (DESIGN §5, ``seeds/002``): the two kinds AISynergy's simulation offers.

* :func:`run_quality` (:mod:`cloud.simulation.quality`) — a small model and many participants: what model quality
  federated training reaches.
* :func:`run_efficiency` (:mod:`cloud.simulation.efficiency`) — a large model and few participants: where each
  participant's time goes.
* :mod:`cloud.simulation.experiment` — ``aisynergy experiment fl``: local-only vs federated vs centralised (and
  federated with DP) on digits, built on the same model and data.

Both run in one process, with numpy only (no torch), and are deterministic for a seed (``quality`` exactly: the
same numbers on the same machine and numpy/BLAS; ``efficiency``'s times are measurements and vary, its weights and
byte counts do not). The aggregation is :mod:`interfaces.aggregation`'s, the same code the hub runs.

The simulation is not the runtime: nothing of it runs in the hub's task kinds (:mod:`cloud.fl`). One concern a
module: :mod:`~cloud.simulation.mlp` (the model, its forward, backward and SGD step), :mod:`~cloud.simulation.quality`,
:mod:`~cloud.simulation.efficiency`, :mod:`~cloud.simulation.experiment`, and :mod:`~cloud.simulation.common` (errors,
the strategy by name, the machine the times ran on). Each module's docstring defines what it measures.
"""

from cloud.simulation.common import STRATEGY_NAMES, TRAIN_EXTRA, MissingExtra, SimulationError, build_strategy, machine
from cloud.simulation.efficiency import (
    EFFICIENCY_CLASSES,
    EFFICIENCY_INPUT,
    SIZE_TOLERANCE,
    EfficiencyConfig,
    EfficiencyResult,
    EfficiencyRound,
    Link,
    ParticipantTimes,
    default_links,
    parse_count,
    per_participant,
    run_efficiency,
    size_mlp,
)
from cloud.simulation.mlp import (
    as_float32,
    evaluate,
    forward,
    init_mlp,
    layer_names,
    param_count,
    sgd_step,
    softmax_xent,
)
from cloud.simulation.quality import (
    DIGITS_CLASSES,
    DIGITS_SEED,
    DIGITS_TEST_SIZE,
    Digits,
    QualityConfig,
    QualityResult,
    QualityRound,
    dirichlet_split,
    label_skew,
    load_digits,
    local_train,
    run_quality,
)

__all__ = [
    "DIGITS_CLASSES",
    "DIGITS_SEED",
    "DIGITS_TEST_SIZE",
    "EFFICIENCY_CLASSES",
    "EFFICIENCY_INPUT",
    "SIZE_TOLERANCE",
    "STRATEGY_NAMES",
    "TRAIN_EXTRA",
    "Digits",
    "EfficiencyConfig",
    "EfficiencyResult",
    "EfficiencyRound",
    "Link",
    "MissingExtra",
    "ParticipantTimes",
    "QualityConfig",
    "QualityResult",
    "QualityRound",
    "SimulationError",
    "as_float32",
    "build_strategy",
    "default_links",
    "dirichlet_split",
    "evaluate",
    "forward",
    "init_mlp",
    "label_skew",
    "layer_names",
    "load_digits",
    "local_train",
    "machine",
    "param_count",
    "parse_count",
    "per_participant",
    "run_efficiency",
    "run_quality",
    "sgd_step",
    "size_mlp",
    "softmax_xent",
]

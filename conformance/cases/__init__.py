"""The cases, one module per part of the catalogue; importing this package registers them all."""

from conformance.cases import common, deployments, general, nodes, standard, tasks  # noqa: F401

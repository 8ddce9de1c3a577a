"""Task kinds as plug-ins (DESIGN §4.3): one registry of kinds, equal to the types of the contract, and generic
task code that never branches on a task's type (a new kind plugs in; it adds no branch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cloud.tasks.kind import KINDS, TaskKind, all_kinds, kind_of, node_roles
from interfaces.tasks import FL_AGGREGATOR, SPLIT_TAIL, TASK_TYPES, TaskType

ROOT = Path(__file__).resolve().parents[2]
GENERIC = [
    "cloud/services/tasks.py", "cloud/services/task_reports.py", "cloud/scheduler.py", "cloud/tasks/lifecycle.py",
]  # fmt: skip
"""the modules that drive every kind alike (``cloud.tasks.kind``, the registry, names each type once)"""


def test_the_registry_of_kinds_is_the_contract_s_types() -> None:
    assert set(KINDS) == set(TASK_TYPES)


@pytest.mark.parametrize("task_type", list(TaskType))
def test_each_type_s_kind_loads_and_is_a_kind_of_that_type(task_type: TaskType) -> None:
    kind = kind_of(task_type)
    assert isinstance(kind, TaskKind)
    assert kind.type is task_type
    assert kind_of(task_type.value) is kind  # a stored task's type is its text


def test_the_companion_roles_on_edge_nodes_are_the_kinds() -> None:
    assert node_roles() == {SPLIT_TAIL, FL_AGGREGATOR}
    assert {k.type for k in all_kinds() if k.node_roles} == {TaskType.SPLIT_INFERENCE, TaskType.FEDERATED_TRAINING}


def _a_task_s_type(node: ast.expr) -> bool:
    """``task.type``, ``t.type`` ...: a row's type (not the ``Task.type`` column of a query's filter)."""
    return isinstance(node, ast.Attribute) and node.attr == "type" and not (isinstance(node.value, ast.Name) and node.value.id == "Task")


def _type_branches(path: Path) -> list[str]:
    """Where a module names a task type (``TaskType.X``), reads a kind module, or compares a task's ``type``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "TaskType" and node.attr.isupper():
            found.append(f"{path.name}:{node.lineno} TaskType.{node.attr}")
        elif isinstance(node, ast.Compare) and any(_a_task_s_type(side) for side in [node.left, *node.comparators]):
            found.append(f"{path.name}:{node.lineno} compares a .type")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[:2] in (["cloud", "fl"], ["cloud", "incremental"], ["cloud", "split_inference"]):
            found.append(f"{path.name}:{node.lineno} imports {node.module}")
    return found


@pytest.mark.parametrize("module", GENERIC)
def test_the_generic_task_code_has_no_branch_on_the_type(module: str) -> None:
    assert _type_branches(ROOT / module) == []


def test_the_branch_finder_finds_a_branch() -> None:
    # the shape of what the generic code used to hold
    sample = ROOT / "tests" / "hub" / "_branchy_sample.py"
    try:
        sample.write_text("from cloud.fl import rounds\nif task.type == TaskType.FEDERATED_TRAINING.value:\n    pass\n")
        assert len(_type_branches(sample)) == 3
    finally:
        sample.unlink()


def test_a_task_s_body_is_one_variant_per_type_with_that_type_s_spec() -> None:
    from interfaces.tasks import TASK_CREATE_VARIANTS

    assert set(TASK_CREATE_VARIANTS) == set(TASK_TYPES)
    for task_type, variant in TASK_CREATE_VARIANTS.items():
        assert variant.model_fields["spec"].annotation is TASK_TYPES[task_type].spec


def test_the_openapi_shows_each_type_s_fields_for_post_tasks() -> None:
    import json

    spec = json.loads((ROOT / "interfaces" / "openapi.json").read_text())
    body = spec["paths"]["/api/v1/tasks"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["discriminator"]["propertyName"] == "type"
    mapping = body["discriminator"]["mapping"]
    assert set(mapping) == {t.value for t in TaskType}
    schemas = spec["components"]["schemas"]
    for task_type, ref in mapping.items():
        variant = schemas[ref.rsplit("/", 1)[-1]]
        assert variant["properties"]["type"]["const"] == task_type
        spec_ref = variant["properties"]["spec"]["$ref"].rsplit("/", 1)[-1]
        assert spec_ref == TASK_TYPES[TaskType(task_type)].spec.__name__  # type: ignore[union-attr]

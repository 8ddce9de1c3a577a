"""Parsing the options of ``aisynergy task create`` into a ``TaskCreate`` body, checked before anything is sent."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from interfaces.tasks import TASK_TYPES, TaskCreate, TaskType

_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# which command-line flag sets a field, for error messages
_FLAG_OF = {
    "spec.model": "--model", "spec.inputs": "--inputs", "spec.chunk_size": "--chunk-size", "spec.input_name": "--input-name",
    "spec.duration_s": "--duration", "placement.selector": "--selector", "placement.ids": "--ids", "placement.min_nodes": "--min-nodes",
    "placement.max_nodes": "--max-nodes", "placement.accelerators": "--accelerator", "timeout_s": "--timeout",
    "worker_timeout_s": "--worker-timeout", "heartbeat_s": "--heartbeat", "retry.max_attempts": "--max-attempts",
    "retry.backoff_s": "--backoff", "name": "--name", "type": "--type", "spec.algorithm": "--algorithm", "spec.datasets": "--dataset",
    "spec.config": "--config", "spec.steps": "--steps", "spec.checkpoint_every": "--checkpoint-every", "spec.initial_parameters": "--initial",
    "spec.output": "--output", "spec.rounds": "--rounds", "spec.strategy": "--strategy", "spec.local_fits": "--local-fits",
    "spec.variants": "--variant",
}  # fmt: skip
# options that one task type alone takes (the others' misplacements are left to the spec models)
_ONLY_FOR = {
    "--rounds": TaskType.FEDERATED_TRAINING, "--strategy": TaskType.FEDERATED_TRAINING, "--local-fits": TaskType.FEDERATED_TRAINING,
    "--variant": TaskType.FEDERATED_TRAINING, "--steps": TaskType.TRAINING, "--checkpoint-every": TaskType.TRAINING,
}  # fmt: skip
# federated_training with --model trains an installed model's last layer; these belong to the whole-model mode (--algorithm)
_WHOLE_MODEL = ("--local-fits", "--variant", "--dataset", "--config", "--initial")


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``1.5m``, ``2h``, ``1d``, ``500ms``."""
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(f"{text!r}: use seconds or a number with ms, s, m, h or d (90, 90s, 5m, 2h)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


class _Duration(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        try:
            return parse_duration(str(value))
        except click.BadParameter as exc:
            self.fail(exc.message, param, ctx)


DURATION = _Duration()


def parse_model(text: str, flag: str = "--model") -> dict[str, Any]:
    """``NAME`` or ``NAME:VERSION`` as a ``ModelRef`` document."""
    name, sep, version = text.partition(":")
    if not name or (sep and not version):
        raise click.BadParameter(f"{text!r}: use NAME or NAME:VERSION", param_hint=flag)
    return {"name": name, **({"version": version} if version else {})}


def parse_algorithm(text: str, flag: str = "--algorithm") -> dict[str, Any]:
    """``NAME:VERSION`` as an ``AlgorithmRef`` document (an algorithm is always named with its version)."""
    ref = parse_model(text, flag)
    if "version" not in ref:
        raise click.BadParameter(f"{text!r}: use NAME:VERSION", param_hint=flag)
    return ref


def parse_variant(text: str) -> dict[str, Any]:
    """``SELECTOR=NAME:VERSION`` as an ``FlVariant`` document: the last ``=`` ends the selector (``fw=numpy=algo:1.0.0``)."""
    selector, sep, algorithm = text.rpartition("=")
    if not sep or not selector.strip() or not algorithm:
        raise click.BadParameter(f"{text!r}: use SELECTOR=NAME:VERSION, e.g. framework=numpy=digits-numpy-cnn:1.0.0", param_hint="--variant")
    return {"selector": selector.strip(), "algorithm": parse_algorithm(algorithm, "--variant")}


def parse_accelerator(text: str) -> dict[str, Any]:
    """``TYPE[:COUNT[:PURPOSE]]`` (``gpu``, ``gpu:2``, ``npu:1:inference``) as an ``AcceleratorRequest``."""
    parts = text.split(":")
    try:
        if 1 <= len(parts) <= 3 and parts[0]:
            request: dict[str, Any] = {"type": parts[0].lower()}
            if len(parts) >= 2:
                request["count"] = int(parts[1])
            if len(parts) == 3:
                if parts[2] not in ("training", "inference"):
                    raise ValueError(parts[2])
                request["purpose"] = parts[2]
            return request
    except ValueError:
        pass
    raise click.BadParameter(f"{text!r}: use TYPE[:COUNT[:training|inference]], e.g. gpu:2 or npu:1:inference", param_hint="--accelerator")


def load_spec(text: str | None, flag: str = "--spec") -> dict[str, Any]:
    """``--spec`` (or ``flag``): a JSON object, or ``@file.json``."""
    if text is None:
        return {}
    source = flag
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=flag) from exc
        source = str(path)
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{source} is not JSON: {exc}", param_hint=flag) from exc
    if not isinstance(spec, dict):
        raise click.BadParameter(f"{source} must be a JSON object", param_hint=flag)
    return spec


def _split_ids(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_task_body(
    type: str, spec: dict[str, Any] | None = None, *, model: str | None = None, inputs: str | None = None, chunk_size: int | None = None,
    input_name: str | None = None, duration: float | None = None, selector: str | None = None, ids: str | list[str] | None = None,
    nodes: bool = False, devices: bool = False, min_nodes: int | None = None, max_nodes: int | None = None, accelerators: Iterable[str] = (),
    timeout: float | None = None, worker_timeout: float | None = None, heartbeat: float | None = None, max_attempts: int | None = None,
    backoff: float | None = None, hold: bool = False, name: str | None = None, algorithm: str | None = None, datasets: Iterable[str] = (),
    config: str | None = None, steps: int | None = None, checkpoint_every: int | None = None, initial: str | None = None, output: str | None = None,
    rounds: int | None = None, strategy: str | None = None, local_fits: int | None = None, variants: Iterable[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """The ``TaskCreate`` body from the options of ``task create`` (``inputs``: the dataset artefact's id).

    The flags fill in (and override) keys of ``spec``; what is not given is left out, so the hub's defaults apply.
    The body is checked against ``TaskCreate`` and the type's spec model; a mistake is a ``click.UsageError``
    naming the flag. ``training`` and a whole-model ``federated_training`` (``algorithm``) run on sites (edge
    nodes) unless ``devices``.
    """
    datasets, variants = list(datasets), list(variants)
    spec = dict(spec or {})
    given = {"--rounds": rounds, "--strategy": strategy, "--local-fits": local_fits, "--variant": variants or None, "--steps": steps,
             "--checkpoint-every": checkpoint_every, "--dataset": datasets or None, "--config": config, "--initial": initial}  # fmt: skip
    _refuse_misplaced(type, spec, model is not None, algorithm is not None, [flag for flag, value in given.items() if value is not None])
    if model is not None:
        spec["model"] = parse_model(model)
    if algorithm is not None:
        spec["algorithm"] = parse_algorithm(algorithm)
    if variants:
        spec["variants"] = [parse_variant(text) for text in variants]
    if output is not None:
        spec["output"] = parse_model(output, "--output")
    for text in datasets:
        own, sep, local = text.partition("=")
        if not sep or not own or not local:
            raise click.BadParameter(f"{text!r}: use ALGORITHM_NAME=SITE_NAME", param_hint="--dataset")
        spec.setdefault("datasets", {})[own] = local
    if config is not None:
        spec["config"] = load_spec(config, "--config")
    for key, value in (("inputs", inputs), ("chunk_size", chunk_size), ("input_name", input_name), ("duration_s", duration), ("steps", steps),
                       ("checkpoint_every", checkpoint_every), ("initial_parameters", initial), ("rounds", rounds), ("strategy", strategy),
                       ("local_fits", local_fits)):  # fmt: skip
        if value is not None:
            spec[key] = value
    on_sites = type == TaskType.TRAINING or (type == TaskType.FEDERATED_TRAINING and "algorithm" in spec)
    placement: dict[str, Any] = {}
    if nodes or (on_sites and not devices):
        placement["target"] = "node"
    if selector is not None:
        placement["selector"] = selector
    if ids is not None:
        placement["ids"] = _split_ids(ids) if isinstance(ids, str) else list(ids)
    if min_nodes is not None:
        placement["min_nodes"] = min_nodes
    if max_nodes is not None:
        placement["max_nodes"] = max_nodes
    accelerator_list = [parse_accelerator(a) for a in accelerators]
    if accelerator_list:
        placement["accelerators"] = accelerator_list
    body: dict[str, Any] = {"type": type, "spec": spec}
    if name is not None:
        body["name"] = name
    if placement:
        body["placement"] = placement
    if timeout is not None:
        body["timeout_s"] = max(1, round(timeout))
    if worker_timeout is not None:
        body["worker_timeout_s"] = worker_timeout
    if heartbeat is not None:
        body["heartbeat_s"] = heartbeat
    retry: dict[str, Any] = {}
    if max_attempts is not None:
        retry["max_attempts"] = max_attempts
    if backoff is not None:
        retry["backoff_s"] = backoff
    if retry:
        body["retry"] = retry
    if hold:
        body["start"] = False
    check_task_body(body)
    return body


def _refuse_misplaced(type: str, spec: dict[str, Any], model: bool, algorithm: bool, given: list[str]) -> None:
    """``click.UsageError`` for options the task type, or its mode, does not take (before the spec models' longer messages)."""
    other_type = [flag for flag in given if _ONLY_FOR.get(flag, type) != type]
    if other_type:
        takers = " and ".join(sorted({_ONLY_FOR[flag].value for flag in other_type}))
        raise click.UsageError(f"{', '.join(other_type)}: for {takers} tasks only, not {type}")
    if type != TaskType.FEDERATED_TRAINING:
        return
    if model and algorithm:
        raise click.UsageError("give one of --model (its last layer is trained) or --algorithm (the whole model is trained)")
    last_layer = model or ("model" in spec and not algorithm)
    whole_only = [flag for flag in given if flag in _WHOLE_MODEL]
    if last_layer and whole_only:
        raise click.UsageError(f"{', '.join(whole_only)}: for whole-model tasks (--algorithm) only; a last-layer task (--model) names its dataset, "
                               "local_steps and learning_rate in --spec")  # fmt: skip


def check_task_body(body: dict[str, Any]) -> None:
    """``click.UsageError`` when ``body`` is not a valid ``TaskCreate`` (its spec checked by the type's model)."""
    problems: list[str] = []
    try:
        created = TaskCreate.model_validate(body)
    except ValidationError as exc:
        problems += [_error_line(e, ()) for e in exc.errors()]
    else:
        spec_model = TASK_TYPES[created.type].spec
        if spec_model is not None:
            try:
                spec_model.model_validate(created.spec)
            except ValidationError as exc:
                problems += [_error_line(e, ("spec",)) for e in exc.errors()]
    if problems:
        raise click.UsageError("the task is not valid: " + "; ".join(problems[:6]))


def _error_line(error: Any, prefix: tuple[str, ...]) -> str:
    loc = [*prefix, *(str(p) for p in error.get("loc", ()))]
    where = ".".join(loc) or "body"
    flag = next((f for key, f in _FLAG_OF.items() if where == key or where.startswith(key + ".")), None)
    msg = str(error.get("msg", "")).removeprefix("Value error, ")
    return f"{where}{f' ({flag})' if flag else ''}: {msg}"

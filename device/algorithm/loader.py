"""Loading an algorithm from its package folder: the manifest, the configuration, the entry point, the client.

``load_client(package_dir, config, datasets)`` reads ``algorithm.json``, fills the configuration's top-level
defaults from its schema and checks it against that schema (Draft 2020-12), imports the entry point with the
package folder (and only it) put first on ``sys.path``, and builds the client with ``(config, datasets)``. Each
way this can fail is an :class:`~device.algorithm.client.AlgorithmError` that names the cause.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema_rs
from pydantic import ValidationError

from device.algorithm.client import REQUIRED, AlgorithmError
from interfaces.algorithms import DRAFT_2020_12, MANIFEST_NAME, AlgorithmManifest, with_defaults


def read_manifest(package_dir: Path) -> AlgorithmManifest:
    path = Path(package_dir) / MANIFEST_NAME
    if not path.is_file():
        raise AlgorithmError(f"{package_dir} has no {MANIFEST_NAME} at its root: it is not an algorithm package")
    try:
        manifest = AlgorithmManifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise AlgorithmError(f"{path} is not a valid manifest: {_first_errors(exc)}") from None
    try:
        jsonschema_rs.meta.validate({"$schema": DRAFT_2020_12, **manifest.config_schema})
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        raise AlgorithmError(f"{path}: config_schema is not a valid JSON Schema (Draft 2020-12): {exc}") from None
    return manifest


def _first_errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'the document'}: {e['msg']}" for e in exc.errors()[:5])


def check_config(manifest: AlgorithmManifest, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with the schema's top-level defaults filled in, if it satisfies the schema."""
    filled = with_defaults(manifest, dict(config))
    validator = jsonschema_rs.Draft202012Validator(manifest.config_schema)
    problems = [f"{'/'.join(str(p) for p in e.instance_path) or 'the configuration'}: {e.message}" for e in validator.iter_errors(filled)]
    if problems:
        raise AlgorithmError(f"the configuration does not satisfy {manifest.name}'s config_schema: " + "; ".join(problems[:5]))
    return filled


def _forget_foreign(top: str, package_dir: Path) -> None:
    # a module of the same name imported from another package (another version, another template) must not
    # stand in for this one's
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        origin = getattr(sys.modules[name], "__file__", None)
        if origin is None or not Path(origin).resolve().is_relative_to(package_dir):
            del sys.modules[name]


def import_entry_point(manifest: AlgorithmManifest, package_dir: Path) -> type:
    package_dir = Path(package_dir).resolve()
    _forget_foreign(manifest.module.split(".")[0], package_dir)
    sys.path.insert(0, str(package_dir))
    try:
        module = importlib.import_module(manifest.module)
    except ImportError as exc:
        raise AlgorithmError(f"entry point {manifest.entry_point}: cannot import {manifest.module} from {package_dir}: {exc}") from None
    except Exception as exc:
        raise AlgorithmError(f"entry point {manifest.entry_point}: importing {manifest.module} raised {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(package_dir))
    cls = getattr(module, manifest.class_name, None)
    if not isinstance(cls, type):
        raise AlgorithmError(f"entry point {manifest.entry_point}: {manifest.module} has no class {manifest.class_name}")
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise AlgorithmError(f"entry point {manifest.entry_point}: the client lacks {', '.join(missing)} (it needs {', '.join(REQUIRED)})")
    return cls


def check_datasets(datasets: Mapping[str, Path]) -> dict[str, Path]:
    for name, path in datasets.items():
        if not Path(path).exists():
            raise AlgorithmError(f"dataset {name!r}: {path} does not exist")
    return {name: Path(path) for name, path in datasets.items()}


def load_client(package_dir: Path, config: Mapping[str, Any] | None = None,
                datasets: Mapping[str, Path] | None = None) -> tuple[AlgorithmManifest, Any]:
    """The package's manifest and its client, built with the checked configuration and the datasets."""
    package_dir = Path(package_dir)
    manifest = read_manifest(package_dir)
    checked = check_config(manifest, config or {})
    cls = import_entry_point(manifest, package_dir)
    # the client sees plain JSON values: a copy, so it cannot change what its caller holds
    client = cls(json.loads(json.dumps(checked)), check_datasets(datasets or {}))
    return manifest, client

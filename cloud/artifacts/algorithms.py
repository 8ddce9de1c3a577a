"""Checks on an ``algorithm`` artefact before the hub stores and signs it.

An algorithm is a zip of Python sources with ``algorithm.json`` (:data:`interfaces.algorithms.MANIFEST_NAME`) at its
root (``aisynergy algorithm build``). The hub refuses, with a 422 that says why, a package that is not a zip, holds a
member whose path leaves the package (absolute, ``..``, a drive letter), has no manifest or one that does not validate
as :class:`~interfaces.algorithms.AlgorithmManifest`, or names another algorithm or version than the artefact's own.
Nothing of a refused package is kept.
"""

from __future__ import annotations

import zipfile
from typing import BinaryIO

from pydantic import ValidationError

from cloud.errors import BadRequest
from interfaces.algorithms import MANIFEST_NAME, AlgorithmManifest, leaves_package
from interfaces.deployments import ArtifactCreate, ArtifactFormat

MAX_MANIFEST_BYTES = 1 << 20
MAX_MEMBERS = 10_000


def _refuse(detail: str) -> BadRequest:
    return BadRequest(f"the algorithm package is refused: {detail}", status=422)


def check_algorithm_package(body: ArtifactCreate, content: BinaryIO) -> AlgorithmManifest:
    """The manifest of the package in ``content`` (seekable), or a 422 naming what is wrong with it."""
    if body.format is not ArtifactFormat.ZIP:
        raise _refuse(f"an algorithm is a zip (format zip), not {body.format.value}")
    try:
        archive = zipfile.ZipFile(content)
    except (zipfile.BadZipFile, OSError) as exc:
        raise _refuse(f"it is not a zip file ({exc})") from None
    with archive:
        infos = archive.infolist()
        if len(infos) > MAX_MEMBERS:
            raise _refuse(f"it holds {len(infos)} files; at most {MAX_MEMBERS}")
        for info in infos:
            if leaves_package(info.filename):
                raise _refuse(f"member {info.filename!r} would be written outside the package's folder")
        try:
            info = archive.getinfo(MANIFEST_NAME)
        except KeyError:
            raise _refuse(f"it has no {MANIFEST_NAME} at its root") from None
        if info.file_size > MAX_MANIFEST_BYTES:
            raise _refuse(f"its {MANIFEST_NAME} is {info.file_size} bytes; at most {MAX_MANIFEST_BYTES}")
        try:
            raw = archive.read(info)
        except (zipfile.BadZipFile, OSError, RuntimeError) as exc:
            raise _refuse(f"its {MANIFEST_NAME} does not read ({exc})") from None
    try:
        manifest = AlgorithmManifest.model_validate_json(raw)
    except ValidationError as exc:
        first = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()[:3])
        raise _refuse(f"its {MANIFEST_NAME} is not a valid manifest: {first}") from None
    if (manifest.name, manifest.version) != (body.name, body.version):
        raise _refuse(f"its {MANIFEST_NAME} is {manifest.name} {manifest.version}, the artefact {body.name} {body.version}")
    return manifest

"""Algorithms: users' training code as a package (issue 18). The manifest every package carries at its root.

A package is a zip of Python sources (or a folder of them) with :data:`MANIFEST_NAME` at its root. The
manifest names the entry point (``package.module:ClientClass``, imported from the package's own folder), the
frameworks it needs with PEP 440 version specifiers, the JSON Schema its configuration must satisfy and the
resources one worker wants. The client API itself is ``device.algorithm``; this module is only the contract.

Checked here, without libraries beyond pydantic (DESIGN §2): the specifier grammar of PEP 440 (a clause is an
operator and a version; ``.*`` only after ``==`` or ``!=``, ``~=`` needs two release parts) and the outline of
the schema (a JSON object describing an object, ``$schema`` if present naming Draft 2020-12). Whether the
schema is a valid Draft 2020-12 schema in every detail is checked by whoever evaluates it (the SDK, with a
JSON Schema validator).
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

from interfaces.deployments import ArtifactName, Version
from interfaces.strict import JsonObject, WireModel

MANIFEST_NAME = "algorithm.json"
"""The manifest's file name at the root of a package."""
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
MAX_FRAMEWORKS = 32
MAX_MEMORY_BYTES = 2**40
MAX_CPU_CORES = 1024
MAX_ACCELERATORS = 64

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
ENTRY_POINT_RE = rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}$"
EntryPoint = Annotated[str, Field(min_length=3, max_length=256, pattern=ENTRY_POINT_RE,
                                  description="package.module:ClientClass, imported from the package's folder")]
FrameworkName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$",
                                     description="a distribution name (torch, numpy, onnxruntime)")]

# PEP 440: a public version (epoch, release, pre, post, dev) and, for == and !=, a trailing .* instead of the rest
_RELEASE = r"[0-9]+(?:\.[0-9]+)*"
_SUFFIX = r"(?:[-_.]?(?:a|b|rc|alpha|beta|c|pre|preview)[-_.]?[0-9]*)?(?:[-_.]?(?:post|rev|r)[-_.]?[0-9]*)?(?:[-_.]?dev[-_.]?[0-9]*)?"
_VERSION = rf"(?:[0-9]+!)?{_RELEASE}{_SUFFIX}"
_LOCAL = r"(?:\+[A-Za-z0-9]+(?:[-_.][A-Za-z0-9]+)*)?"
_CLAUSE = re.compile(
    rf"^(?:(?:==|!=)\s*(?:(?:[0-9]+!)?{_RELEASE}\.\*|{_VERSION}{_LOCAL})"
    rf"|(?:~=)\s*(?:[0-9]+!)?[0-9]+(?:\.[0-9]+)+{_SUFFIX}"
    rf"|(?:<=|>=|<|>)\s*{_VERSION}"
    rf"|===\s*[^\s,;)]+)$",
    re.IGNORECASE,
)


def leaves_package(member: str) -> bool:
    """Whether a package member's path (a zip entry name) would land outside the package's folder: absolute, a drive
    or stream (``C:``), ``..`` anywhere, or a backslash (read as a separator somewhere)."""
    parts = PurePosixPath(member).parts
    return member.startswith(("/", "\\")) or "\\" in member or ".." in parts or bool(parts and ":" in parts[0])


def check_specifier(value: str) -> str:
    """``value`` if it is a PEP 440 version specifier (``>=2.0``, ``>=1.26,<3``, ``==2.*``); the empty string
    means any version."""
    if value.strip() == "":
        return value
    for clause in value.split(","):
        if not _CLAUSE.match(clause.strip()):
            raise ValueError(f"{clause.strip()!r} is not a PEP 440 version specifier clause (>=2.0, ==1.*, ~=1.4, !=2.1)")
    return value


Specifier = Annotated[str, Field(max_length=256, description="a PEP 440 version specifier; empty: any version"),
                      AfterValidator(check_specifier)]


def check_config_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The outline of a configuration schema: it describes a JSON object (its ``type`` is ``object``), its
    ``properties`` are schemas, and ``$schema``, where given, is Draft 2020-12."""
    if "$schema" in schema and schema["$schema"] != DRAFT_2020_12:
        raise ValueError(f"$schema is {schema['$schema']!r}; a configuration schema is Draft 2020-12 ({DRAFT_2020_12})")
    if schema.get("type") != "object":
        raise ValueError('a configuration is a JSON object: the schema needs "type": "object"')
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict | bool) for p in properties.values()):
        raise ValueError('"properties" is an object whose values are schemas')
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError('"required" is a list of property names')
    return schema


ConfigSchema = Annotated[JsonObject, AfterValidator(check_config_schema)]


class AlgorithmResources(WireModel):
    """What one worker of the algorithm wants; placement finds a site that has it."""

    model_config = ConfigDict(extra="forbid")

    cpu_cores: Annotated[float, Field(gt=0, le=MAX_CPU_CORES)] = 1.0
    memory_bytes: Annotated[int, Field(ge=1 << 20, le=MAX_MEMORY_BYTES)] = 512 << 20
    accelerators: Annotated[int, Field(ge=0, le=MAX_ACCELERATORS)] = 0


class AlgorithmManifest(WireModel):
    """``algorithm.json``: what a package is, what it needs, and how its configuration looks."""

    model_config = ConfigDict(extra="forbid")

    name: ArtifactName
    version: Version
    entry_point: EntryPoint
    frameworks: Annotated[dict[FrameworkName, Specifier], Field(max_length=MAX_FRAMEWORKS)] = Field(default_factory=dict)
    config_schema: ConfigSchema = Field(default_factory=lambda: {"type": "object"})
    resources: AlgorithmResources = Field(default_factory=AlgorithmResources)
    description: Annotated[str, Field(max_length=4096)] = ""

    @property
    def module(self) -> str:
        return self.entry_point.split(":", 1)[0]

    @property
    def class_name(self) -> str:
        return self.entry_point.split(":", 1)[1]


def with_defaults(manifest: AlgorithmManifest, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with the top-level ``default`` of each property its schema declares filled in (what the algorithm
    is given, and what is checked against the schema: the hub at creation, the SDK when it loads the client)."""
    filled = dict(config)
    for name, prop in manifest.config_schema.get("properties", {}).items():
        if isinstance(prop, dict) and "default" in prop:
            filled.setdefault(name, prop["default"])
    return filled

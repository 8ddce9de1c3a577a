"""Artefacts (DESIGN §4.2): a content-addressed blob store, signed manifests, binary deltas, the in-use rule.

The bytes of every artefact live in a :class:`BlobStore` under their SHA-256 (artefacts with the same bytes
share one blob); the database row (``cloud.tables.Artifact``) holds the manifest fields and the hub's Ed25519
signature over them. Binary deltas (bsdiff4 patches from one stored artefact to another) are blobs too,
recorded once per (base, target) pair in ``ArtifactDelta``.

:class:`FileBlobStore` keeps blobs on the local disk; an object store can replace it behind the same protocol.

One concern a module: :mod:`~cloud.artifacts.blobs` (the blob store), :mod:`~cloud.artifacts.records` (rows, wire
models, upload, delete, the in-use rule), :mod:`~cloud.artifacts.deltas` (binary deltas). The names importers use
are re-exported here.
"""

from cloud.artifacts.blobs import CHUNK, SHA256, BlobStore, BlobWriter, FileBlobStore, read_blob
from cloud.artifacts.deltas import (
    DELTA_RETRY_AFTER_S,
    MAX_CONCURRENT_DELTAS,
    MAX_DELTA_INPUT_BYTES,
    DeltaBusy,
    offer_delta,
    prepare_deltas,
    prepare_deltas_in_background,
)
from cloud.artifacts.records import (
    TASK_TOKEN_TTL_S,
    artifact_in_use,
    artifact_manifest,
    artifact_to_wire,
    content_path,
    create_artifact,
    delete_artifact,
    delta_path,
    ensure_absent,
    find_by_identity,
    find_by_sha256,
    get_artifact,
    installed_of,
    is_delta_blob,
    list_artifacts,
    onnx_model_artifact,
    signed_manifest,
    store_derived_model,
    task_input,
)

__all__ = [
    "CHUNK",
    "DELTA_RETRY_AFTER_S",
    "MAX_CONCURRENT_DELTAS",
    "MAX_DELTA_INPUT_BYTES",
    "SHA256",
    "TASK_TOKEN_TTL_S",
    "BlobStore",
    "BlobWriter",
    "DeltaBusy",
    "FileBlobStore",
    "artifact_in_use",
    "artifact_manifest",
    "artifact_to_wire",
    "content_path",
    "create_artifact",
    "delete_artifact",
    "delta_path",
    "ensure_absent",
    "find_by_identity",
    "find_by_sha256",
    "get_artifact",
    "installed_of",
    "is_delta_blob",
    "list_artifacts",
    "offer_delta",
    "onnx_model_artifact",
    "prepare_deltas",
    "prepare_deltas_in_background",
    "read_blob",
    "signed_manifest",
    "store_derived_model",
    "task_input",
]

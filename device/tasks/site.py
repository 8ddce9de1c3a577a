"""What a training site gives its ``training`` workers (``device.tasks.training``): its datasets by name, a directory
that outlives the agent (checkpoints, so that a restarted site resumes), and the link to publish results to the hub.

A site dataset is a file or a folder of files the operator names when starting the agent
(``aisynergy edge run --dataset NAME=PATH``); on a device, one of its local datasets (``aisynergy device run
--dataset NAME=PATH.npz``, arrays ``x`` and ``y``). The path is handed to the algorithm as it is (read-only to it: a
worker may write only inside its own directory); its bytes never leave the site.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from interfaces.deployments import ArtifactKind

DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class SiteError(ValueError):
    """A dataset option that cannot be used (the message says why)."""


def site_datasets(given: Mapping[str, Path]) -> dict[str, Path]:
    """``given`` checked: names as the task spec allows them, paths that exist (files or folders), made absolute."""
    out = {}
    for name, path in given.items():
        if not DATASET_NAME.match(name):
            raise SiteError(f"dataset name {name!r}: letters, digits, '_', '.', '-', at most 128, starting with a letter or digit")
        path = Path(path).expanduser().resolve()
        if not (path.is_file() or path.is_dir()):
            raise SiteError(f"dataset {name}: no file or folder {path}")
        out[name] = path
    return out


@dataclass
class Site:
    """``datasets``: name -> file or folder; ``root``: the training workers' directories; ``hub_url``, ``verify`` and
    ``server_name`` (the name in that server's certificate, when not the URL's host): where results are published
    (the chunked upload API, with each order's publish grant; on a device: its edge, which relays them to the hub)."""

    root: Path
    hub_url: str | None
    datasets: Mapping[str, Path] = field(default_factory=dict)
    verify: ssl.SSLContext | bool = True
    server_name: str | None = None
    private: Path | None = None
    """the agent's data directory: no algorithm may read it (but for its package, datasets and directory)"""

    def dataset(self, name: str) -> Path:
        """The path of dataset ``name``; ``KeyError`` naming the datasets this site has."""
        path = self.datasets.get(name)
        if path is None:
            raise KeyError(f"this site has no dataset {name!r} (it has {sorted(self.datasets) or 'none'}; start it with --dataset {name}=PATH)")
        return path

    def publish(self, path: Path, name: str, version: str, fmt: str, token: str, state_file: Path) -> str:
        """Upload ``path`` as the model ``name`` ``version`` (``fmt``) with a publish grant; the stored artefact's id.
        Resumes the upload recorded in ``state_file``; ``device.upload.UploadError`` when it does not complete."""
        from device.upload import UploadError, upload_artifact

        if not self.hub_url:
            raise UploadError("this site has no hub URL to publish to")
        stored = upload_artifact(self.hub_url, token, path, kind=ArtifactKind.MODEL.value, name=name, version=version, format=fmt,
                                 state_file=state_file, verify=self.verify, server_name=self.server_name)  # fmt: skip
        return stored.id

    def hand_to_edge(self, path: Path, token: str) -> str:
        """Hierarchical whole-model rounds, on a device: hand the update at ``path`` to its edge's aggregator with the
        round's publish grant (``device.upload.hand_over``); the id the edge answered (the file's SHA-256)."""
        from device.upload import UploadError, hand_over

        if not self.hub_url:
            raise UploadError("this site has no edge to hand its update to")
        return hand_over(self.hub_url, token, path, verify=self.verify, server_name=self.server_name)

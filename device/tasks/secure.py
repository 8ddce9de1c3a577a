"""A participant's part in secure aggregation (``secure_aggregation``; ``interfaces.secagg``), for both
``federated_training`` modes: the last layer a device sends inline and the whole model a site uploads.

Per worker run, :meth:`PairMasks.send_key` makes an X25519 key pair and sends its public half to the hub
(``fl.key``). An order of a secure round lists every participant's key (``peers``); a participant masks only when
the order lists its own key of this run (:meth:`PairMasks.masks_with`: the others derived their seeds with it).
:meth:`PairMasks.mask` scales each tensor by the participant's share of the round's examples, encodes it in fixed
point and adds the pair masks of every peer; the seeds of each attempt masked are kept (only the newest attempt's)
so that when the order names participants that dropped after masking (``reveal``), :meth:`PairMasks.reveal_if_asked`
sends the seeds with them, and with no one else, once.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np

from device.tasks.worker import Failed, Worker
from interfaces.tasks import FL_KEY_EVENT, FL_REVEAL_EVENT, FlKey, FlOrder, FlReveal


class PairMasks:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.private_key: Any = None
        self.public_key: str | None = None
        self.seeds: dict[tuple[int, int], dict[str, bytes]] = {}
        self.revealed: set[tuple[int, int]] = set()

    def send_key(self) -> None:
        """A new key pair for this run; its public half to the hub (raises when it cannot be sent)."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self.private_key = X25519PrivateKey.generate()
        public = self.private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public_key = base64.b64encode(public).decode("ascii")
        self.worker.event(FL_KEY_EVENT, FlKey(task_id=self.worker.task_id, worker_id=self.worker.worker_id, public_key=self.public_key))

    def masks_with(self, fl: FlOrder, me: str) -> bool:
        """Whether the round attempt's cohort derived its seeds with this run's key."""
        return self.public_key is not None and fl.peers.get(me) == self.public_key

    def mask(self, fl: FlOrder, me: str, tensors: Mapping[str, np.ndarray], share: float) -> dict[str, np.ndarray]:
        """``tensors`` times ``share`` (this participant's examples / the round's total), fixed point, masked with the
        pair seed of every other participant of the attempt (uint32 tensors under the same names)."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

        from interfaces import secagg

        if self.private_key is None:
            raise Failed("secure aggregation: this run sent no key")
        if not 0 < share <= 1:
            raise Failed(f"secure aggregation: a share of the round's examples in (0, 1], not {share}")
        round_id = f"{self.worker.task_id}/{fl.round}/{fl.attempt}"
        seeds = {}
        for peer, key in fl.peers.items():
            if peer == me:
                continue
            try:
                secret = self.private_key.exchange(X25519PublicKey.from_public_bytes(base64.b64decode(key, validate=True)))
            except ValueError as exc:
                raise Failed(f"secure aggregation: {peer}'s key is not an X25519 public key: {exc}") from None
            seeds[peer] = secagg.pair_seed(secret, round_id, me, peer)
        encoded = {name: secagg.encode(np.asarray(array, np.float64) * share) for name, array in tensors.items()}
        masked = secagg.mask(encoded, me, seeds)
        self.seeds = {(fl.round, fl.attempt): seeds}  # an older attempt can no longer be unmasked
        return masked

    def reveal_if_asked(self, fl: FlOrder | None) -> None:
        """Send this attempt's seeds with the participants the order says dropped after masking (once)."""
        if fl is None or not fl.reveal:
            return
        key = (fl.round, fl.attempt)
        if key not in self.seeds or key in self.revealed:
            return
        seeds = {d: base64.b64encode(self.seeds[key][d]).decode("ascii") for d in fl.reveal if d in self.seeds[key]}
        self.worker.event(FL_REVEAL_EVENT, FlReveal(task_id=self.worker.task_id, worker_id=self.worker.worker_id, round=fl.round, attempt=fl.attempt, seeds=seeds))
        self.revealed.add(key)
        self.worker.log(f"round {fl.round}: revealed the pair seeds with {len(seeds)} participants that dropped")

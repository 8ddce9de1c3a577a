"""Secure aggregation by pairwise additive masking (DESIGN §5; Bonawitz et al. 2017, simplified).

The aggregator (an edge or the hub) learns the sum of the participants' arrays and nothing about any single one.

Encoding. Values live in the ring Z_{2^32} (numpy ``uint32``, whose arithmetic wraps around). :func:`encode` clips a
float array to [−clip, clip] and maps it to the fixed-point integers ``q = round(x · scale)`` reduced mod 2^32;
:func:`decode` reads a sum of such encodings back as a two's-complement int32 and divides by ``scale`` (and by
``count`` for a mean). Each encoding is off by at most 1/(2 scale) per element, so a sum of n is within n/(2 scale)
of the true sum. The sum decodes correctly only while it stays in int32: ``|Σ q| < 2^31``, i.e. ``|Σ x| < 2^31 /
scale`` (32768 with the default scale 2^16). Clipping guarantees it for n participants when
``n · round(clip · scale) < 2^31`` (:func:`max_participants`; 127 with the defaults); beyond, the sum silently wraps.
What is encoded is the caller's choice: for FedAvg a participant sends ``n_k · Δ_k`` (its example count times its
model delta, scaled to stay within clip) together with ``n_k``, and the aggregator divides the two sums.

Masking. Every pair of participants {i, j} of the round's cohort shares a 32-byte seed s_ij (:func:`pair_seed`:
HKDF-SHA256 over a shared secret, bound to the round and the pair, symmetric in i and j). The mask of a tensor is a
pseudo-random uint32 array expanded from the seed with SHAKE-256, keyed by the tensor's name (:func:`prg`).
Participant i sends, per tensor (ids compared as strings)::

    y_i = x_i + Σ_{j > i} PRG(s_ij) − Σ_{j < i} PRG(s_ij)        (mod 2^32)

Summed over the whole cohort every mask appears once with + (at the smaller id) and once with − (at the larger one),
so Σ y_i = Σ x_i. A single y_i is x_i plus uniformly random noise: it reveals nothing of x_i to anyone lacking its
seeds.

Dropouts. If participant d masked with the others but its y_d never arrives, the received sum still carries, for
each survivor s, the mask s applied for the pair {s, d}. The survivors then reveal s_sd (their seed with d, and only
that one) and the aggregator removes those masks (:meth:`Aggregator.recover`, :func:`unmask_sum`). Every survivor
must reveal: one missing seed leaves a full-range random mask in the result.

Whole models. A participant's update is a tensor file of its masked tensors (uint32, the model's names and shapes:
:func:`masked_misfit`); the aggregator sums the files one tensor at a time and reads the contributors' mean back
through :class:`MaskedSum` (sum, unmask, decode, rescale), so no whole model is held in memory.

Key agreement is not here (``interfaces`` holds no cryptography): participants derive the shared secret of each pair
from an X25519 exchange of public keys relayed by the aggregator (the caller's job, e.g. with ``cryptography``) and
pass it to :func:`pair_seed`.

Simplifications against Bonawitz et al., and what they cost: no threshold secret sharing (so recovery needs every
survivor, not t of n) and no self-mask b_i. Privacy thus holds against an honest-but-curious aggregator that follows
the protocol: one that asked the survivors to reveal their seeds with d and then also received d's late y_d would
unmask x_d. :class:`Aggregator` refuses that sequence (an update from a recovered participant, a recovery of one that
was added), and a participant must never reveal its seed with a peer it believes alive.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_SCALE = 2**16
"""Fixed-point scale: 16 fractional bits, a precision of 2^-16 ≈ 1.5e-5 per value."""
DEFAULT_CLIP = 256.0
"""Values are clipped to [−256, 256] before encoding (2^24 with the default scale: 127 participants fit)."""
RING = 2**32
SEED_BYTES = 32
_SALT = b"aisynergy/secagg/v1"
_MIN_SECRET = 16

Encoded = dict[str, np.ndarray]
"""Tensor name -> uint32 array (encoded, masked, or a sum of those)."""


# ------------------------------------------------------------------------------------------------- fixed point


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise ValueError(f"scale must be a number, got {scale!r}")
    scale = float(scale)
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return scale


def encode(array: np.ndarray, scale: float = DEFAULT_SCALE, clip: float = DEFAULT_CLIP) -> np.ndarray:
    """``round(clip_to(array, ±clip) · scale) mod 2^32`` as uint32 (see the module docstring for the bounds)."""
    scale = _check_scale(scale)
    clip = float(clip)
    if not (np.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a positive finite number, got {clip!r}")
    if round(clip * scale) >= 2**31:
        raise ValueError(f"clip * scale = {clip * scale:g} does not fit in int32 (must be < 2^31)")
    values = np.asarray(array, dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError("cannot encode NaN or infinite values")
    fixed = np.rint(np.clip(values, -clip, clip) * scale).astype(np.int64)
    return (fixed & (RING - 1)).astype(np.uint32)


def decode(total: np.ndarray, scale: float = DEFAULT_SCALE, count: int = 1) -> np.ndarray:
    """A sum of encodings as float64: two's-complement int32, divided by ``scale · count``.

    ``count = 1`` gives the sum itself; ``count = n`` the mean of n encodings.
    """
    scale = _check_scale(scale)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    total = np.asarray(total)
    if total.dtype != np.uint32:
        raise ValueError(f"decode takes uint32 sums, got {total.dtype}")
    return np.ascontiguousarray(total).view(np.int32).astype(np.float64) / (scale * count)


def max_participants(scale: float = DEFAULT_SCALE, clip: float = DEFAULT_CLIP) -> int:
    """The most participants whose clipped encodings always sum without overflow: n · round(clip · scale) < 2^31."""
    step = round(float(clip) * _check_scale(scale))
    if step < 1:
        raise ValueError("clip * scale must be at least 1")
    return (2**31 - 1) // step


# --------------------------------------------------------------------------------------------------- seeds, PRG


def _frame(*parts: bytes) -> bytes:
    """Length-prefixed concatenation: distinct tuples give distinct byte strings."""
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def pair_seed(secret: bytes, round_id: str, i: str, j: str) -> bytes:
    """The 32-byte mask seed of participants ``i`` and ``j`` in round ``round_id``; ``pair_seed(.., i, j) == (.., j, i)``.

    HKDF-SHA256 (RFC 5869, one output block): ``PRK = HMAC(salt, secret)``, ``seed = HMAC(PRK, info || 0x01)`` with
    ``info`` the round id and the two ids in sorted order, length-prefixed. ``secret`` is the pair's shared secret
    (the X25519 shared key, at least 16 bytes), the same on both sides.
    """
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < _MIN_SECRET:
        raise ValueError(f"the pair secret must be at least {_MIN_SECRET} bytes")
    for label, value in (("round_id", round_id), ("i", i), ("j", j)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label} must be a non-empty string, got {value!r}")
    if i == j:
        raise ValueError(f"a participant has no pair seed with itself ({i!r})")
    low, high = sorted((i, j))
    prk = hmac.new(_SALT, bytes(secret), hashlib.sha256).digest()
    info = _frame(b"pair-seed", round_id.encode(), low.encode(), high.encode())
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def prg(seed: bytes, tensor: str, shape: tuple[int, ...]) -> np.ndarray:
    """The mask for ``tensor``: SHAKE-256 of the seed and the tensor name, read as little-endian uint32 of ``shape``."""
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        raise ValueError(f"a pair seed is {SEED_BYTES} bytes")
    size = int(np.prod(shape, dtype=np.int64))
    stream = hashlib.shake_256(_frame(b"mask", bytes(seed), tensor.encode())).digest(4 * size) if size else b""
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32).reshape(shape)


def _check_encoded(encoded: Mapping[str, np.ndarray], what: str) -> None:
    if not isinstance(encoded, Mapping) or not encoded:
        raise ValueError(f"{what} must be a non-empty dict of tensor name -> uint32 array")
    for name, array in encoded.items():
        if not isinstance(name, str):
            raise ValueError(f"{what}: tensor names must be strings, got {name!r}")
        if np.asarray(array).dtype != np.uint32:
            raise ValueError(f"{what}: tensor {name!r} has dtype {np.asarray(array).dtype}, expected uint32")


def mask(encoded: Mapping[str, np.ndarray], me: str, peers: Mapping[str, bytes]) -> Encoded:
    """``encoded`` masked by participant ``me``: + PRG(seed) for each peer with a larger id, − for a smaller one.

    ``peers`` maps every other member of the round's cohort to the pair seed ``me`` shares with it (:func:`pair_seed`).
    """
    _check_encoded(encoded, "the encoded update")
    if me in peers:
        raise ValueError(f"{me!r} is among its own peers")
    out: Encoded = {}
    for name, array in encoded.items():
        acc = np.array(array, dtype=np.uint32, copy=True)
        for peer, seed in peers.items():
            noise = prg(seed, name, acc.shape)
            if peer > me:
                acc += noise
            else:
                acc -= noise
        out[name] = acc
    return out


def unmask_sum(total: Mapping[str, np.ndarray], dropped: Mapping[str, Mapping[str, bytes]]) -> Encoded:
    """``total`` (the sum of the masked updates received) without the masks the survivors applied for dropped peers.

    ``dropped`` maps each participant that masked with the others but whose update never arrived to the seeds every
    survivor revealed with it (survivor id -> seed). A survivor s added PRG(s_sd) if d > s and subtracted it otherwise;
    the opposite is applied here. Completeness (every survivor revealed) is the caller's check; see :class:`Aggregator`.
    """
    _check_encoded(total, "the masked sum")
    out: Encoded = {name: np.array(array, dtype=np.uint32, copy=True) for name, array in total.items()}
    for gone, revealed in dropped.items():
        for survivor, seed in revealed.items():
            if survivor == gone:
                raise ValueError(f"{gone!r} cannot reveal a seed with itself")
            for name, acc in out.items():
                noise = prg(seed, name, acc.shape)
                if gone > survivor:
                    acc -= noise
                else:
                    acc += noise
    return out


class Aggregator:
    """The aggregator's side of one round: sums masked updates, recovers dropped participants, decodes the sum.

    ``participants`` is the round's cohort: those that exchanged keys and mask with each other. Each either sends its
    masked update (:meth:`add`) or drops and is recovered (:meth:`recover`) before :meth:`result`.
    """

    def __init__(self, participants: Iterable[str]) -> None:
        cohort = list(participants)
        if len(set(cohort)) != len(cohort):
            raise ValueError("the cohort lists a participant twice")
        if len(cohort) < 2:
            raise ValueError("secure aggregation needs at least 2 participants")
        self.participants = frozenset(cohort)
        self._total: Encoded | None = None
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._added: set[str] = set()
        self._recovered: set[str] = set()

    @property
    def received(self) -> frozenset[str]:
        """Participants whose masked update was added."""
        return frozenset(self._added)

    @property
    def dropped(self) -> frozenset[str]:
        """Participants recovered as dropped."""
        return frozenset(self._recovered)

    @property
    def pending(self) -> frozenset[str]:
        """Participants neither added nor recovered yet."""
        return self.participants - self._added - self._recovered

    def _check_member(self, participant: str) -> None:
        if participant not in self.participants:
            raise ValueError(f"{participant!r} is not in this round's cohort")
        if participant in self._added:
            raise ValueError(f"{participant!r} already sent its update")
        if participant in self._recovered:
            raise ValueError(f"{participant!r} was recovered as dropped; its update can no longer be accepted")

    def add(self, participant: str, masked: Mapping[str, np.ndarray]) -> None:
        """Add one participant's masked update to the running sum (mod 2^32)."""
        self._check_member(participant)
        if self._recovered:
            raise ValueError(
                f"the update from {participant!r} arrived after a recovery: its masks with the dropped participants "
                "would stay in the sum; recover it as dropped instead"
            )
        _check_encoded(masked, f"the update from {participant!r}")
        shapes = {name: np.shape(array) for name, array in masked.items()}
        if self._total is None:
            self._shapes = shapes
            self._total = {name: np.zeros(shape, dtype=np.uint32) for name, shape in shapes.items()}
        elif shapes != self._shapes:
            raise ValueError(f"the update from {participant!r} has tensors {shapes}, the round's are {self._shapes}")
        for name, array in masked.items():
            self._total[name] += np.asarray(array, dtype=np.uint32)
        self._added.add(participant)

    def recover(self, dropped_id: str, revealed: Mapping[str, bytes]) -> None:
        """Remove from the sum the masks the survivors applied for ``dropped_id``; ``revealed``: survivor id -> seed.

        Every participant added so far must have revealed its seed with ``dropped_id`` (and no one else), and every
        update must have arrived first: an update added after a recovery would carry a mask nobody removes.
        """
        self._check_member(dropped_id)
        if self._total is None:
            raise ValueError("no update was received: there is nothing to recover")
        expected, got = set(self._added), set(revealed)
        if got != expected:
            raise ValueError(
                f"recovering {dropped_id!r} needs the seeds of every survivor: "
                f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}"
            )
        self._total = unmask_sum(self._total, {dropped_id: revealed})
        self._recovered.add(dropped_id)

    def total(self) -> Encoded:
        """The running sum as it stands (still masked while some participant is pending)."""
        if self._total is None:
            raise ValueError("no update was received")
        return {name: array.copy() for name, array in self._total.items()}

    def result(self, scale: float = DEFAULT_SCALE) -> dict[str, np.ndarray]:
        """The decoded sum of the received participants' arrays (float64); every participant must be accounted for."""
        if self.pending:
            raise ValueError(
                f"participants {sorted(self.pending)} neither sent an update nor were recovered: the sum is still masked"
            )
        return {name: decode(array, scale) for name, array in self.total().items()}


# ------------------------------------------------------------------------------------------------- whole models


def masked_misfit(tensors: Any, infos: Mapping[str, Any]) -> str | None:
    """Why ``tensors`` (a :class:`~interfaces.tensorfile.TensorFile`) is not a masked update of the model laid out as
    ``infos`` (name -> :class:`~interfaces.tensorfile.TensorInfo`): every tensor of the model, uint32, its shape; None
    when it is. The values are masked: any uint32 is one."""
    have = tensors.infos()
    if set(have) != set(infos):
        return f"its tensors differ from a masked update of the model: missing {sorted(set(infos) - set(have))[:5]}, unexpected {sorted(set(have) - set(infos))[:5]}"
    for name, got in have.items():
        if got.dtype != "uint32" or tuple(got.shape) != tuple(infos[name].shape):
            return f"tensor {name!r} is {got.dtype} {list(got.shape)}; a masked update holds uint32 {list(infos[name].shape)}"
    return None


class MaskedSum:
    """The contributors' weighted mean of a whole model, one tensor at a time (an
    ``interfaces.aggregation.TensorSource``), from their masked updates (sources of uint32 tensors named as the model).

    Each contributor k sent ``encode(x_k · w_k / T)`` masked, where ``T`` is the round's total weight and ``w_k``
    its own. Per tensor: the sum of the updates mod 2^32, the masks of the ``dropped`` participants removed with the
    survivors' revealed seeds (:func:`unmask_sum`), decoded, and multiplied by ``factor`` = T / Σ_k w_k, which makes
    the survivors' Σ (w_k / T) x_k their weighted mean. Read in the model's dtype (``infos``: name -> TensorInfo)."""

    def __init__(self, updates: Sequence[Any], infos: Mapping[str, Any], dropped: Mapping[str, Mapping[str, bytes]], factor: float,
                 scale: float = DEFAULT_SCALE) -> None:  # fmt: skip
        if not updates:
            raise ValueError("a masked sum of no update")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"the rescaling factor must be a positive finite number, got {factor!r}")
        self.updates, self.infos, self.dropped, self.factor, self.scale = list(updates), dict(infos), dropped, float(factor), _check_scale(scale)

    @property
    def names(self) -> list[str]:
        return list(self.infos)

    def info(self, name: str) -> Any:
        return self.infos[name]

    def read(self, name: str) -> np.ndarray:
        info = self.infos[name]
        total = np.zeros(tuple(info.shape), dtype=np.uint32)
        for update in self.updates:
            total += np.asarray(update.read(name), dtype=np.uint32)
        if self.dropped:
            total = unmask_sum({name: total}, self.dropped)[name]
        return (decode(total, self.scale) * self.factor).astype(info.dtype)

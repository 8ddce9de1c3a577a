"""Secure aggregation by pairwise masking (interfaces/secagg.py): sums come out, single updates do not."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from interfaces.secagg import (
    DEFAULT_CLIP,
    DEFAULT_SCALE,
    Aggregator,
    decode,
    encode,
    mask,
    max_participants,
    pair_seed,
    prg,
    unmask_sum,
)

IDS = ["alice", "bob", "carol", "dave", "erin"]
SHAPES = {"layer.weight": (64, 32), "layer.bias": (64,), "head": (3, 4, 5)}
ROUND = "task-7/round-3"


def x25519_seeds(ids: list[str], round_id: str) -> dict[str, dict[str, bytes]]:
    """Test-only key agreement: each participant's pair seeds with every other, from an X25519 exchange.

    Each generates a key pair and publishes its public key (the aggregator relays them); each pair's shared secret is
    X25519(own private, peer public), the same on both sides, and :func:`pair_seed` binds it to the round and the pair.
    """
    private = {i: X25519PrivateKey.generate() for i in ids}
    public = {i: key.public_key() for i, key in private.items()}
    return {
        me: {peer: pair_seed(private[me].exchange(public[peer]), round_id, me, peer) for peer in ids if peer != me}
        for me in ids
    }


def plaintexts(ids: list[str], seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {i: {name: rng.normal(0, 2, shape).astype(np.float32) for name, shape in SHAPES.items()} for i in ids}


def masked_updates(values: dict[str, dict[str, np.ndarray]], seeds: dict[str, dict[str, bytes]]) -> dict[str, dict]:
    return {i: mask({k: encode(v) for k, v in values[i].items()}, i, seeds[i]) for i in values}


def plain_sum(values: dict[str, dict[str, np.ndarray]], ids: list[str]) -> dict[str, np.ndarray]:
    return {name: np.sum([values[i][name].astype(np.float64) for i in ids], axis=0) for name in SHAPES}


# ------------------------------------------------------------------------------------------------------- encoding


def test_encode_decode_round_trips_within_half_a_step_and_clips() -> None:
    x = np.array([0.0, 1.0, -1.0, 3.14159, -2.5e-5, 300.0, -1e9])

    back = decode(encode(x))

    np.testing.assert_allclose(back[:5], x[:5], rtol=0, atol=0.5 / DEFAULT_SCALE)
    assert back[5] == DEFAULT_CLIP and back[6] == -DEFAULT_CLIP
    assert encode(np.array([-1.0]))[0] == 2**32 - DEFAULT_SCALE  # two's complement in Z_2^32


def test_decode_reads_a_wrapped_sum_as_two_complement_and_count_gives_the_mean() -> None:
    total = encode(np.array([-3.0, 2.0])) + encode(np.array([1.0, 2.0]))  # uint32 wrap-around

    np.testing.assert_allclose(decode(total), [-2.0, 4.0])
    np.testing.assert_allclose(decode(total, count=2), [-1.0, 2.0])


def test_the_overflow_bound_is_documented_by_max_participants() -> None:
    assert max_participants() == 127  # 127 * 2^24 < 2^31 <= 128 * 2^24
    full = encode(np.full(1, DEFAULT_CLIP))
    at_bound = sum([full] * 127, np.zeros(1, dtype=np.uint32))
    beyond = at_bound + full

    assert decode(at_bound)[0] == 127 * DEFAULT_CLIP
    assert decode(beyond)[0] < 0  # wrapped: past the bound the sum is silently wrong


def test_encode_refuses_non_finite_values_and_unrepresentable_clips() -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        encode(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="int32"):
        encode(np.zeros(2), scale=2**16, clip=2**15)
    with pytest.raises(ValueError, match="uint32"):
        decode(np.zeros(2, dtype=np.int64))


# --------------------------------------------------------------------------------------------------- seeds, masks


def test_pair_seeds_are_symmetric_and_differ_per_round_pair_and_secret() -> None:
    secret, other = b"s" * 32, b"t" * 32

    seed = pair_seed(secret, ROUND, "alice", "bob")

    assert len(seed) == 32
    assert seed == pair_seed(secret, ROUND, "bob", "alice")
    assert seed != pair_seed(secret, "task-7/round-4", "alice", "bob")
    assert seed != pair_seed(secret, ROUND, "alice", "carol")
    assert seed != pair_seed(other, ROUND, "alice", "bob")
    assert pair_seed(secret, "r", "ab", "c") != pair_seed(secret, "r", "a", "bc")  # framed, not concatenated


def test_pair_seed_refuses_self_pairs_and_short_secrets() -> None:
    with pytest.raises(ValueError, match="itself"):
        pair_seed(b"s" * 32, ROUND, "alice", "alice")
    with pytest.raises(ValueError, match="16 bytes"):
        pair_seed(b"short", ROUND, "alice", "bob")


def test_x25519_seeds_agree_on_both_sides_of_each_pair() -> None:
    seeds = x25519_seeds(IDS, ROUND)

    for i, j in itertools.combinations(IDS, 2):
        assert seeds[i][j] == seeds[j][i]
    assert len({seeds[i][j] for i, j in itertools.combinations(IDS, 2)}) == 10


def test_masks_are_deterministic_per_seed_and_differ_per_tensor() -> None:
    seed = pair_seed(b"k" * 32, ROUND, "alice", "bob")

    a = prg(seed, "layer.weight", (8, 8))

    assert a.dtype == np.uint32 and a.shape == (8, 8)
    np.testing.assert_array_equal(a, prg(seed, "layer.weight", (8, 8)))
    assert not np.array_equal(a.ravel(), prg(seed, "layer.bias", (64,)))


def test_a_single_masked_update_looks_nothing_like_its_plaintext() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    values = plaintexts(IDS)

    masked = masked_updates(values, seeds)["carol"]

    plain = values["carol"]["layer.weight"].ravel().astype(np.float64)
    seen = decode(masked["layer.weight"]).ravel()
    assert abs(np.corrcoef(plain, seen)[0, 1]) < 0.1  # 2048 values: |r| of independent data is ~0.02
    assert np.median(np.abs(seen - plain)) > 1000  # spread over the whole ±32768 range, not near x
    assert np.std(seen) > 10_000  # uniform over the ring: std 2^32 / sqrt(12) / 2^16 ≈ 18900


# --------------------------------------------------------------------------------------------------- aggregation


def test_five_participants_unmask_to_the_plain_sum() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    values = plaintexts(IDS, seed=1)
    aggregator = Aggregator(IDS)

    for participant, masked in masked_updates(values, seeds).items():
        aggregator.add(participant, masked)
    result = aggregator.result()

    expected = plain_sum(values, IDS)
    for name in SHAPES:
        np.testing.assert_allclose(result[name], expected[name], rtol=0, atol=len(IDS) / DEFAULT_SCALE, err_msg=name)
    assert aggregator.received == set(IDS) and not aggregator.pending


def test_a_dropped_participant_is_recovered_from_the_survivors_revealed_seeds() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    values = plaintexts(IDS, seed=2)
    masked = masked_updates(values, seeds)  # everybody masked, with everybody
    survivors = [i for i in IDS if i != "carol"]  # carol's masked update never arrives
    aggregator = Aggregator(IDS)
    for participant in survivors:
        aggregator.add(participant, masked[participant])

    aggregator.recover("carol", {s: seeds[s]["carol"] for s in survivors})
    result = aggregator.result()

    expected = plain_sum(values, survivors)
    for name in SHAPES:
        np.testing.assert_allclose(result[name], expected[name], rtol=0, atol=len(survivors) / DEFAULT_SCALE)
    assert aggregator.dropped == {"carol"}


def test_two_dropouts_at_both_ends_of_the_id_order_are_recovered() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    values = plaintexts(IDS, seed=3)
    masked = masked_updates(values, seeds)
    survivors = ["bob", "carol", "dave"]
    aggregator = Aggregator(IDS)
    for participant in survivors:
        aggregator.add(participant, masked[participant])

    for gone in ("alice", "erin"):
        aggregator.recover(gone, {s: seeds[s][gone] for s in survivors})

    expected = plain_sum(values, survivors)
    for name, array in aggregator.result().items():
        np.testing.assert_allclose(array, expected[name], rtol=0, atol=3 / DEFAULT_SCALE)


def test_without_recovery_the_sum_is_garbage_and_no_result_is_given() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    values = plaintexts(IDS, seed=4)
    masked = masked_updates(values, seeds)
    survivors = [i for i in IDS if i != "dave"]
    aggregator = Aggregator(IDS)
    for participant in survivors:
        aggregator.add(participant, masked[participant])

    with pytest.raises(ValueError, match=r"\['dave'\].*still masked"):
        aggregator.result()
    still_masked = decode(aggregator.total()["layer.weight"])
    assert np.median(np.abs(still_masked - plain_sum(values, survivors)["layer.weight"])) > 1000


def test_recovery_needs_every_survivor_seed() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    masked = masked_updates(plaintexts(IDS, seed=5), seeds)
    aggregator = Aggregator(IDS)
    for participant in IDS[:4]:
        aggregator.add(participant, masked[participant])

    with pytest.raises(ValueError, match=r"missing \['dave'\]"):
        aggregator.recover("erin", {s: seeds[s]["erin"] for s in IDS[:3]})

    partial = unmask_sum(aggregator.total(), {"erin": {s: seeds[s]["erin"] for s in IDS[:3]}})
    assert np.median(np.abs(decode(partial["layer.bias"]))) > 1000  # one missing seed: still a random mask


def test_the_aggregator_refuses_out_of_protocol_sequences() -> None:
    seeds = x25519_seeds(IDS, ROUND)
    masked = masked_updates(plaintexts(IDS, seed=6), seeds)
    aggregator = Aggregator(IDS)
    aggregator.add("alice", masked["alice"])

    with pytest.raises(ValueError, match="already sent"):
        aggregator.add("alice", masked["alice"])
    with pytest.raises(ValueError, match="not in this round's cohort"):
        aggregator.add("mallory", masked["bob"])
    with pytest.raises(ValueError, match="already sent"):
        aggregator.recover("alice", {})
    with pytest.raises(ValueError, match="expected uint32"):
        aggregator.add("bob", {name: array.astype(np.int64) for name, array in masked["bob"].items()})
    with pytest.raises(ValueError, match="tensors"):
        aggregator.add("bob", {"layer.bias": masked["bob"]["layer.bias"]})
    for participant in ("bob", "carol", "dave"):
        aggregator.add(participant, masked[participant])
    aggregator.recover("erin", {s: seeds[s]["erin"] for s in ("alice", "bob", "carol", "dave")})
    with pytest.raises(ValueError, match="recovered as dropped"):  # its late update would expose it
        aggregator.add("erin", masked["erin"])


def test_mask_refuses_itself_as_a_peer() -> None:
    with pytest.raises(ValueError, match="its own peers"):
        mask({"w": encode(np.zeros(2))}, "alice", {"alice": b"x" * 32})

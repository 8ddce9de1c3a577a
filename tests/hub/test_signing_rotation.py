"""Rotation of the hub's artefact-signing key (DESIGN §6): the hand-over on disk, what a running hub signs and
accepts afterwards, and how a target that pins an older key comes to trust the new one.

A target follows only transitions a key it trusts signed; the hub keeps the retired public keys, so artefacts
and download tokens signed before a rotation stay verifiable.
"""

from __future__ import annotations

import base64
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from cloud.cli.root import main
from cloud.signing import KEY_FILE, KEYRING_FILE, NEXT_KEY_FILE, KeyringError, SigningKey, rotate
from device.ota.verify import TrustedKeys, UnknownSigner, VerificationError, load_public_key, verify_download_token, verify_manifest
from interfaces.deployments import (
    MAX_KEY_TRANSITIONS, ArtifactFormat, ArtifactKind, ArtifactManifest, KeyTransition, SignedKeyTransition, SignedManifest,
    key_transition_signing_bytes,
)  # fmt: skip

SHA = "ab" * 32


def manifest(version: str = "1.0.0") -> ArtifactManifest:
    return ArtifactManifest(name="mlp", version=version, kind=ArtifactKind.MODEL, format=ArtifactFormat.ONNX, sha256=SHA, size=10,
                            created_at=datetime(2026, 1, 1, tzinfo=UTC))  # fmt: skip


def test_a_rotation_hands_over_to_a_new_key_that_the_old_one_vouches_for(tmp_path: Path) -> None:
    # Prepare
    first = SigningKey.load_or_create(tmp_path)
    old_pem, old_id = first.public_pem, first.key_id

    # Execute
    done = rotate(tmp_path)

    # Assert: a new key on disk, the transition signed by the old key and kept in the keyring
    now = SigningKey.load_or_create(tmp_path)
    assert (done.old_key_id, done.new_key_id) == (old_id, now.key_id) and now.key_id != old_id
    t = done.transition
    load_public_key(old_pem).verify(base64.b64decode(t.signature), key_transition_signing_bytes(t.transition))
    assert load_public_key(t.transition.new_public_key_pem).public_bytes_raw() == now.public_key.public_bytes_raw()
    assert list(now.transitions) == [t]
    assert (tmp_path / "signing.pub").read_text() == now.public_pem
    assert oct((tmp_path / KEY_FILE).stat().st_mode & 0o777) == "0o600"
    assert not (tmp_path / NEXT_KEY_FILE).exists()
    # what a target enrols with: the current key first, then the retired one
    assert TrustedKeys.from_pem(now.keys_pem).ids() == [now.key_id, old_id]


def test_a_running_hub_signs_with_the_new_key_and_still_accepts_the_old_key_s_tokens(tmp_path: Path) -> None:
    # Prepare: the hub's key object, loaded before the rotation; a token it issued then
    running = SigningKey.load_or_create(tmp_path)
    old_id = running.key_id
    old_token = running.issue_download_token("art-1", SHA, "dev-1", 600)

    # Execute
    rotate(tmp_path)

    # Assert: the next signature is the new key's and carries the hand-over; the old token is still good
    signed = running.sign_manifest(manifest())
    assert signed.key_id != old_id and signed.key_id == SigningKey.load_or_create(tmp_path).key_id
    assert [t.transition.old_key_id for t in signed.key_transitions] == [old_id]
    assert running.verify_download_token(old_token, "art-1").target_id == "dev-1"
    new_token = running.issue_download_token("art-1", SHA, "dev-1", 600)
    assert running.verify_download_token(new_token, "art-1").target_id == "dev-1"
    assert running.transitions_to(old_id) == [] and running.transitions_to(signed.key_id) == signed.key_transitions


def test_a_target_pinning_the_old_key_follows_the_chain_of_two_rotations_and_rejects_a_forged_one(tmp_path: Path) -> None:
    # Prepare: a target pinned the first key; the hub rotated twice since
    hub = SigningKey.load_or_create(tmp_path)
    pinned = TrustedKeys.from_pem(hub.public_pem)
    first_id = hub.key_id
    rotate(tmp_path)
    rotate(tmp_path)
    signed = hub.sign_manifest(manifest("1.1.0"))
    assert len(signed.key_transitions) == 2

    # Execute
    trusted = verify_manifest(pinned, signed)

    # Assert: it trusts both later keys now, newest first, and still the first one
    assert trusted.ids()[0] == signed.key_id and trusted.ids()[-1] == first_id and len(trusted.ids()) == 3
    with pytest.raises(VerificationError, match="bad signature"):
        verify_manifest(pinned, signed.model_copy(update={"key_transitions": []}))  # no way from the pinned key

    # Execute + Assert: a hand-over claimed from the pinned key but signed by another key is refused
    other = SigningKey.load_or_create(tmp_path / "attacker")
    forged_t = KeyTransition(old_key_id=first_id, new_key_id=other.key_id, new_public_key_pem=other.public_pem, issued_at=datetime.now(UTC))
    forged = SignedKeyTransition(transition=forged_t, signature=base64.b64encode(other.private_key.sign(key_transition_signing_bytes(forged_t))).decode())
    evil = other.sign_manifest(manifest("9.9.9")).model_copy(update={"key_transitions": [forged]})
    with pytest.raises(VerificationError, match="not signed by"):
        verify_manifest(pinned, evil)
    # ... and a hand-over a trusted key signed, whose key is not the one it names
    trusting = SigningKey.load_or_create(tmp_path / "trusted")
    liar_t = KeyTransition(old_key_id=trusting.key_id, new_key_id=other.key_id, new_public_key_pem=hub.public_pem, issued_at=datetime.now(UTC))
    liar = SignedKeyTransition(transition=liar_t, signature=base64.b64encode(trusting.private_key.sign(key_transition_signing_bytes(liar_t))).decode())
    with pytest.raises(VerificationError, match="carries key"):
        TrustedKeys.from_pem(trusting.public_pem).following([liar])


def test_artefacts_and_tokens_signed_before_a_rotation_verify_at_a_target_enrolled_after_it(tmp_path: Path) -> None:
    # Prepare: an artefact and a token signed by the first key
    hub = SigningKey.load_or_create(tmp_path)
    before = hub.sign_manifest(manifest())
    token = hub.issue_download_token("art-1", SHA, "dev-9", 600)

    # Execute: the hub rotates; a target enrols and pins what the answer holds (keys_pem)
    rotate(tmp_path)
    enrolled = TrustedKeys.from_pem(hub.keys_pem)

    # Assert
    assert verify_manifest(enrolled, before) is enrolled
    assert verify_download_token(enrolled, token, "art-1").target_id == "dev-9"
    # a target that pins only the new key does not accept the old key's token: the signer is unknown to it
    with pytest.raises(UnknownSigner):
        verify_download_token(TrustedKeys.from_pem(hub.public_pem), token, "art-1")


def test_a_rotation_interrupted_after_recording_the_hand_over_is_completed_by_the_next_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the rename of the new key fails once (a crash at that moment)
    old_id = SigningKey.load_or_create(tmp_path).key_id
    real_replace = os.replace
    calls: list[str] = []

    def crash(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        if Path(src).name == NEXT_KEY_FILE and not calls:
            calls.append(str(src))
            raise OSError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        rotate(tmp_path)
    recorded = json.loads((tmp_path / KEYRING_FILE).read_text())["transitions"][-1]["transition"]["new_key_id"]

    # Execute
    loaded = SigningKey.load_or_create(tmp_path)

    # Assert: the hand-over the keyring records is the key in use now
    assert loaded.key_id == recorded != old_id
    assert not (tmp_path / NEXT_KEY_FILE).exists()


def test_a_keyring_whose_transition_is_not_signed_by_its_old_key_is_refused(tmp_path: Path) -> None:
    # Prepare
    SigningKey.load_or_create(tmp_path)
    rotate(tmp_path)
    ring = json.loads((tmp_path / KEYRING_FILE).read_text())
    ring["transitions"][0]["signature"] = base64.b64encode(b"\0" * 64).decode()
    (tmp_path / KEYRING_FILE).write_text(json.dumps(ring))

    # Execute + Assert
    with pytest.raises(KeyringError, match="not signed by its old key"):
        SigningKey.load_or_create(tmp_path)


def test_the_hub_keeps_the_last_rotations_and_says_which_keys_it_forgot(tmp_path: Path) -> None:
    # Prepare
    first = SigningKey.load_or_create(tmp_path).key_id

    # Execute
    results = [rotate(tmp_path) for _ in range(MAX_KEY_TRANSITIONS + 1)]

    # Assert
    hub = SigningKey.load_or_create(tmp_path)
    assert len(hub.transitions) == MAX_KEY_TRANSITIONS
    assert results[-1].dropped == (first,)
    assert len(TrustedKeys.from_pem(hub.keys_pem).ids()) == MAX_KEY_TRANSITIONS + 1
    assert SignedManifest.model_validate(hub.sign_manifest(manifest()).model_dump(mode="json")).key_transitions == list(hub.transitions)


def test_the_cli_rotates_the_signing_key_and_the_broker_certificate(tmp_path: Path) -> None:
    from cryptography import x509

    from cloud.pki import CertificateAuthority, key_matches_certificate

    # Prepare
    pki = tmp_path / "pki"
    CertificateAuthority.load_or_create(pki, broker_hosts=("broker.example",))
    old_key = SigningKey.load_or_create(pki).key_id
    old_cert = x509.load_pem_x509_certificate((pki / "broker.crt").read_bytes())

    # Execute
    key = CliRunner().invoke(main, ["hub", "rotate", "signing-key", "--data-dir", str(tmp_path)])
    cert = CliRunner().invoke(main, ["hub", "rotate", "broker-certificate", "--data-dir", str(tmp_path), "--hostname", "mqtt.example"])

    # Assert
    assert key.exit_code == 0, key.output
    assert key.output.strip() == f"signing key {old_key} -> {SigningKey.load_or_create(pki).key_id}"
    assert cert.exit_code == 0, cert.output
    new_cert = x509.load_pem_x509_certificate((pki / "broker.crt").read_bytes())
    assert new_cert.serial_number != old_cert.serial_number and f"{new_cert.serial_number:x}" in cert.output
    names = {str(n) for n in new_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)}
    assert {"broker.example", "mqtt.example", "localhost"} <= names
    assert key_matches_certificate(pki / "broker.crt", pki / "broker.key")
    assert not key_matches_certificate(pki / "broker.crt", pki / "hub.key")
    assert oct((pki / "broker.key").stat().st_mode & 0o777) == "0o600"

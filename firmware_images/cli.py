"""``aisynergy firmware``: build, sign and inspect firmware images (format: :mod:`device.ota.firmware_image`).

::

    aisynergy firmware keygen vendor.key                    # Ed25519 PKCS8 PEM (0600) + vendor.pub
    aisynergy firmware build SRC_DIR -o fw.fw [--version V] [--name N] [--compress-level 0-9]
    aisynergy firmware sign fw.fw --key vendor.key [-o fw.manifest.json]
    aisynergy firmware inspect fw.fw [--manifest fw.manifest.json --public-key vendor.pub] [--json]

Exit codes: 0 done; 1 the image is invalid (also: damaged, a corrupt or truncated gzip stream, or a file
that does not match the digest its firmware.json records), or it does not match its manifest, or the
signature is bad; 2 usage. An image built before per-file digests is inspected on its archive alone, and
the report says so.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import click
from pydantic import ValidationError

from device.ota.firmware_image import FIRMWARE_JSON, ImageError, read_image
from device.ota.verify import VerificationError, key_id, load_public_key, sha256_file, verify_manifest
from firmware_images.image import (
    BuildError, build_image, check_identity, check_signed_file, generate_key, load_private_key, sign_image,
)  # fmt: skip
from interfaces.deployments import SignedManifest

EXISTING_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.group()
def firmware() -> None:
    """Build, sign and inspect firmware images for A/B updates."""


@firmware.command()
@click.argument("src_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="the image file to write")
@click.option("--version", help="override firmware.json's version")
@click.option("--name", help="override firmware.json's name")
@click.option("--compress-level", type=click.IntRange(0, 9), default=9, show_default=True, help="gzip level; 0 keeps binary deltas small")
def build(src_dir: Path, out: Path, version: str | None, name: str | None, compress_level: int) -> None:
    """Pack SRC_DIR (with firmware.json at its root) into a deterministic image."""
    try:
        info = build_image(src_dir, out, name=name, version=version, compress_level=compress_level)
    except (BuildError, ImageError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{out}: {info.name} {info.version}, {out.stat().st_size} bytes, sha256 {sha256_file(out)}")


@firmware.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--public", "public_out", type=click.Path(dir_okay=False, path_type=Path), help="default: OUT with the suffix .pub")
def keygen(out: Path, public_out: Path | None) -> None:
    """Make an Ed25519 signing key (PKCS8 PEM, mode 0600) and its public key."""
    public_out = public_out or out.with_suffix(".pub")
    for path in (out, public_out):
        if path.exists():
            raise click.ClickException(f"{path} exists; not overwriting a key")
    private_pem, public_pem = generate_key()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public_out.write_bytes(public_pem)
    click.echo(f"{out} (private, keep it secret), {public_out} (public, key id {key_id(load_public_key(public_pem))})")


@firmware.command()
@click.argument("image", type=EXISTING_FILE)
@click.option("--key", "key_path", required=True, type=EXISTING_FILE, help="Ed25519 private key, PKCS8 PEM")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path), help="default: IMAGE with .manifest.json for .fw")
@click.option("--created-at", type=click.DateTime(["%Y-%m-%dT%H:%M:%SZ"]), help="fixed creation time (UTC), for reproducible manifests")
def sign(image: Path, key_path: Path, out: Path | None, created_at: datetime | None) -> None:
    """Write the signed manifest (kind and format firmware) of IMAGE."""
    try:
        key = load_private_key(key_path.read_bytes())
        signed = sign_image(image, key, created_at=created_at.replace(tzinfo=UTC) if created_at else None)
    except (ValueError, ImageError) as exc:
        raise click.ClickException(str(exc)) from None
    out = out or image.with_name(image.name.removesuffix(".fw") + ".manifest.json")
    out.write_text(signed.model_dump_json(indent=2) + "\n")
    click.echo(f"{out}: {signed.manifest.name} {signed.manifest.version} signed by key {signed.key_id}")


@firmware.command()
@click.argument("image", type=EXISTING_FILE)
@click.option("--manifest", "manifest_path", type=EXISTING_FILE, help="a signed manifest to check the image against")
@click.option("--public-key", "public_key_path", type=EXISTING_FILE, help="the Ed25519 public key (PEM) that signed the manifest")
@click.option("--json", "as_json", is_flag=True, help="one JSON document on stdout")
def inspect(image: Path, manifest_path: Path | None, public_key_path: Path | None, as_json: bool) -> None:
    """Read all of IMAGE and print its firmware.json, SHA-256, size and members; exit 1 if it is damaged or a
    file does not match its recorded digest; with --manifest, verify it too (exit 1 on mismatch)."""
    if (manifest_path is None) != (public_key_path is None):
        raise click.UsageError("--manifest and --public-key go together")
    signed, problem = None, None
    if manifest_path is not None and public_key_path is not None:
        try:  # the signed file first, as the device does: a tampered image says so rather than "damaged"
            signed = SignedManifest.model_validate_json(manifest_path.read_bytes())
            verify_manifest(load_public_key(public_key_path.read_bytes()), signed)
            check_signed_file(image, signed)
        except (ValidationError, VerificationError, ValueError) as exc:
            problem = str(exc).splitlines()[0]
    try:
        contents = read_image(image)
    except ImageError as exc:
        if problem is not None:
            click.echo(f"Error: the image does not match the manifest: {problem}", err=True)
        raise click.ClickException(f"invalid image: {exc}") from None
    if signed is not None and problem is None:
        try:
            check_identity(contents, signed)
        except ImageError as exc:
            problem = str(exc)
    files = [m for m in contents.members if m.type == "file" and m.name != FIRMWARE_JSON]
    report: dict[str, object] = {
        "firmware": contents.info.model_dump(mode="json", exclude_none=True, exclude={"files"}),
        "sha256": sha256_file(image),
        "size": image.stat().st_size,
        "digests": {"recorded": contents.digests_recorded, "verified": len(files) if contents.digests_recorded else 0},
        "members": [
            {"name": m.name, "type": m.type, "size": m.size, "mode": f"{m.mode:04o}", **({"sha256": m.sha256} if m.sha256 else {})}
            for m in contents.members
        ],
    }
    if problem is not None:
        report["manifest"] = {"verified": False, "error": problem}
    elif signed is not None:
        report["manifest"] = {"verified": True, "key_id": signed.key_id, "created_at": signed.manifest.created_at.isoformat()}
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_report(report)
    if problem is not None:
        click.echo(f"Error: the image does not match the manifest: {problem}", err=True)
        sys.exit(1)


def _print_report(report: dict[str, object]) -> None:
    click.echo("firmware.json: " + json.dumps(report["firmware"], indent=2, sort_keys=True))
    click.echo(f"sha256: {report['sha256']}")
    click.echo(f"size: {report['size']}")
    digests = report["digests"]
    assert isinstance(digests, dict)
    if digests["recorded"]:
        click.echo(f"files: {digests['verified']} match the SHA-256 and size firmware.json records; the gzip stream checks out")
    else:
        click.echo("files: no digests recorded (an image built before per-file digests); only the gzip stream was checked")
    click.echo("members:")
    for m in report["members"]:  # type: ignore[attr-defined]
        click.echo(f"  {m['type']:<8} {m['mode']} {m['size']:>9}  {m['name']}")
    manifest = report.get("manifest")
    if isinstance(manifest, dict):
        click.echo(f"manifest: verified (key {manifest['key_id']})" if manifest["verified"] else f"manifest: MISMATCH ({manifest['error']})")


if __name__ == "__main__":  # python -m firmware_images.cli, without the aisynergy root command
    firmware()

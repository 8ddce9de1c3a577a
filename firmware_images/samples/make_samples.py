"""Rebuild the sample images and their signed manifests: ``python firmware_images/samples/make_samples.py``.

The build is deterministic and Ed25519 signatures are too, so with the committed sample key and the fixed
``CREATED_AT`` this reproduces the committed files byte for byte. ``sensor-fw-1.2.0-bad`` (a failing
health check) is a source only; tests build it. Without ``sample-signing.key`` a new sample key is made
(and every manifest changes with it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from firmware_images.image import build_image, generate_key, load_private_key, sign_image

HERE = Path(__file__).resolve().parent
KEY = HERE / "sample-signing.key"
PUBLIC = HERE / "sample-signing.pub"
SAMPLES = ("sensor-fw-1.0.0", "sensor-fw-1.1.0")
CREATED_AT = datetime(2025, 1, 1, tzinfo=UTC)
COMPRESS_LEVEL = 0  # stored: 1.0.0 -> 1.1.0 is a delta of a few hundred bytes
KEY_NOTICE = (
    b"SAMPLE KEY FOR TESTS AND DEMOS ONLY: it is public (committed to the repository); never sign real firmware with it.\n"
    b"Made by firmware_images/samples/make_samples.py.\n"
)


def main() -> None:
    if not KEY.exists():
        private_pem, public_pem = generate_key()
        KEY.write_bytes(KEY_NOTICE + private_pem)
        PUBLIC.write_bytes(public_pem)
    key = load_private_key(KEY.read_bytes())
    for name in SAMPLES:
        image = HERE / f"{name}.fw"
        build_image(HERE / name, image, compress_level=COMPRESS_LEVEL)
        signed = sign_image(image, key, created_at=CREATED_AT)
        (HERE / f"{name}.manifest.json").write_text(signed.model_dump_json(indent=2) + "\n")
        print(f"{image.name}: {image.stat().st_size} bytes, sha256 {signed.manifest.sha256}")


if __name__ == "__main__":
    main()

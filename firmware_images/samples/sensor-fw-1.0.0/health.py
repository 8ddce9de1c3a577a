"""Health check of the sensor firmware: the payload is complete and agrees with firmware.json (exit 0)."""

import json
import sys
from pathlib import Path

firmware = json.loads(Path("firmware.json").read_text())
config = json.loads(Path("app/config.json").read_text())
if config.get("firmware_version") != firmware["version"]:
    sys.exit(f"app/config.json is for {config.get('firmware_version')}, the image is {firmware['version']}")
if not 0 < config["sample_interval_s"] <= 3600:
    sys.exit(f"sample_interval_s {config['sample_interval_s']} out of range")
print(f"{firmware['name']} {firmware['version']} healthy")

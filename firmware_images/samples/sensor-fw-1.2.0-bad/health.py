"""A deliberately broken health check (sample for tests): the sensor self-test fails, exit 1."""

import sys

print("sensor self-test failed: no reading from the temperature sensor", file=sys.stderr)
sys.exit(1)

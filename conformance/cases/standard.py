"""Cases: see conformance/catalogue.py."""

from __future__ import annotations

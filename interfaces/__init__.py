"""The AISynergy wire contract: models, envelope, topic table, error codes and state machines.

Pure data: this package performs no I/O and imports nothing of the project's other packages.
"""

from typing import Final

PROTOCOL_VERSION: Final = 1
API_PREFIX = "/api/v1"

"""The AISynergy wire contract: models, envelope, topic table, error codes and state machines.

Pure data: this package performs no I/O and imports nothing of the project's other packages.
"""

PROTOCOL_VERSION = 1
API_PREFIX = "/api/v1"

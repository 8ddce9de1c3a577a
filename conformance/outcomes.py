"""How a case ends other than by passing; raised by the target's client and by the cases, read by the runner.

::

    AssertionError
    ├── CaseFailed     the system under test did not do what the clause requires
    └── Unexpected     an answer that is not what the documented interface gives
    Exception
    └── CaseSkipped    a precondition the suite cannot arrange is missing
"""

from __future__ import annotations


class CaseFailed(AssertionError):
    """The system under test did not do what the clause requires."""


class Unexpected(AssertionError):
    """An answer that is not what the documented interface gives (raised as a case failure)."""


class CaseSkipped(Exception):
    """A precondition the suite cannot arrange is missing (for example a token of another role)."""

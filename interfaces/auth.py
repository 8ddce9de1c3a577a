"""Integrator roles. Bearer tokens are bound to exactly one."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    VIEWER = "viewer"  # read everything
    OPERATOR = "operator"  # + register, change and lock nodes and devices, twins
    ADMIN = "admin"  # + delete (revoke) nodes, manage tokens

    @property
    def rank(self) -> int:
        return {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}[self]

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank

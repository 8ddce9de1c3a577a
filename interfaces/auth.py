"""Integrator roles. Bearer tokens are bound to exactly one."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

from interfaces.text import NoNul


class Role(StrEnum):
    VIEWER = "viewer"  # read everything
    OPERATOR = "operator"  # + register, change and lock nodes and devices, twins
    ADMIN = "admin"  # + delete (revoke) nodes, manage tokens

    @property
    def rank(self) -> int:
        return {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}[self]

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank


# --- tokens over the API (the console's sign-in and its Tokens page) -----------------------------------------


class TokenCreate(NoNul):
    """``POST /tokens`` (admin): a new integrator token bound to ``role``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Annotated[Role, Strict(False)] = Field(description="viewer, operator or admin")
    name: str = Field(default="", max_length=128, description="what the token is for")


class TokenPublic(BaseModel):
    """A token as listed: never its secret (only its hash is stored)."""

    id: str
    role: Role
    name: str
    created_at: datetime
    revoked_at: datetime | None = None


class TokenIssued(TokenPublic):
    """``POST /tokens``' answer: the secret, shown this once."""

    token: str = Field(description="the bearer secret (asy_…): shown once, never stored")


class Caller(BaseModel):
    """``GET /tokens/self``: who the presented token is (what a client such as the console shows and allows)."""

    id: str
    role: Role
    name: str


class Summary(BaseModel):
    """``GET /summary``: how many nodes, devices, deployments and tasks are in each state (what an overview shows
    without paging through every list)."""

    nodes: dict[str, int] = Field(description="state -> count (deleted nodes are not counted)")
    devices: dict[str, int]
    deployments: dict[str, int]
    tasks: dict[str, int]

"""Pydantic models that more than one test module binds as a tool, defined once so the tool's name,
description and schema are the same wherever they are compared.

Kept out of ``tests/conftest.py`` because pydantic arrives with the optional extras (LangChain, the
server), not with the engine: a test module imports these only after its ``importorskip`` checks.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(description="first")
    b: int = Field(description="second")

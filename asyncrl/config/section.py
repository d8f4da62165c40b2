"""The base of every config section (asyncrl/config/schema.py, asyncrl/config/algo.py)."""

from __future__ import annotations

import msgspec
from msgspec import Meta


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: keyword-only, unknown keys rejected."""


def _d(text: str, **kw) -> Meta:
    return Meta(description=text, **kw)

"""Environment settings that every rank must read alike, parsed in one place.

Parsing never raises anything but ``ValueError`` with the variable, its value and the fix: a bad
setting is a user error, and the agreement round posts it like any other local error.
"""

from __future__ import annotations

import math
import os

__all__ = ["parse_timeout_s", "MAX_TIMEOUT_S"]

# One day: far beyond any sensible wait, and small enough that 30 x it (the agreement bound) and
# its conversion to milliseconds or a timedelta stay finite and in range.
MAX_TIMEOUT_S = 86400.0


def parse_timeout_s(raw: str | None) -> float:
    """``TPFUSE_TIMEOUT_S`` (``raw``; None = unset -> 10) as seconds in (0, ``MAX_TIMEOUT_S``]."""
    if raw is None:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TPFUSE_TIMEOUT_S={raw!r} is not a number of seconds; set e.g. TPFUSE_TIMEOUT_S=10") from None
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"TPFUSE_TIMEOUT_S={raw!r} must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}] "
                         "(one day); set e.g. TPFUSE_TIMEOUT_S=10")
    return value


def timeout_setting() -> float:
    """:func:`parse_timeout_s` of this process's ``TPFUSE_TIMEOUT_S``."""
    return parse_timeout_s(os.environ.get("TPFUSE_TIMEOUT_S"))

"""The executor's environment switches (A/B runs and tests; executor/process.py's module
docstring says what each does), read once at start: a malformed value stops the executor
with one line (exit 2, executor/startup.py)."""

from __future__ import annotations

import os

FAULT_SLEEP_ENV = "PAGEDSERVE_FAULT_SLEEP_IN_STEP"  # testing hook, see the module docstring
OVERLAP_ENV = "PAGEDSERVE_OVERLAP_STEPS"  # 1 / 0: overlapped steps on / off (module docstring)
PLAN_PREP_ENV = "PAGEDSERVE_PLAN_PREP"  # io / main: the thread that precomputes (docstring)


def fault_sleep_from_env() -> tuple[int, float] | None:
    """The testing hook ``PAGEDSERVE_FAULT_SLEEP_IN_STEP="<step_id>:<seconds>"``; None when
    unset. Raises ValueError (one line) when malformed."""
    value = os.environ.get(FAULT_SLEEP_ENV)
    if not value:
        return None
    try:
        step, seconds = value.split(":")
        hook = int(step), float(seconds)
    except ValueError:
        raise ValueError(f"{FAULT_SLEEP_ENV}={value!r}: expected <step_id>:<seconds>") from None
    if not hook[1] >= 0:
        raise ValueError(f"{FAULT_SLEEP_ENV}={value!r}: seconds must be >= 0")
    return hook


def plan_prep_from_env() -> str:
    """``PAGEDSERVE_PLAN_PREP``: "io" (default) or "main". Raises ValueError (one line)."""
    value = os.environ.get(PLAN_PREP_ENV) or "io"
    if value not in ("io", "main"):
        raise ValueError(f"{PLAN_PREP_ENV}={value!r}: expected io or main")
    return value

"""Test-only: stop the trainer at a named point, so that a test can signal it exactly there.

A test sets `CCA_JAX_TEST_PAUSE_AT=<point>` (e.g. "save 2": just before step 2's checkpoint
is saved), waits for the line "paused at <point>" on the trainer's stderr, and sends SIGINT or
SIGKILL. Without the variable (every real run) `pause_point` does nothing.
"""

from __future__ import annotations

import os
import sys
import time

PAUSE_ENV = "CCA_JAX_TEST_PAUSE_AT"
PAUSE_S = 300     # long enough for any test to signal; the run then simply continues


def pause_point(name: str) -> None:
    """Pause here if the test asked for point `name` (the variable is read at each point)."""
    if os.environ.get(PAUSE_ENV) == name:
        print(f"paused at {name}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_S)

"""XLA flags of the test processes and of the CLIs the tests start.

The suite compiles hundreds of small programs and runs each a few times, so compiling is
most of its CPU time: the CPU backend's LLVM optimisation is off (`COMPILE_FAST`: about 40%
less time on compile-bound tests). It changes how fast the compiled CPU code runs; the
suite's checks hold at it as at XLA's default. Users' runs keep XLA's defaults, and so does
a machine with an NVIDIA GPU (`tests/conftest.py`: the flag would also lower the GPU code's).
"""

import os

COMPILE_FAST = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a CPU process a test starts: `COMPILE_FAST` where the suite uses it, and
    `devices` simulated CPU devices."""
    flags = [COMPILE_FAST] if COMPILE_FAST in os.environ.get("XLA_FLAGS", "") else []
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)

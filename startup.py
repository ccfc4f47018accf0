"""What every script, and the test session, does first, before JAX loads: on Linux with glibc,
malloc keeps the large blocks XLA's CPU backend allocates at every step; and a script, on an
early Ctrl-C or SIGTERM, leaves in one line. `import startup` must come before `import jax`."""

import ctypes
import os
import platform
import signal
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters


def keep_malloc_blocks():
    """One arena, no mmap, no trim: glibc would otherwise map and unmap each step's temporaries.
    Linux with glibc only; MT_DEFAULT_MALLOC=1 leaves malloc as it is. True if in force."""
    if os.environ.get("MT_DEFAULT_MALLOC") == "1":
        return False
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim
    return all([libc.mallopt(param, value) == 1 for param, value in settings])


def leave_on_early_signals():
    """Until runs.run_command takes the signals over: nothing is written yet, so leave."""

    def leave(*_):
        os.write(2, b"interrupted before anything was written.\n")
        os._exit(130)

    signal.signal(signal.SIGINT, leave)
    signal.signal(signal.SIGTERM, leave)


MALLOC_KEPT = keep_malloc_blocks()

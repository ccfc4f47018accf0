"""What every script, and the test session, does first, before JAX loads: on Linux with glibc,
malloc keeps the large blocks XLA's CPU backend allocates at every step; and a script, on an
early Ctrl-C or SIGTERM, leaves in one line. `import startup` must come before `import jax`.
fill_heap_holes is called later, after a compile."""

import ctypes
import os
import platform
import signal
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters


def keep_malloc_blocks():
    """One arena, no mmap, no trim: glibc would otherwise map and unmap each
    step's temporaries. Linux with glibc only; MT_DEFAULT_MALLOC=1 leaves malloc
    as it is. True if in force."""
    if os.environ.get("MT_DEFAULT_MALLOC") == "1":
        return False
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim
    return all([libc.mallopt(param, value) == 1 for param, value in settings])


HOLE_FILLERS = []  # fill_heap_holes's blocks, never freed


def fill_heap_holes(smallest=2**10, largest=2**26):
    """After a compile, with keep_malloc_blocks in force: take every free block
    of at least `smallest` bytes in the one heap for good, so that a step's
    allocations come from the heap's top and from the blocks the step frees
    itself, not from a search through the compiler's holes, which slowed the
    tiny step measurably. malloc_trim first gives the holes' pages back, so the
    blocks cost no resident memory. Call it between steps. Returns the count."""
    if not MALLOC_KEPT:
        return 0
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_ssize_t]
    libc.malloc_trim(0)
    taken, size = 0, largest
    while size >= smallest:
        end = libc.sbrk(0)
        block = libc.malloc(size)
        if block and libc.sbrk(0) == end:  # it came from a hole: keep it
            HOLE_FILLERS.append(block)
            taken += 1
            continue
        if block:  # the heap grew for it, so no hole this size is left: give the room back
            libc.free(block)
            libc.malloc_trim(0)
        size //= 2
    return taken


def after_compile(step):
    """step, with fill_heap_holes after its first call, whose compile leaves the
    heap full of the compiler's freed blocks: the steps after it allocate past
    them."""
    first = [True]

    def call(*args):
        out = step(*args)
        if first:
            first.clear()
            fill_heap_holes()
        return out

    return call


def leave_on_early_signals():
    """Until cli.run_command takes the signals over: nothing is written yet, so
    leave.
"""

    def leave(*_):
        os.write(2, b"interrupted before anything was written.\n")
        os._exit(130)

    signal.signal(signal.SIGINT, leave)
    signal.signal(signal.SIGTERM, leave)


MALLOC_KEPT = keep_malloc_blocks()

"""startup.py, which every script imports before JAX: glibc's malloc settings in force in a fresh
process, and the one variable that turns them off."""

import os
import platform
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ON_GLIBC = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting is for Linux with glibc; elsewhere it is a no-op",
)


def probe(code, **extra):
    """The words `code` prints in a fresh process, without the session's malloc variables (and
    with `extra`'s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MT_DEFAULT_MALLOC", "GLIBC_TUNABLES")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=HERE,
        env=dict(env, **extra),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()


# A 64 MiB block: glibc maps it apart (mmap) by default, and unmaps it when freed, so the heap
# does not grow at all; with the settings, it comes from the heap (sbrk), which keeps it when
# freed. Part of it may come from free room already at the heap's top: the heap grows by most of
# the block, not all of it.
PROBE = """
import ctypes, startup
libc = ctypes.CDLL(None)
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.sbrk.argtypes, libc.free.argtypes = [ctypes.c_long], [ctypes.c_void_p]
before = libc.sbrk(0)
block = libc.malloc(64 << 20)
grown = libc.sbrk(0) - before
libc.free(block)
kept = libc.sbrk(0) - before
print(startup.MALLOC_KEPT, grown >= 32 << 20, kept >= 32 << 20)
"""


@ON_GLIBC
def test_malloc_keeps_large_blocks_in_a_fresh_process_unless_turned_off():
    on = probe(PROBE)
    off = probe(PROBE, MT_DEFAULT_MALLOC="1")
    assert on == ["True", "True", "True"]  # from the heap, and kept there when freed
    assert off == ["False", "False", "False"]  # mapped apart, as glibc does by default


# Freed blocks of 1 MiB among blocks in use: holes that a 1 MiB request is served from, unless
# fill_heap_holes took them, when the heap must grow for it.
HOLES = """
import ctypes, startup
libc = ctypes.CDLL(None)
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.sbrk.argtypes, libc.free.argtypes = [ctypes.c_long], [ctypes.c_void_p]
libc.malloc.argtypes = [ctypes.c_size_t]
blocks = [libc.malloc(size) for size in [1 << 20, 64] * 32]
for block in blocks[::2]:
    libc.free(block)
def from_a_hole():
    end = libc.sbrk(0)
    block = libc.malloc(1 << 20)
    grown = libc.sbrk(0) != end
    libc.free(block)
    return not grown
before = from_a_hole()
taken = startup.fill_heap_holes()
print(before, taken > 0, from_a_hole())
"""


@ON_GLIBC
def test_fill_heap_holes_takes_the_freed_blocks_so_a_request_grows_the_heap_unless_turned_off():
    runs = {"on": probe(HOLES), "off": probe(HOLES, MT_DEFAULT_MALLOC="1")}
    assert runs["on"] == ["True", "True", "False"]  # a hole served it; after the fill, none did
    assert runs["off"][1] == "False"  # glibc's own malloc: nothing taken


def test_startup_comes_before_jax_in_every_script():
    """The settings act on the allocations that follow them: each script imports startup first
    (and the test session before JAX)."""
    for name in ("train.py", "evaluate.py", "sample.py", "benchmark.py"):
        with open(os.path.join(HERE, name)) as f:
            imports = [line.split()[1] for line in f if line.startswith(("import ", "from "))]
        assert imports[0] == "startup", name
    with open(os.path.join(HERE, "conftest.py")) as f:
        imports = [line.split()[1] for line in f if line.startswith(("import ", "from "))]
    assert imports.index("startup") < imports.index("jax")

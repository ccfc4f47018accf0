"""Test-session setup: one persistent JAX compilation cache for this pytest run.

Runs of train.py in subprocesses (the smoke run, the sharded step) and in-process share the
compiled steps through it, so each distinct step compiles once per session. The directory is
fresh for every session, so timings always include one cold compile.
"""
import os
import tempfile

_cache = tempfile.mkdtemp(prefix="jax-cache-")
os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

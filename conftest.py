"""The test session's settings, made before any test imports JAX. Environment variables, so that the
train.py and benchmark.py processes the tests start get them too.

1. Full float32 precision for matmuls on every backend: the tests compare the math with exact
   references, and a GPU's default float32 matmul is a TF32-class pass with a 10-bit mantissa.
2. Deterministic GPU kernels, so that a resumed run can be held equal to an uninterrupted one.
3. One compilation cache for each process of the session (pytest-xdist runs two), shared with the
   processes its tests start that run to their end, so that each program compiles once.
4. On a CPU, LLVM's lowest optimization level and XLA's older kernel emitters: the suite is mostly
   compiling, and these halve that; the math is the same, its float32 rounding may differ a bit.
"""

import contextlib
import os
import shutil
import tempfile

import pytest

os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # processes of the session share a GPU
_flags = " --xla_gpu_exclude_nondeterministic_ops=true"
if not os.path.exists("/dev/nvidiactl"):
    _flags += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _flags).strip()
_cache = tempfile.mkdtemp(prefix="jax-cache-")
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=_cache,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)

import startup  # noqa: E402, F401  (malloc kept for XLA's CPU blocks, as the scripts do)
import jax  # noqa: E402  (after the environment above)

jax.config.update("jax_default_matmul_precision", "highest")  # in case a plugin imported JAX first


# pytest.ini runs the suite in two processes (pytest-xdist, --dist loadgroup): one takes the tests
# whose work is whole commands (their fixture requests runs_commands, or they are marked commands),
# the other every other test, so that each program the in-process tests share is compiled once.
@pytest.fixture(scope="session")
def runs_commands():
    """Requested by a fixture whose work is whole commands: its tests go to the commands worker."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        commands = "runs_commands" in item.fixturenames or item.get_closest_marker("commands")
        item.add_marker(pytest.mark.xdist_group("commands" if commands else "in-process"))


def pytest_sessionfinish():
    shutil.rmtree(_cache, ignore_errors=True)


def child_env(**extra):
    """The session's environment for a process that a test may stop at any point, less the
    compilation cache: a process killed while it writes an entry would leave it half-written."""
    return dict({k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}, **extra)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """The tokenizer and token cache of the command-line tests' runs."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, cache):
    """A finished memory run of test_train.FAST (2 steps), the template the command-line tests copy
    before they break it; none changes it. What it printed is in stdout.txt beside it."""
    import train
    from test_train import FAST

    out = tmp_path_factory.mktemp("runs") / "run"
    with open(out.parent / "stdout.txt", "w") as log, contextlib.redirect_stdout(log):
        assert train.main(FAST + ["--steps", "2", "--out", str(out), "--cache-dir", cache]) == 0
    return out

"""Test-session setup, before any test imports JAX.

1. Full float32 precision on every backend. The tests compare the model's math with exact
   references. On NVIDIA GPUs JAX's default precision for float32 matmuls is a faster,
   lower-precision pass (TF32-class, a 10-bit mantissa), which is a choice of the backend,
   not of the math; on a CPU float32 matmuls are full precision anyway. The setting is an
   environment variable, so the train.py and benchmark.py subprocesses of the tests get it
   too. Tests about bfloat16 keep their own stated tolerances (bf16 inputs ignore it).
2. Deterministic GPU kernels (no atomics in scatter-adds and reductions), so that the tests
   that resume a run or repeat a computation can ask for equality on a GPU as on a CPU.
   The flag is ignored on a CPU.
3. One persistent JAX compilation cache for this pytest run: runs of train.py in
   subprocesses (the smoke run, the sharded step) and in-process share the compiled steps
   through it, so each distinct step compiles once per session. The directory is fresh for
   every session, so timings always include one cold compile.
4. The host-memory setting the scripts make (train.keep_freed_host_memory), for in-process runs.
5. Compiling for the CPU at LLVM's lowest optimization level. The suite is mostly compiling,
   and this halves the compiling (a toy model's gradient: 1.0 s instead of 2.0). The program
   the tests run is the same: every XLA pass still runs, and the optimized HLO of a train
   step is identical line for line. Only each kernel's machine code is less optimized: it
   runs slower, and its float32 rounding may differ in the last bits (that step's loss:
   4.7737689 against 4.7737684), as between any two backends, which no test depends on.
   And with XLA's older CPU kernel emitters (xla_cpu_use_fusion_emitters=false), which
   build each fused kernel's code directly instead of through MLIR: the tiny train step
   compiles in 3.9 s instead of 5.1, and test_memorizing_transformer.py with test_data.py
   ran in 39-42 s instead of 58-69 (two alternated runs). Here the program does differ: the
   older emitters fuse less (the step's HLO has fewer fusions and some loose reduces), so it
   is the same math in other kernels, with the same loss after four steps (7.8920088).
   Both left at the default where an NVIDIA GPU is present (unmeasured there).
6. Early jobs. pytest runs one test at a time, and the suite is mostly compiling, on one core:
   it used 1.09 of a 2-core machine's cores. A few tests' work is a whole command in a
   subprocess (train.py, evaluate.py or benchmark.py, 10-30 s each on a slow machine), which
   needs nothing from the tests before it. Such a test takes that work from a fixture made
   with `early`: once the tests are collected, the jobs that the selected tests ask for start
   in the order of those tests, one at a time, in a thread beside the suite; the tests that
   wait for them run last, each making its assertions on its job's result. Jobs use no compilation cache of
   the session's: their programs are their own, and two processes writing one cache could
   read each other's half-written entries. On a GPU, no process of the session preallocates
   75% of the GPU's memory (JAX's default), since several run at once.
7. Two fixtures of the command-line tests (test_cli.py, test_interrupts.py, test_sample.py),
   made once per session: `cache` and `finished_run`.
"""
import concurrent.futures
import contextlib
import os
import pathlib
import shutil
import tempfile

import pytest

os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # (6.)
_flags = " --xla_gpu_exclude_nondeterministic_ops=true"
if not os.path.exists("/dev/nvidiactl"):
    _flags += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _flags).strip()
_cache = tempfile.mkdtemp(prefix="jax-cache-")
os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import jax  # noqa: E402  (after the environment above)

import train  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # in case a plugin imported JAX first
train.keep_freed_host_memory()  # as every script does: a step's temporaries are reused, not faulted in anew


# ----------------------------------------------------------------------------- shared fixtures (7.)
@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """The tokenizer, token and compilation cache of the command-line tests' runs."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, cache):
    """A finished memory run of test_train.FAST (2 steps), the template the command-line tests
    copy before they break it; none changes it. What it printed is in stdout.txt beside it."""
    from test_train import FAST  # (a test module: imported once the session runs, not with conftest)
    out = tmp_path_factory.mktemp("runs") / "run"
    with open(out.parent / "stdout.txt", "w") as log, contextlib.redirect_stdout(log):
        assert train.main(FAST + ["--steps", "2", "--out", str(out), "--cache-dir", cache]) == 0
    return out


# ----------------------------------------------------------------------------- early jobs (6.)
_jobs, _started = {}, {}  # name -> job(tmp), name -> Future of its result
_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
_tmp = tempfile.mkdtemp(prefix="early-jobs-")


def early(job):
    """Decorator: `job(tmp)` (tmp an empty directory, a pathlib.Path) becomes a session fixture of
    the same name, whose value is job's result, computed beside the suite (6. above). The job's
    subprocesses should get `job_env()`."""
    _jobs[job.__name__] = job

    @pytest.fixture(name=job.__name__, scope="session")
    def fixture():
        return start(job.__name__).result()
    return fixture


def job_env(**extra):
    """The test session's environment without its compilation cache (6.), plus extra."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return dict(env, **extra)


def start(name):
    if name not in _started:
        tmp = tempfile.mkdtemp(prefix=name + "-", dir=_tmp)
        _started[name] = _thread.submit(_jobs[name], pathlib.Path(tmp))
    return _started[name]


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: any(name in _jobs for name in item.fixturenames))  # stable: waiting tests last


def pytest_collection_finish(session):
    # Not for --collect-only, nor on a pytest-xdist worker, which collects every test and runs
    # some: there a job starts when a test first asks for it.
    if session.config.option.collectonly or hasattr(session.config, "workerinput"):
        return
    for item in session.items:
        for name in item.fixturenames:
            if name in _jobs:
                start(name)


def pytest_sessionfinish():
    _thread.shutdown(cancel_futures=True)  # a job that is running ends first
    for path in (_tmp, _cache):
        shutil.rmtree(path, ignore_errors=True)

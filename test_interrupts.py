"""The commands interrupted, and failing as processes (issue 14): Ctrl-C and SIGTERM at several
moments of each command, with no child process left behind; a reader of stdout that stops
reading; a path that is not UTF-8 under a strict locale; a JAX backend that cannot start;
a device out of memory. (Split from test_cli.py, whose bad-input tests these complement.)
"""

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import cli
import runs
from conftest import child_env
from test_train import FAST, HERE, ending


def launch(script, argv, env=None):
    return subprocess.Popen(
        [sys.executable, script] + argv,
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_for_line(proc, prefix):
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line {prefix!r}: {proc.stderr.read()}")


def assert_interrupted(code, err):
    assert (
        code == 130 and err.count("\n") == 1 and "Traceback" not in err and "interrupted" in err
    ), (code, err)
    return err


def wait_until_jax_loads(proc, timeout=120):
    """Until the child has mapped jaxlib's library (Linux: /proc/PID/maps), i.e. the script runs
    and is importing JAX. A signal before the script's first line is Python's own: on a loaded
    machine its startup (site imports) can take longer than a fixed sleep, and an interrupt
    there exits 1 with a traceback (seen on a GPU machine under pytest-xdist)."""
    maps, deadline = f"/proc/{proc.pid}/maps", time.time() + timeout
    while os.path.exists(maps) and time.time() < deadline and proc.poll() is None:
        with open(maps) as f:
            if "jaxlib" in f.read():
                return
        time.sleep(0.01)


@pytest.fixture(scope="session")
def interrupted_train_runs(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("interrupted_train_runs")
    """Ctrl-C (SIGINT) to train.py 0.2 s and 2 s after it starts to load JAX, and 0.5 s after its
    last step; then the last run resumed: each interrupted process's ending, what the last one
    left (whether an eval.json, its checkpoint's step), the resumed process and the run's
    directory."""
    endings, cache = [], str(tmp / "cache")
    for delay in (0.2, 2.0):
        with stopped_at_the_end(
            launch(
                "train.py",
                FAST + ["--out", str(tmp / f"early{delay}"), "--cache-dir", cache],
                child_env(),
            )
        ) as proc:
            wait_until_jax_loads(proc)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            endings.append(ending(proc))
    with stopped_at_the_end(
        launch(
            "train.py",
            FAST
            + [
                "--out",
                str(tmp / "run"),
                "--cache-dir",
                cache,
                "--steps",
                "2",
                "--valid-fraction",
                "0.5",
                "--eval-docs",
                "20",
                "--eval-tokens",
                "2000",
            ],
            child_env(),
        )
    ) as proc:
        wait_for_line(proc, "step      2")
        time.sleep(
            0.5
        )  # past the last save (milliseconds): compiling or running the final evaluation (seconds)
        proc.send_signal(signal.SIGINT)
        endings.append(ending(proc))
    run = tmp / "run"
    left = {
        "eval.json": (run / "eval.json").exists(),
        "step": runs.load_checkpoint(str(run / "checkpoint.npz"))[0]["step"],
    }
    resumed = subprocess.run(
        [sys.executable, "train.py", "--out", str(run), "--resume", "--cache-dir", cache],
        cwd=HERE,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    return endings, left, resumed, run


def test_ctrl_c_while_starting_and_during_the_final_evaluation(interrupted_train_runs):
    """Issue 14.9: before anything is written (JAX importing, data loading), and during the final
    evaluation (which once crashed with a segmentation fault): one line, exit 130, the
    checkpoint kept, and --resume then evaluates it."""
    (*starting, evaluating), left, resumed, run = interrupted_train_runs
    for code, err in starting:
        assert_interrupted(code, err)
    assert "final evaluation" in assert_interrupted(*evaluating)
    assert left == {"eval.json": False, "step": 2}
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "eval.json").read_text())["step"] == 2


@pytest.fixture(scope="session")
def interrupted_while_jax_starts_a_plugin(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("interrupted_while_jax_starts_a_plugin")
    """train.py with a JAX plugin (a module of the namespace package jax_plugins, found on the
    PYTHONPATH) that is sent Ctrl-C while it starts, as the CUDA plugin was, loading its
    libraries: the process's exit code and stderr, and whether the run's directory exists."""
    plugin = tmp / "plugins" / "jax_plugins" / "interrupted_at_start"  # (no __init__.py above it)
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(
        "import os, signal, time\n\n"
        "def initialize():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(60)\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp / "plugins"), os.environ.get("PYTHONPATH")]))
    with stopped_at_the_end(
        launch(
            "train.py",
            FAST + ["--out", str(tmp / "run"), "--cache-dir", str(tmp / "cache")],
            child_env(PYTHONPATH=path),
        )
    ) as proc:
        code, err = ending(proc)
    return code, err, (tmp / "run").exists()


def test_ctrl_c_that_jax_catches_while_it_starts_a_plugin_still_ends_the_command(
    interrupted_while_jax_starts_a_plugin,
):
    """JAX starts each plugin under a bare `except:` and logs what it raised: a Ctrl-C there was
    dropped, and train.py trained on, on the CPU (seen on an H200). It ends the command:
    one line, exit 130, and no run directory."""
    code, err, made_run_dir = interrupted_while_jax_starts_a_plugin
    assert_interrupted(code, err)
    assert not made_run_dir


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return f.read().split()
    except (FileNotFoundError, ProcessLookupError):  # it has ended (before the open, or after it)
        return []


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):  # it has ended (before the open, or after it)
        return ""


def running(pid):
    """Whether the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def descendants(pid):
    kids = children(pid)
    return kids + [d for k in kids for d in descendants(k)]


@contextlib.contextmanager
def stopped_at_the_end(proc):
    """Kills proc and every process below it at the end, if they still run: a test that fails
    midway leaves no command behind it (a benchmark.py row once ran on, taking both cores, for
    the rest of the suite)."""
    try:
        yield proc
    finally:
        if (
            proc.poll() is None
        ):  # not yet waited for: its pid, and its children's, are still its own
            kill([proc.pid] + descendants(proc.pid))
            proc.wait(timeout=120)


def kill(pids):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def drop_a_ctrl_c():
    """A Ctrl-C whose KeyboardInterrupt Python drops: raised inside a garbage-collection callback,
    as JAX's is at every collection ("Exception ignored in: ..."; 1 of 30 Ctrl-Cs sent to
    train.py 1-3 s after it began to load JAX was lost, and the run trained on)."""

    def callback(phase, _):
        if phase == "start":
            signal.raise_signal(
                signal.SIGINT
            )  # its handler runs right after this call: in the callback
            for _ in range(10):  # (or, at the latest, at this loop's first jump back)
                pass

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)


def busy(seconds, until=lambda: False):
    deadline = time.time() + seconds
    while time.time() < deadline and not until():
        pass


def test_a_ctrl_c_that_python_drops_is_delivered_again_and_stops_the_command(capsys):
    def command(_):
        drop_a_ctrl_c()
        busy(120)  # a command that ends by itself only long after any redelivery
        return 0

    t = time.time()
    assert cli.run_command(command, None) == 130  # stopped by the Ctrl-C, delivered again
    assert time.time() - t < 60
    assert capsys.readouterr().err == "interrupted; no file was left half-written.\n"
    # Delivered again to what SIGINT does by then: the training loop's flag, not an exception.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with cli.dropped_interrupts_raised_again(delay=0.3):
            drop_a_ctrl_c()
            with cli.interrupt_flag() as stop:
                busy(3, until=lambda: stop["signal"])
        assert stop["signal"] == signal.SIGINT
    finally:
        signal.signal(signal.SIGINT, old)
    assert "Exception ignored" not in capsys.readouterr().err


def test_sigterm_stops_evaluate_and_benchmark_and_no_child_outlives_them(finished_run, tmp_path):
    """Issue 14.9: SIGTERM is Ctrl-C; benchmark.py's row process is stopped with it. evaluate.py
    compare is held after its first evaluation (of two, before the CSV) for up to a minute: unheld,
    both take about a second, and the command could end before the signal came."""
    held = (
        "import sys, time, cli, evaluate, evaluation; first = evaluation.per_token_loss; "
        "evaluation.per_token_loss = lambda *a: (first(*a), time.sleep(60))[0]; "
        "cli.exit_with(evaluate.main(sys.argv[1:]))"
    )
    argv = [
        "compare",
        str(finished_run),
        "--memory-sizes",
        "64,128",
        "--max-tokens",
        "0",
        "--csv",
        str(tmp_path / "c.csv"),
    ]
    with stopped_at_the_end(launch("-c", [held] + argv)) as proc:
        wait_for_line(proc, "memory 64 vs 128: evaluating")
        proc.send_signal(signal.SIGTERM)
        assert_interrupted(*ending(proc))
    assert not (tmp_path / "c.csv").exists()
    with stopped_at_the_end(
        launch("benchmark.py", ["--memory-sizes", "0", "--timed-steps", "1000"])
    ) as proc:
        for _ in range(200):
            kids = children(proc.pid)
            if kids:
                break
            time.sleep(0.05)
        assert kids, "benchmark.py started no row process"
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        assert_interrupted(*ending(proc))
    time.sleep(0.5)
    left = [k for k in kids if running(k)]
    kill(left)
    assert not left, "a row process outlived benchmark.py"


@pytest.fixture(scope="session")
def peer_benchmark_stopped(tmp_path_factory, runs_commands):
    """SIGTERM to `benchmark.py --peer` once it has started its row process: (its exit code, its
    stderr, the row's pid, whether it still runs half a second later)."""
    with stopped_at_the_end(
        launch(
            "benchmark.py",
            ["--memory-sizes", "0", "--timed-steps", "1000", "--peer", sys.executable],
            child_env(),
        )
    ) as proc:
        # (this Python has no torch: the peer is skipped, and our rows run)
        found, deadline = [], time.time() + 120
        while not found and time.time() < deadline and proc.poll() is None:
            found = [k for k in children(proc.pid) if "--row" in cmdline(k)]
            time.sleep(0.05)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        code, err = ending(proc)
    time.sleep(0.5)
    left = [k for k in found if running(k)]
    kill(left)
    return code, err, found, left


def test_sigterm_stops_the_side_by_side_with_the_peer_and_its_row_process(peer_benchmark_stopped):
    code, err, found, left = peer_benchmark_stopped
    assert len(found) == 1, ("its row process never ran", err)
    assert_interrupted(code, err)
    assert not left, "a row process outlived benchmark.py --peer"


@pytest.mark.parametrize(
    "size, code, expected",
    [(10**6, 0, 141), (1, 0, 141), (1, 2, 2)],
    ids=["while-running", "at-exit", "failure-at-exit"],
)
def test_a_reader_that_stops_reading_stdout_ends_the_command_quietly(size, code, expected):
    """`python evaluate.py compare ... | head -1`: once the reader is gone, the next write to stdout
    (during the command, or the last flush at exit) ends the process with SIGPIPE's code, 141, and
    nothing on stderr (it was once 'error: Broken pipe: None', exit 2); a command that failed
    keeps its own code. stdout is block-buffered here, as in a shell pipe, so a short line waits
    for the flush at exit."""
    command = f"lambda args: print('x' * {size}) or {code}"
    child = f"import cli; cli.exit_with(cli.run_command({command}, None))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stdout.close()
    assert proc.wait(timeout=120) == expected
    assert proc.stderr.read() == ""


def test_a_path_that_is_not_utf8_is_printed_as_its_bytes_under_any_utf8_locale():
    """A directory named with the byte 0xff: under a UTF-8 locale other than C (stdout's errors
    'strict', here forced by PYTHONIOENCODING) printing it once failed midway through a run,
    after its first files were written."""
    child = (
        "import argparse, cli; p = argparse.ArgumentParser(); p.add_argument('out'); "
        "cli.exit_with(cli.run_main(p, lambda args: print('run', args.out) or 0, None))"
    )
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    proc = subprocess.run(
        [sys.executable, "-c", child, b"/tmp/r\xff"],
        cwd=HERE,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, b"run /tmp/r\xff\n", b"")


def test_a_backend_that_cannot_start_is_one_line_before_anything_is_written(tmp_path):
    """JAX_PLATFORMS naming a backend this machine lacks (a GPU command copied to a CPU machine:
    cuda there was a bare AssertionError from inside JAX) ended train.py in a traceback."""
    env = {**os.environ, "JAX_PLATFORMS": "bogus"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "train.py"),
            "--steps",
            "1",
            "--out",
            str(tmp_path / "r"),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: JAX could not start its backend (JAX_PLATFORMS='bogus'):")
    assert not (tmp_path / "r").exists()


def test_out_of_device_memory_is_one_line_and_other_runtime_errors_are_not_hidden(capsys):
    def raising(error):
        def command(args):
            raise error

        return command

    import jax

    for error in (
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 bytes"),
        MemoryError(),
    ):
        assert cli.run_command(raising(error), None) == 2
        assert capsys.readouterr().err == (
            "error: the device ran out of memory; lower --batch-size, "
            "--segment-length or --memory-size.\n"
        )
    for error in (
        jax.errors.JaxRuntimeError("INTERNAL: a bug"),
        RuntimeError("a bug"),
        AssertionError("a bug"),
    ):
        with pytest.raises(type(error), match="a bug"):  # a bug of ours stays a traceback
            cli.run_command(raising(error), None)


def test_an_empty_compilation_cache_entry_left_by_an_interrupt_is_compiled_anew_without_a_warning(
    tmp_path,
):
    """Ctrl-C while JAX writes an entry of train.py's compilation cache (after it opened the file,
    before it wrote it) left an empty file. JAX never rewrites an entry that exists, so every
    later run warned that it could not read it (two lines on stderr) and compiled that program
    again; the suite once caught this in the interrupted runs above."""
    child = (
        "import sys, jax, runs; runs.use_compilation_cache(sys.argv[1]); "
        "print(float(jax.jit(lambda x: x * 3 + 1)(2.0)))"
    )
    run = lambda: subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)],
        cwd=HERE,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    first = run()
    assert (first.returncode, first.stdout, first.stderr) == (0, "7.0\n", "")
    entries = [
        p
        for p in (tmp_path / "jax").iterdir()
        if p.name.startswith("jit__lambda") and p.name.endswith("-cache")
    ]
    assert len(entries) == 1 and entries[0].stat().st_size > 0
    entries[0].write_bytes(b"")  # as an interrupted write leaves it
    again = run()
    assert (again.returncode, again.stdout, again.stderr) == (0, "7.0\n", "")
    assert entries[0].stat().st_size > 0  # written anew: the next run loads it


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 0), (signal.SIGTERM, 2)])
def test_a_signal_after_the_command_returned_does_not_change_how_it_ended(sig, code):
    """The scripts once left through the interpreter's teardown (0.3 s after evaluate.py's
    work), where a Ctrl-C or SIGTERM found the script's first handler back ("interrupted before
    anything was written.", 130, after the files were written) or, later in the teardown,
    Python's defaults (killed without a word: a fuzz of interrupts at random moments saw it in
    two of thirty commands). The command's own ending stands; the teardown, where this child
    signals itself, is not run."""
    child = (
        "import atexit, os, startup\n"
        "startup.leave_on_early_signals()\n"  # as each script does before it imports JAX
        "import cli\n"
        f"atexit.register(lambda: (os.kill(os.getpid(), {int(sig)}), "
        "__import__('time').sleep(1)))\n"
        f"cli.exit_with(cli.run_command(lambda args: print('done') or {code}, None))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=HERE, capture_output=True, text=True, timeout=120
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, "done\n", "")

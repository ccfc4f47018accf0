"""Several processes, one run (multihost.py), on the CPU: two train.py processes on localhost, each
with two forced host devices, joined by jax.distributed with Gloo, against one process of four
devices; a resume after one process was killed; the refusals before anything is written."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import cli
import multihost
import runs
from test_train import FAST

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 6
TIMEOUT = 10  # --coordinator-timeout: a process that stops answering ends the others after as long


def free_port(low=None):
    """A port free on localhost (at least `low`)."""
    for port in [0] if low is None else np.random.default_rng().permutation(np.arange(low, 65536)):
        with socket.socket() as s:
            try:
                s.bind(("localhost", int(port)))
            except OSError:
                continue
            return s.getsockname()[1]


def env(devices, proxy=None):
    """The session's settings (conftest), on a CPU of `devices` devices, with `proxy` as the only
    HTTP proxy: gRPC, which joins the processes, would send even localhost through one."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()} | dict(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=flags,
        **({"http_proxy": proxy, "https_proxy": proxy} if proxy else {}),
    )


def start(argv, processes=2, devices=2, timeout=TIMEOUT, only=None, slurm=False, proxy=None):
    """train.py in `processes` processes (process 1 first: it waits for the coordinator); `only`:
    {process id: flags that process alone adds}; slurm: the processes learn their count and ids
    from the variables `srun` sets, and JAX its coordinator (on the port that the job id names);
    proxy: an HTTP proxy in their environment."""
    port = free_port(65536 - 4096 if slurm else None)
    several = lambda i: (
        (
            [
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                str(processes),
                "--process-id",
                str(i),
            ]
            if processes > 1 and not slurm
            else []
        )
        + ["--coordinator-timeout", str(timeout)]
    )
    launcher = lambda i: (
        dict(
            SLURM_JOB_ID=str(port - (65536 - 4096)),
            SLURM_STEP_NODELIST="localhost",
            SLURM_NTASKS=str(processes),
            SLURM_PROCID=str(i),
            SLURM_LOCALID=str(i),
        )
        if slurm
        else {}
    )
    return [
        subprocess.Popen(
            [sys.executable, "train.py"] + argv + several(i) + (only or {}).get(i, []),
            cwd=HERE,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env(devices, proxy) | launcher(i),
        )
        for i in reversed(range(processes))
    ][::-1]


def finish(procs):
    """[(exit code, stdout, stderr)] of each process, by process id."""
    said = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, said)]


def arrays(run):
    return runs.load_checkpoint(os.path.join(run, "checkpoint.npz"))


@pytest.fixture(scope="session")
def multihost_runs(tmp_path_factory, runs_commands, cache):
    """FAST for STEPS steps: in one process of 4 devices; in 2 processes of 2 devices, started as
    SLURM starts them; and in 2 x 2 with the flags, where process 1 is killed once a checkpoint is
    saved, then resumed in 2 x 2. Each run's directory and what its processes printed."""
    tmp = tmp_path_factory.mktemp("multihost")
    argv = lambda name: (
        FAST
        + [
            "--steps",
            str(STEPS),
            "--save-every",
            "1",
            "--eval-every",
            "0",
            "--out",
            str(tmp / name),
            "--cache-dir",
            cache,
        ]
    )
    one, two = start(argv("one"), processes=1, devices=4), start(argv("two"), slurm=True)
    done = {"one": finish(one), "two": finish(two)}
    # (every program is compiled, and cached, before its first checkpoint; a proxy that answers
    # nothing
    # is in the environment, and the coordinator is reached without it)
    killed = start(argv("killed"), proxy="http://127.0.0.1:9")
    while not os.path.exists(tmp / "killed" / "checkpoint.npz") and killed[0].poll() is None:
        time.sleep(0.01)
    killed[1].kill()
    t = time.time()
    done["killed"] = finish(killed)
    done["survived_for"] = time.time() - t
    done["killed_at"] = arrays(tmp / "killed")[0]["step"]
    shutil.copytree(tmp / "killed", tmp / "killed_copy")
    done["resumed"] = finish(start(["--out", str(tmp / "killed"), "--resume"]))
    return tmp, done


def test_two_processes_of_two_devices_train_as_one_process_of_four(multihost_runs):
    """The global batch is the same whatever the number of processes: the losses agree, and the
    parameters after STEPS steps differ only by float32 reduction order (the gradients' sums
    over the devices run in another order)."""
    tmp, done = multihost_runs
    for name in ("one", "two"):
        assert all(code == 0 for code, _, _ in done[name]), done[name]
    assert (
        "device cpu x4 in 2 processes" in done["two"][0][1]
        and "device cpu x4," in done["one"][0][1]
    )
    one, two = arrays(tmp / "one"), arrays(tmp / "two")
    assert one[0]["step"] == two[0]["step"] == STEPS and sorted(one[1]) == sorted(two[1])
    for key in one[1]:
        scale = max(1.0, float(np.abs(one[1][key]).max())) if one[1][key].dtype.kind == "f" else 0
        np.testing.assert_allclose(two[1][key], one[1][key], rtol=0, atol=1e-5 * scale, err_msg=key)
    losses = lambda run: [
        r["loss"] for r in map(json.loads, open(tmp / run / "metrics.jsonl")) if "loss" in r
    ]
    np.testing.assert_allclose(losses("two"), losses("one"), rtol=1e-5)


def test_only_process_0_prints_and_writes(multihost_runs):
    """Process 1 prints nothing on stdout; each step is logged once, config.json is process 0's,
    and eval.json holds the one evaluation, on the whole validation set."""
    tmp, done = multihost_runs
    (_, out0, _), (_, out1, _) = done["two"]
    assert out1 == "" and out0.count("\nstep ") == STEPS and out0.count("\neval ") == 1, (
        out0,
        out1,
    )
    records = [json.loads(line) for line in open(tmp / "two" / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) + [STEPS]
    assert json.load(open(tmp / "two" / "config.json"))["args"]["process_id"] == 0
    two, one = (
        json.load(open(tmp / "two" / "eval.json")),
        json.load(open(tmp / "one" / "eval.json")),
    )
    assert sorted(two) == sorted(one) and two["tokens"] == one["tokens"]
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)


def test_a_killed_process_stops_the_other_and_the_resume_continues_exactly(multihost_runs):
    """Process 1 killed mid-run: process 0 stops within --coordinator-timeout, never hangs. The
    resume, in 2 x 2, continues from the last complete checkpoint to the same parameters, memory
    and optimizer as the run that was never stopped, bit for bit, and logs each later step once."""
    tmp, done = multihost_runs
    assert done["killed"][0][0] != 0 and done["survived_for"] < TIMEOUT + 5, done["killed"][0][2][
        -2000:
    ]
    assert 1 <= done["killed_at"] < STEPS  # (a run that ended before the kill would prove nothing)
    assert all(code == 0 for code, _, _ in done["resumed"]), done["resumed"]
    resumed, straight = arrays(tmp / "killed"), arrays(tmp / "two")
    assert resumed[0]["step"] == STEPS and sorted(resumed[1]) == sorted(straight[1])
    for key in straight[1]:
        np.testing.assert_array_equal(resumed[1][key], straight[1][key], err_msg=key)
    steps = [
        r["step"] for r in map(json.loads, open(tmp / "killed" / "metrics.jsonl")) if "loss" in r
    ]
    assert steps == list(range(1, STEPS + 1))


def test_a_resume_with_another_number_of_processes_continues_the_run(multihost_runs, capsys):
    """The checkpoint holds the whole state, every row's memory included: one process of one device
    continues a run of 2 x 2 processes and devices (to float32 reduction order)."""
    import train

    tmp, done = multihost_runs
    assert train.main(["--out", str(tmp / "killed_copy"), "--resume"]) == 0
    assert f"step {done['killed_at'] + 1:6d}" in capsys.readouterr().out
    resumed, one = arrays(tmp / "killed_copy"), arrays(tmp / "one")
    assert resumed[0]["step"] == STEPS
    for key in one[1]:
        scale = max(1.0, float(np.abs(one[1][key]).max())) if one[1][key].dtype.kind == "f" else 0
        np.testing.assert_allclose(
            resumed[1][key], one[1][key], rtol=0, atol=1e-5 * scale, err_msg=key
        )


def refusal(result):
    """The one sentence a refused process printed, past what Gloo prints of its connections."""
    code, out, err = result
    lines = [line for line in err.splitlines() if line and not re.search(r"Gloo|peer ranks", line)]
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: "), result
    return lines[0]


def test_bad_input_of_several_processes_is_refused_in_one_sentence_before_anything_is_written(
    tmp_path, cache
):
    """An unreachable coordinator (within --coordinator-timeout, named), a process id out of range,
    a taken port, a coordinator, a count or --out left out, a batch that does not divide over 2
    processes x 2 devices, and a refusal of one process alone, which the other gives too rather than
    wait: exit 2, one sentence, and no run directory."""
    out, port = tmp_path / "run", free_port()
    argv = FAST + ["--steps", "2", "--out", str(out), "--cache-dir", cache]
    t = time.time()
    alone = lambda *flags: subprocess.Popen(
        [sys.executable, "train.py"] + argv + list(flags),
        cwd=HERE,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(2),
    )
    with socket.create_server(("", port)):  # a port that another program holds
        probes = [
            alone(
                "--coordinator",
                f"localhost:{free_port()}",
                "--num-processes",
                "2",
                "--process-id",
                "1",
                "--coordinator-timeout",
                "2",
            ),
            alone(
                "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", "2"
            ),
            alone(
                "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", "0"
            ),
            alone("--num-processes", "2", "--process-id", "1"),
            alone("--process-id", "0"),
        ]
        no_out = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "train.py")]
            + FAST
            + [  # in an empty folder
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                "2",
                "--process-id",
                "1",
            ],
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env(2),
        )
        unreachable, out_of_range, taken, no_coordinator, no_count, no_out = finish(
            probes + [no_out]
        )
    assert (
        re.fullmatch(
            r"error: cannot reach the coordinator localhost:\d+ within 2 s "
            r"\(--coordinator-timeout\)"
            r".*\.",
            refusal(unreachable),
        )
        and time.time() - t < 30
    )
    assert (
        refusal(out_of_range)
        == "error: --process-id 2 is out of range for --num-processes 2: the ids are 0 to 1."
    )
    assert f"port {port} is in use" in refusal(taken)
    assert "several processes need --coordinator HOST:PORT" in refusal(no_coordinator)
    assert "several processes need --num-processes and --process-id, both" in refusal(no_count)
    assert (
        refusal(no_out)
        == "error: several processes train one run: give --out, the same directory for every "
        "process."
        and os.listdir(tmp_path) == []
    )  # (no runs/ folder, no .cache)
    (tmp_path / "afile").write_text("a file where a directory should be")
    odd = start(
        argv[: argv.index("--batch-size")]
        + ["--batch-size", "6"]
        + argv[argv.index("--batch-size") + 2 :]
    )
    one_sided = start(
        argv, only={1: ["--cache-dir", str(tmp_path / "afile")]}
    )  # refused by process 1 alone
    for result in finish(odd):
        want = "batch_size 6 must be divisible by 4 devices (2 processes x 2) x grad_accum 1."
        assert refusal(result) == "error: " + want
    said = finish(one_sided)
    assert refusal(said[1]).startswith(
        f"error: cannot write to --cache-dir {tmp_path / 'afile'}"
    ) and refusal(said[0]) == "error: process 1: " + refusal(said[1]).removeprefix("error: "), said
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--coordinator", "nohost"],
            "argument --coordinator: takes HOST:PORT with a port from 1 to 65535, got 'nohost'",
        ),
        (["--coordinator", "localhost:0"], "argument --coordinator: takes HOST:PORT"),
        (["--num-processes", "0"], "argument --num-processes: must be positive, got 0"),
        (["--process-id", "-1"], "argument --process-id: must not be negative, got -1"),
        (
            ["--coordinator-timeout", "0.5"],
            "argument --coordinator-timeout: must be at least 1 second, got 0.5",
        ),
    ],
)
def test_bad_flags_of_several_processes_get_one_sentence(tmp_path, flags, message, capsys):
    import train

    assert train.main(FAST + ["--out", str(tmp_path / "run")] + flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and not (tmp_path / "run").exists(), err


STEP_COLLECTIVES = """
import json, re, sys
import jax, numpy as np
import evaluation, memorizing_transformer as mt, multihost, optimizer, presets, train
config = presets.PRESETS["tiny"].replace(num_layers=2, memory_layers=(1,), segment_length=32,
                                    memory_size=192, batch_size=8, vocab_size=512,
                                    grad_accum=int(sys.argv[1]))
params = mt.init_params(config, jax.random.PRNGKey(0))
opt_state = optimizer.make_optimizer(config)[0](params)
state = mt.init_state(config, config.batch_size)
params, opt_state, state, place = multihost.distribute(params, opt_state, state)
B, T = config.batch_size, config.segment_length
batch = place(dict(tokens=np.zeros((B, T), np.int32), targets=np.zeros((B, T), np.int32),
                   mask=np.ones((B, T), bool), reset=np.zeros(B, bool)))
step = train.make_train_step(evaluation.step_config(config))
text = step.lower(params, opt_state, state, batch).compile().as_text()
ops = "all-gather|all-to-all|collective-permute|reduce-scatter|all-reduce"
print(json.dumps(re.findall(r"= (.*?) (?:" + ops + r")(?:-start)?\\(", text)))
"""


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_no_memory_leaves_its_device_in_a_step_on_4_devices(grad_accum):
    """Each row's memory (M = 192 slots here) and XL cache stay on the device that holds the row,
    with micro-batches too: no collective of the compiled step on 4 devices moves a buffer of memory
    slots or of a segment's keys. (Micro-batches once took contiguous rows, and gathered every
    memory to every device.)"""
    proc = subprocess.run(
        [sys.executable, "-c", STEP_COLLECTIVES, str(grad_accum)],
        cwd=HERE,
        capture_output=True,
        text=True,
        env=env(4),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    shapes = json.loads(proc.stdout)
    assert shapes and any("512,128" in s for s in shapes), (
        shapes
    )  # the gradients are summed: the op is found
    assert not [s for s in shapes if re.search(r"\b192\b|,32,32\]", s)], shapes


def test_a_coordinator_port_where_an_http_server_listens_is_refused_before_jax_joins():
    """Process 1 pointed at a port where an HTTP server listens once ended in JAX's fatal error
    (exit 134, a C++ stack): before jax.distributed.initialize, the answer to HTTP/2's preface
    tells an HTTP/1 server from the coordinator, and the refusal is one sentence."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        with pytest.raises(cli.UsageError, match="answers, but not as the run's coordinator"):
            multihost.wait_for(address, 10)
    finally:
        server.shutdown()

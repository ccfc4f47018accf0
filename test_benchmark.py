"""benchmark.py: its rows and JSON, --train-only, --profile's tables, the alternated rounds,
--compile-jobs, --search, the side by side with the peer over repeats, and its answers to bad
input."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest

import benchmark
from conftest import child_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def toy_benchmark(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("toy_benchmark")
    # The smallest preset (2 layers) at 2 rows: the test is about the rows and the JSON, and
    # each row compiles four programs in a process of its own.
    proc = subprocess.run(
        [
            sys.executable,
            "benchmark.py",
            "--preset",
            "synthetic",
            "--batch-size",
            "2",
            "--memory-sizes",
            "0,512",
            "--timed-steps",
            "1",
            "--json",
            str(tmp / "rows.json"),
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    return proc, tmp / "rows.json"


def test_benchmark_runs_at_a_toy_size_and_writes_the_documented_json(toy_benchmark):
    proc, out = toy_benchmark
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["memory_size"] for r in rows] == [0, 512]
    for r in rows:
        assert {
            "memory_size",
            "step_s",
            "ratio",
            "floor_ratio",
            "tokens_per_s",
            "peak_bytes",
            "recall",
        } <= set(r)
        assert r["step_s"] > 0 and r["peak_bytes"] > 0 and r["profile"] is None
    assert rows[0]["ratio"] == 1.0 and rows[0]["floor_ratio"] == 1.0 and rows[0]["recall"] is None
    assert rows[1]["floor_ratio"] > 1.0 and 0.9 <= rows[1]["recall"] <= 1.0
    assert rows[0]["peak_growth"] is None and rows[1]["peak_growth"] is not None
    assert (
        rows[0]["grad_s"] > rows[0]["loss_forward_s"] > 0 and rows[1]["grad_over_forward"] is None
    )
    assert rows[0]["grad_over_forward"] == rows[0]["grad_s"] / rows[0]["loss_forward_s"]
    device = "CPU" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    assert (
        f"device: {device}" in proc.stdout
        and "train step" in proc.stdout
        and "forward pass" in proc.stdout
    )
    assert "over the first row" not in proc.stdout  # size 0 is the baseline
    assert "median of 1 step\n" in proc.stdout  # (once "1 steps")


@pytest.fixture(scope="session")
def train_only_benchmark(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("train_only_benchmark")
    # --compile-jobs with no compilation cache of the test session's: the benchmark makes its
    # own in TMPDIR, and removes it at the end.
    (tmp / "tmp").mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "benchmark.py",
            "--preset",
            "synthetic",
            "--batch-size",
            "2",
            "--memory-sizes",
            "512",
            "--timed-steps",
            "1",
            "--train-only",
            "--json",
            str(tmp / "rows.json"),
            "--profile",
            str(tmp / "prof"),
            "--rounds",
            "1",
            "--compile-jobs",
            "2",
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        env=child_env(TMPDIR=str(tmp / "tmp")),
    )
    return proc, tmp


def test_benchmark_train_only_times_the_step_and_nothing_else_and_profile_names_the_ops(
    train_only_benchmark,
):
    proc, tmp = train_only_benchmark
    out = tmp / "rows.json"
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["step_s"] > 0 and row["peak_bytes"] > 0 and 0.9 <= row["recall"] <= 1.0
    # --compile-jobs: compiled ahead in another process, then timed. (Which took longer, the
    # compile or the timed row's first call, is the machine's load as much as the cache's.)
    assert row["compile_s"] > 0 and row["compiled_ahead_s"] > 0
    assert "compiled ahead: 1 rows" in proc.stderr
    assert not list((tmp / "tmp").iterdir())
    # --rounds: the one row is its own base (no size 0 given), so its paired ratio is 1.
    assert (
        row["paired_ratio"] == row["paired_min"] == row["paired_max"] == 1.0
        and "paired" in proc.stdout
    )
    assert (
        "ratios (and the paired ones): over the first row (memory 512), as --memory-sizes has no 0"
        in proc.stdout
    )
    assert row["forward_s"] is None and row["forward_ratio"] is None and row["grad_s"] is None
    assert "train step" in proc.stdout and "forward pass" not in proc.stdout
    # --profile: the operations that took the time, each named after the JAX operation it came from.
    prof = json.loads((tmp / "prof" / "profile_M512.json").read_text())
    # (A GPU's library matmuls carry no JAX operation: they are "library matmul".)
    assert (
        prof["ms_per_step"] > 0
        and prof["ops"]
        and any(
            "dot_general" in op["source"] or op["source"] == "library matmul"
            for op in prof["by_source"]
        )
    )
    assert abs(sum(op["share"] for op in prof["by_source"]) - 1) < 1e-6 and row["profile"]
    assert (
        tmp / "prof" / "step_M512.hlo.txt"
    ).exists() and "where the step's time goes" in proc.stdout
    # ... and the largest arrays the step's operations produce, largest first, each as many bytes as
    # its shape holds.
    buffers = prof["largest_buffers"]
    assert buffers == row["profile"]["largest_buffers"]
    assert "the largest arrays the step's operations produce" in proc.stdout
    assert [b["bytes"] for b in buffers] == sorted((b["bytes"] for b in buffers), reverse=True)
    for b in buffers:
        dtype, dims = b["shape"].rstrip("]").split("[")
        itemsize = {
            "f64": 8,
            "s64": 8,
            "u64": 8,
            "f32": 4,
            "s32": 4,
            "u32": 4,
            "bf16": 2,
            "f16": 2,
            "s16": 2,
            "u16": 2,
            "pred": 1,
            "s8": 1,
            "u8": 1,
        }[dtype]
        assert b["bytes"] == itemsize * math.prod(int(d) for d in dims.split(",") if d)


def test_largest_buffers_counts_what_operations_write_and_not_the_values_inside_fusions():
    """benchmark.largest_buffers reads a compiled program's HLO: the outputs of the entry
    computation's and loop bodies' operations (each element of a tuple on its own), not those
    inside a fused computation (whatever its name: a GPU's Triton matmuls are fusions whose
    bodies are named gemm_fusion_*_computation), nor parameters, bitcasts and tuples, which
    write nothing."""
    hlo = """HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%fused_transpose.5 (param_0: f32[2,3]) -> f32[64,64,64] {
  %param_0 = f32[2,3]{1,0} parameter(0)
  ROOT %transpose.1 = f32[64,64,64]{2,1,0} transpose(%param_0), dimensions={1,0}
}

%gemm_fusion_dot.7_computation (parameter_0: bf16[2,3], p_1: bf16[3,4]) -> bf16[512,512,64] {
  %parameter_0 = bf16[2,3]{1,0} parameter(0)
  ROOT %dot.7 = bf16[512,512,64]{2,1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}
}

%region_0.2 (arg: (s32[], bf16[16,16])) -> (s32[], bf16[16,16]) {
  %arg = (s32[], bf16[16,16]{1,0}) parameter(0)
  %loop_fusion.3 = bf16[16,16]{1,0} fusion(%arg), kind=kLoop, calls=%fused_transpose.5
  ROOT %tuple.2 = (s32[], bf16[16,16]{1,0}) tuple(%gte, %loop_fusion.3)
}

ENTRY %main.9 (p: f32[1024,1024]) -> f32[8] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %bitcast.1 = f32[1048576]{0} bitcast(%p)
  %custom-call.89 = (f32[32,16]{0,1}, s8[4096]{0}) custom-call(%p), custom_call_target="__cublas"
  %input_transpose_fusion.3 = f32[4,8,2,128,32]{4,3,2,1,0} fusion(%p), metadata={op_name="mul"}
  %while.1 = (s32[], bf16[16,16]{1,0}) while(%t), condition=%c, body=%region_0.2
  %gemm_fusion_dot.7 = bf16[8,8]{1,0} fusion(%p, %p), calls=%gemm_fusion_dot.7_computation
  ROOT %copy.4 = f32[8]{0} copy(%x)
}
"""
    got = benchmark.largest_buffers(hlo, n=4)
    assert [(b["op"], b["opcode"], b["shape"], b["bytes"]) for b in got] == [
        ("input_transpose_fusion.3", "fusion", "f32[4,8,2,128,32]", 4 * 4 * 8 * 2 * 128 * 32),
        ("custom-call.89", "custom-call", "s8[4096]", 4096),
        ("custom-call.89", "custom-call", "f32[32,16]", 4 * 32 * 16),
        ("loop_fusion.3", "fusion", "bf16[16,16]", 2 * 16 * 16),
    ]
    assert (
        len(benchmark.largest_buffers(hlo)) == 6
    )  # and the copy's 32 bytes, the GPU's gemm fusion's 128


def test_alternated_rounds_give_each_row_its_steps_over_the_no_memory_steps_of_the_same_rounds(
    monkeypatch,
):
    """benchmark.py --rounds: each row's ratio is the median over rounds of its step time over
    the no-memory step's in the same round, after two warm-up rounds. A fake clock: each step
    takes its size's cost times the machine's speed in that round, plus 100 on its first call."""
    sizes, cost, speeds = [512, 0, 1024], {0: 1.0, 512: 1.5, 1024: 2.5}, [5.0, 7.0, 1.0, 3.0]
    clock, calls = {"t": 0.0}, []

    def fake_row_step(preset, batch, m, *_):
        def step(*a):
            clock["t"] += cost[m] * speeds[len(calls) // len(sizes)] + 100 * (m not in calls)
            calls.append(m)
            return a[0], a[1], a[2], {}

        return None, step, [None] * 4

    monkeypatch.setattr(benchmark, "row_step", fake_row_step)
    monkeypatch.setattr(benchmark.time, "perf_counter", lambda: clock["t"])
    out = benchmark.alternate_rows("synthetic", 1, sizes, 2, "float32")
    assert calls == sizes * 4 and out[0] == {
        "paired_ratio": 1.0,
        "paired_min": 1.0,
        "paired_max": 1.0,
    }
    for m in (512, 1024):  # the speeds cancel within a round; the first calls are not counted
        assert [out[m][k] for k in ("paired_min", "paired_ratio", "paired_max")] == pytest.approx(
            [cost[m]] * 3
        )


def test_compile_ahead_runs_the_rows_jobs_at_a_time_and_stops_at_the_first_failure(
    monkeypatch, capsys
):
    """benchmark.py --compile-jobs: every row's compile process, `jobs` at a time, all with the
    environment that names the cache; a failed one is one line naming its row, exit code 1."""
    groups = []

    def fake_run_children(cmds, env):
        groups.append([int(c[c.index("--row") + 1]) for c in cmds])
        assert all("--compile-only" in c for c in cmds)
        assert env == {"JAX_COMPILATION_CACHE_DIR": "c", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        return [
            (0, f'{{"compile_s": {m / 512}}}\n', "")
            if m != 2048
            else (1, "", "Traceback\nValueError: no")
            for m in groups[-1]
        ]

    monkeypatch.setattr(benchmark, "run_children", fake_run_children)
    ahead, code = benchmark.compile_ahead(
        ["x"], [0, 512, 1024], 2, {"JAX_COMPILATION_CACHE_DIR": "c"}
    )
    assert groups == [[0, 512], [1024]] and code == 0 and ahead == {0: 0.0, 512: 1.0, 1024: 2.0}
    groups.clear()
    assert benchmark.compile_ahead(
        ["x"], [0, 2048, 512, 1024], 3, {"JAX_COMPILATION_CACHE_DIR": "c"}
    ) == (None, 1)
    assert groups == [[0, 2048, 512]]
    assert capsys.readouterr().err == (
        "error: compiling the row with memory size 2048 failed (exit code 1): ValueError: no\n"
    )


def test_benchmark_search_times_the_forms_of_the_search_and_the_top_k_both_ways_and_they_agree(
    tmp_path, capsys
):
    out = tmp_path / "search.json"
    assert (
        benchmark.main(
            [
                "--search",
                "--preset",
                "synthetic",
                "--batch-size",
                "1",
                "--memory-sizes",
                "0,8192",
                "--timed-steps",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())  # memory size 0 has no search: skipped
    assert row["memory_size"] == 8192 and set(row["search_s"]) == {"kernel", "plain", "exact"}
    assert all(t > 0 for t in row["search_s"].values()) and row["bins"] < 8192
    # The kernel and the plain search keep the same bins' maxima (random float32 scores: all but the
    # rare near-ties that the kernel's packed keys round); binning loses a few of the exact top-k.
    assert row["same_slots"] > 0.99 and 0.9 <= row["recall"] < 1.0
    # The final top-k of the bins' winners, by lax.top_k and in passes: the same keys.
    assert set(row["top_k_s"]) == {"lax", "passes"} and all(t > 0 for t in row["top_k_s"].values())
    assert row["top_k_same"] == 1.0
    assert "kernel ms" in capsys.readouterr().out
    assert benchmark.main(["--search", "--train-only"]) == 2
    assert "cannot be combined" in capsys.readouterr().err


def test_benchmark_memorize_times_memorizing_and_scoring_beside_a_forward_without_memory(
    tmp_path, capsys
):
    import presets

    out = tmp_path / "memorize.json"
    argv = ["--memorize", "--preset", "synthetic", "--memory-sizes", "0,512", "--timed-steps",
            "2", "--json", str(out)]
    assert benchmark.main(argv) == 0
    (row,) = json.loads(out.read_text())  # memory size 0 is the rows' baseline: skipped
    steps = {"score", "no_memory", "memorize", "memorize_0_1"}
    assert row["memory_size"] == 512 and set(row["step_s"]) == steps
    c = presets.PRESETS["synthetic"]
    T, E, H, D, K = c.segment_length, c.d_model, c.num_heads, c.head_dim, c.num_neighbors
    for name, t in row["step_s"].items():
        assert t > 0 and row["tokens_per_s"][name] == pytest.approx(T / t)
    assert row["score_ratio"] == pytest.approx(row["step_s"]["score"] / row["step_s"]["no_memory"])
    # The floor, counted by hand: a segment's forward of one row, and what one memory layer
    # adds to it (the [T, M] scores of each head, and attention over the K retrieved pairs).
    layers = c.num_layers * (2 * T * (4 * E * H * D + 2 * E * c.d_ff) + 2 * 2 * H * T * 2 * T * D)
    forward = layers + 2 * T * E * c.vocab_size
    memory = 2 * H * T * 512 * D + 2 * 2 * H * T * K * D
    assert row["score_floor_ratio"] == pytest.approx((forward + memory) / forward)
    assert "memorize tok/s" in capsys.readouterr().out


def test_benchmark_rejects_bad_sizes_with_exit_code_2(capsys):
    for flags in (
        ["--memory-sizes", "100"],
        ["--memory-sizes", "a,b"],
        ["--timed-steps", "0"],
        ["--rounds", "-1"],
        ["--search", "--rounds", "3"],
        ["--compile-jobs", "0"],
        ["--search", "--compile-jobs", "2"],
        ["--memorize", "--memory-sizes", "0"],
        ["--memorize", "--search"],
        ["--memorize", "--rounds", "2"],
        ["--memory-sizes", "0,512,0"],
    ):  # (a repeated size was timed twice; --profile wrote its files over)
        code = benchmark.main(flags)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (flags, err)


def test_peer_side_by_side_takes_each_ratio_within_a_repeat_and_gives_the_median_over_repeats(
    tmp_path, capsys
):
    import numpy as np

    sizes = [0, 8192]
    # Step times per repeat: the second repeat is a slow minute for ours, the third for theirs.
    ours_s = [{0: 0.20, 8192: 0.30}, {0: 0.40, 8192: 0.70}, {0: 0.21, 8192: 0.33}]
    theirs_s = [{0: 0.25, 8192: 0.40}, {0: 0.26, 8192: 0.41}, {0: 0.50, 8192: 0.90}]
    ours_runs = [
        {m: {"memory_size": m, "step_s": run[m], "recall": None if m == 0 else 0.97} for m in sizes}
        for run in ours_s
    ]
    theirs_runs = [
        {m: {"memory_size": m, "step_s": run[m], "recall": None if m == 0 else 0.6} for m in sizes}
        for run in theirs_s
    ]
    rows = benchmark.side_by_side(ours_runs, theirs_runs, sizes)
    for row, m in zip(rows, sizes):
        over = [ours_s[i][m] / theirs_s[i][m] for i in range(3)]
        assert row["memory_size"] == m
        assert row["ours_over_theirs_by_repeat"] == over
        assert row["ours_over_theirs"] == np.median(over)
        assert (row["ours_over_theirs_min"], row["ours_over_theirs_max"]) == (min(over), max(over))
        assert row["ours_step_s"] == np.median([run[m] for run in ours_s])
        assert row["theirs_step_s"] == np.median([run[m] for run in theirs_s])
        assert row["ours_ratio"] == np.median([run[m] / run[0] for run in ours_s])
        assert row["theirs_ratio"] == np.median([run[m] / run[0] for run in theirs_s])
        assert row["ours_recall"] == (None if m == 0 else 0.97) and row["theirs_recall"] == (
            None if m == 0 else 0.6
        )
    # Within a repeat, not across: the ratio of the medians would be another number here.
    median_of_ratios = rows[1]["ours_over_theirs"]
    ratio_of_medians = np.median([r[8192] for r in ours_s]) / np.median([r[8192] for r in theirs_s])
    assert abs(median_of_ratios - ratio_of_medians) > 0.01

    # The peer skipped (not installed): its columns are empty, ours are as before.
    skipped = benchmark.side_by_side(ours_runs, [{}, {}, {}], sizes)
    for row, full in zip(skipped, rows):
        assert (
            row["theirs_step_s"]
            is row["theirs_ratio"]
            is row["theirs_recall"]
            is row["ours_over_theirs"]
            is None
        )
        assert row["ours_step_s"] == full["ours_step_s"] and row["ours_ratio"] == full["ours_ratio"]

    for flags, error in (
        (["--repeats", "0"], "argument --repeats: must be positive, got 0"),
        (["--repeats", "2"], "--repeats goes with --peer."),
        (["--peer", "/no/such/python"], "--peer /no/such/python is not a program that can be run."),
        (["--peer", "python3", "--preset", "synthetic"], "--peer times the tiny preset's step"),
        (["--peer", "python3", "--rounds", "3"], "cannot be combined with --rounds"),
        (["--peer", "python3", "--memory-sizes", "0,8192,0"], "--memory-sizes names a size twice"),
        (
            ["--peer", "python3", "--memory-sizes", "0,100"],
            "--memory-sizes 100: memory_size (100) must be a multiple of",
        ),
    ):
        code = benchmark.main(flags)  # refused before anything runs, and before "peer: skipped"
        out, err = capsys.readouterr()
        assert (
            code == 2
            and err.startswith("error: ")
            and error in err
            and err.count("\n") == 1
            and out == ""
        ), err


def test_the_peer_script_answers_bad_arguments_and_a_missing_peer_in_one_line():
    """peer_benchmark.py runs in the peer's Python; here in ours, where torch is not installed."""
    for args, code, said in (
        ([], 2, "usage: PYTHON peer_benchmark.py M STEPS"),
        (["8192"], 2, "usage:"),
        (["0", "x"], 2, "usage:"),
        (["--check"], 1, "docs/performance.md's 'Against the PyTorch peer'"),
    ):
        proc = subprocess.run(
            [sys.executable, "peer_benchmark.py", *args],
            cwd=HERE,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=""),
        )
        if code == 1 and proc.returncode == 0:
            pytest.skip("this Python can import the peer")
        assert proc.returncode == code and said in proc.stderr and proc.stderr.count("\n") == 1, (
            args,
            proc.stderr,
        )
        assert proc.stdout == "" and "Traceback" not in proc.stderr

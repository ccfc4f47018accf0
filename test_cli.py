"""The command lines under careless and unlucky use.

A property-based probe drives every subcommand of train.py, evaluate.py, sample.py and benchmark.py
with generated bad flags, outputs that name a run's, a corpus's or a cache's files, generated broken
run directories (config.json with a field retyped among them), broken caches, and a
closed stdout or stderr, and asserts what the README promises: exit code 2, one line on stderr, no
traceback, and every file that existed before byte-identical afterwards (a broken cache file
rebuilt, with a line saying so). Then one test per kind of failure the probes found. The
interruptions are in test_interrupts.py, a run's files and caches in test_run_files.py. The fixtures
`cache` and `finished_run` (a finished FAST run) are conftest.py's.
"""

import contextlib
import csv
import dataclasses
import errno
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import benchmark
import cli
import corpora
import data
import evaluate
import memorize
import presets
import runs
import sample
import train
from conftest import child_env
from test_evaluate import table_of_two_seeds  # noqa: F401  (a fixture that trains the table's runs)
from test_train import FAST, HERE, TINY_FAST

SCRIPTS = {
    "train": train.main,
    "evaluate": evaluate.main,
    "benchmark": benchmark.main,
    "sample": sample.main,
    "memorize": memorize.main,
}


def snapshot(*roots):
    """Every file and directory under roots: path -> (mode, bytes or None for a directory)."""
    found = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            found[dirpath] = (stat.S_IMODE(os.lstat(dirpath).st_mode), None)
            for f in files:
                p = os.path.join(dirpath, f)
                if os.path.islink(p):
                    found[p] = (0, os.fsencode(os.readlink(p)))
                else:
                    with open(p, "rb") as fh:
                        found[p] = (stat.S_IMODE(os.stat(p).st_mode), fh.read())
    return found


def call(script, argv, capsys):
    """Run a script's main() in this process: (exit code, stdout, stderr)."""
    code = SCRIPTS[script](argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code, err, argv):
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.startswith("error: "), (argv, err)
    assert "Traceback" not in err, (argv, err)


# ----------------------------------------------------------------------------- the property
# Each fault is (commands it applies to, what it does). A flag fault is a list of argv words
# (a function of the workspace); a file fault breaks a file of the copied run. Every fault
# alone must make the command refuse: the probe combines one to three of them.
def _ws(path):
    return lambda ws: [str(ws / path) if isinstance(path, str) else path]


NUMBER_FLAGS_TRAIN = [
    "--steps",
    "--batch-size",
    "--segment-length",
    "--memory-size",
    "--num-neighbors",
    "--lr",
    "--warmup-steps",
    "--seed",
    "--eval-docs",
    "--eval-tokens",
    "--log-every",
    "--save-every",
    "--valid-fraction",
    "--init-prev-token-bias",
    "--vocab-size",
    "--d-model",
    "--grad-accum",
    "--min-doc-tokens",
    "--eval-every",
]
not_a_number = st.from_regex(r"[a-df-zA-Z_%@][a-zA-Z0-9_.%@-]{0,8}", fullmatch=True)
huge_memory = st.integers(2**26, 2**36).map(
    lambda x: str(64 * x)
)  # a multiple of FAST's 64, far too big


def train_faults():
    """Flag faults of a fresh train.py run (FAST, --out WS/new)."""
    plain = [
        ["--lr", "nan"],
        ["--lr", "inf"],
        ["--lr", "-1"],
        ["--lr", "0"],
        ["--init-prev-token-bias", "nan"],
        ["--init-prev-token-bias", "-inf"],
        ["--valid-fraction", "nan"],
        ["--valid-fraction", "inf"],
        ["--valid-fraction", "0"],
        ["--valid-fraction", "1"],
        ["--valid-fraction", "-0.5"],
        ["--steps", "0"],
        ["--steps", "-5"],
        ["--batch-size", "0"],
        ["--batch-size", "1000"],
        ["--memory-size", "100"],
        ["--memory-size", "-64"],
        ["--num-neighbors", "0"],
        ["--num-neighbors", "100000"],
        ["--segment-length", "0"],
        ["--segment-length", "100000"],
        ["--memory-layers", "9"],
        ["--memory-layers", "a"],
        ["--memory-layers", "1,1"],
        ["--eval-docs", "0"],
        ["--eval-tokens", "-3"],
        ["--log-every", "0"],
        ["--save-every", "-1"],
        ["--seed", "-1"],
        ["--seed", str(2**40)],
        ["--data", "/no/such/corpus"],
        ["--data", "synthetic:0"],
        ["--data", "synthetic:x"],
        ["--data-format", "bogus"],
        ["--suffixes", ".py"],
        ["--suffixes", ",,"],
        ["--preset", "nope"],
        ["--tokenizer", "/no/such.model"],
        ["--resume"],
        ["--init-from", "/no/such/run"],
        ["--vocab-size", "10"],
        ["--grad-accum", "3"],
        ["--d-model", "100"],
        ["--dtype", "float16"],
        ["--no-such-flag"],
        ["--min-doc-tokens", "100000"],
        ["--eval-every", "-1"],
        ["--tokenizer", ""],
        ["--init-from", ""],
        ["--cache-dir", ""],
        ["--data", ""],
        ["--out", ""],
    ]
    workspace = [
        lambda ws: ["--out", str(ws / "run")],  # an existing run, without --resume
        lambda ws: ["--out", str(ws / "run"), "--tokenizer", str(ws / "run" / "tokenizer.model")],
        lambda ws: [
            "--out",
            str(ws / "run"),
            "--init-from",
            str(ws / "link"),
        ],  # a symlink to the run itself
        lambda ws: ["--out", str(ws / "afile")],
        lambda ws: ["--out", str(ws / "afile" / "sub")],
        lambda ws: ["--cache-dir", str(ws / "afile")],
        lambda ws: ["--tokenizer", str(ws / "afile")],
        lambda ws: ["--data", str(ws / "empty")],
        lambda ws: ["--init-from", str(ws / "empty")],
        lambda ws: ["--resume", "--init-from", str(ws / "run")],
    ]
    return (
        st.sampled_from(plain).map(lambda f: lambda ws: f)
        | st.sampled_from(workspace)
        | st.tuples(st.sampled_from(NUMBER_FLAGS_TRAIN), not_a_number).map(
            lambda f: lambda ws: list(f)
        )
        | huge_memory.map(lambda m: lambda ws: ["--memory-size", m])
    )


def _json_edit(name, edit):
    def fault(run):
        path = run / name
        obj = json.loads(path.read_text())
        edit(obj)
        path.write_text(json.dumps(obj))

    return fault


def _truncate(name, fraction):
    def fault(run):
        raw = (run / name).read_bytes()
        (run / name).write_bytes(raw[: int(len(raw) * fraction)])

    return fault


def _replace(name, content):
    def fault(run):
        (run / name).write_bytes(content)

    return fault


def _remove(name):
    return lambda run: (run / name).unlink()


def _checkpoint_edit(edit):
    """A checkpoint of the right form with a wrong value: edit(arrays, meta) changes them."""

    def fault(run):
        with np.load(run / "checkpoint.npz") as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop("__meta__")).decode())
        edit(arrays, meta)
        blob = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        with open(run / "checkpoint.npz", "wb") as f:
            np.savez(f, __meta__=blob, **arrays)

    return fault


EMBED = "params['embed']"
CHECKPOINT_EDITS = [  # the right shapes, the wrong values
    _checkpoint_edit(lambda a, m: a.update({EMBED: a[EMBED].astype(str)})),
    _checkpoint_edit(lambda a, m: a.update({EMBED: a[EMBED].astype(np.complex64) * 1j})),
    _checkpoint_edit(lambda a, m: a.update({EMBED: np.full_like(a[EMBED], np.nan)})),
    _checkpoint_edit(lambda a, m: m.update(step=-5)),
]
RUN_ARG_EDITS = [
    ("valid_fraction", 5.0),
    ("valid_fraction", -0.5),
    ("eval_docs", 0),
    ("data", None),
    ("data", 3),
    ("valid_fraction", "x"),
    ("valid_fraction", None),
    ("eval_docs", "2"),
    ("eval_tokens", None),
    ("data_format", []),
    ("suffixes", 5),
]
CONFIG_EDITS = [
    ("segment_length", -1),
    ("segment_length", "x"),
    ("num_heads", 0),
    ("memory_size", 100),
    ("memory_layers", None),
    ("memory_layers", [99]),
    ("dtype", "float16"),
    ("d_model", 100),
    ("vocab_size", 64),
]  # vocab 64: fewer than the tokenizer's pieces and the checkpoint's rows
# A field of config.json retyped: each value is of another JSON type than the field's.
RETYPED = {
    bool: ["false", "true", 0, 1, None, []],
    int: ["32", 32.0, 32.5, True, None, [32]],
    float: ["1.0", True, None, {}],
    str: [5, True, ["float32"]],
    tuple: [1, "1", [True], [1.0], None],
}
CONFIG_FIELDS = dataclasses.fields(presets.RunConfig)


def run_file_faults():
    """Breakages of a run directory that every command reading it must refuse."""

    def drop(key, where):
        return _json_edit("config.json", lambda o: o[where].pop(key))

    args_edits = [
        _json_edit("config.json", lambda o, k=k, v=v: o["args"].__setitem__(k, v))
        for k, v in RUN_ARG_EDITS
    ]
    config_edits = [
        _json_edit("config.json", lambda o, k=k, v=v: o["config"].__setitem__(k, v))
        for k, v in CONFIG_EDITS
    ]
    fixed = [
        _json_edit("config.json", lambda o: o.pop("args")),
        _json_edit("config.json", lambda o: o.update(args=None)),
        _json_edit("config.json", lambda o: o.update(config=[])),
        drop("data", "args"),
        drop("valid_fraction", "args"),
        _replace("config.json", b"[1, 2]"),
        _replace("config.json", b""),
        _replace("config.json", b"{" * 100000),
        _remove("config.json"),
        _remove("checkpoint.npz"),
        _replace("checkpoint.npz", b""),
        _replace("checkpoint.npz", b"PK\x03\x04 not a zip"),
        _remove("tokenizer.model"),
        _replace("tokenizer.model", b"not a model"),
        _replace("tokenizer.model", b""),
    ]
    truncations = st.tuples(
        st.sampled_from(["config.json", "checkpoint.npz", "tokenizer.model"]), st.floats(0.0, 0.95)
    ).map(lambda t: _truncate(*t))
    retyped = st.sampled_from(CONFIG_FIELDS).flatmap(
        lambda f: st.sampled_from(
            [v for v in RETYPED[f.type] if not (v is None and f.default is None)]
        ).map(
            lambda v, name=f.name: _json_edit(
                "config.json", lambda o: o["config"].__setitem__(name, v)
            )
        )
    )
    faults = fixed + args_edits + config_edits + CHECKPOINT_EDITS
    return st.sampled_from(faults) | truncations | retyped


def evaluate_faults(command):
    """Flag faults of an evaluate.py subcommand on the copied run."""
    plain = {
        "perplexity": [
            ["--memory-size", "100"],
            ["--memory-size", "-1"],
            ["--eval-docs", "0"],
            ["--eval-tokens", "x"],
            ["--data-format", "bogus"],
            ["--data", "/no/such"],
            ["--json", ""],
        ],
        "compare": [
            ["--memory-sizes", "64"],
            ["--memory-sizes", "a,b"],
            ["--memory-sizes", "1,2,3"],
            ["--memory-sizes", "100,0"],
            ["--doc", "99"],
            ["--doc", "-1"],
            ["--max-tokens", "-1"],
        ],
        "inspect": [
            ["--doc", "99"],
            ["--top", "0"],
            ["--max-tokens", "-5"],
            ["--data", "/no/such"],
        ],
        "recall": [
            ["--memory-size", "100"],
            ["--dtype", "float16"],
            ["--doc", "99"],
            ["--max-tokens", "20"],
        ],
        "explore": [
            ["--doc", "99"],
            ["--memories", "0"],
            ["--max-tokens", "-1"],
            ["--data-format", "nope"],
        ],
        "sample": [
            ["--tokens", "0"],
            ["--temperature", "-1"],
            ["--temperature", "nan"],
            ["--top-k", "0"],
            ["--memory-size", "100"],
            ["--prompt-doc", "99"],
            ["--prompt-tokens", "5"],
            ["--prompt", ""],
            ["--draw-seed", "-2"],
            ["--prompt-file", "/no/such/file"],
        ],
        "reach": [
            ["--distances", "x"],
            ["--distances", "0,1024"],
            ["--memory-sizes", "64,100"],
            ["--docs", "0"],
            ["--distances", "64,128,64"],
            ["--memory-sizes", "64,64"],
            ["--memory-sizes", str(64 * 2**34)],
            ["--probe-seed", "-1"],
        ],
        "finetune": [
            ["--pretrain-steps", "0"],
            ["--finetune-steps", "x"],
            ["--preset", "huge"],
            ["--memory-size", "100"],
            ["--eval-docs", "0"],
            ["--segment-length", "100000"],
            ["--batch-size", "-3"],
        ],
        "table": [
            ["--rows", "bogus"],
            ["--segment-length", "100000"],
            ["--steps", "0"],
            ["--batch-size", "0"],
            ["--num-neighbors", "100000"],
        ],
    }[command]
    workspace = {
        "perplexity": [
            lambda ws: ["--json", str(ws)],
            lambda ws: ["--json", str(ws / "no" / "dir.json")],
            lambda ws: ["--json", str(ws / "afile" / "x.json")],
        ]
        + output_faults("--json"),
        "compare": [lambda ws: ["--csv", str(ws)], lambda ws: ["--plot", str(ws / "no" / "p.png")]]
        + output_faults("--csv")
        + output_faults("--plot"),
        "inspect": [lambda ws: ["--data", str(ws / "empty")]],
        "recall": [lambda ws: ["--json", str(ws)]] + output_faults("--json"),
        "explore": [
            lambda ws: ["--html", str(ws)],
            lambda ws: ["--html", str(ws / "afile" / "p.html")],
        ]
        + output_faults("--html"),
        "sample": [
            lambda ws: ["--prompt-file", str(ws)],
            lambda ws: ["--prompt-file", str(ws / "afile"), "--prompt-doc", "0"],
        ],
        "reach": [lambda ws: ["--json", str(ws)], lambda ws: ["--json", str(ws / "no" / "r.json")]]
        + output_faults("--json"),
        "finetune": [
            lambda ws: ["--out-root", str(ws / "afile")],
            lambda ws: ["--cache-dir", str(ws / "afile")],
        ],
        "table": [
            lambda ws: ["--out-root", str(ws / "afile")],
            lambda ws: ["--cache-dir", str(ws / "afile")],
        ],
    }[command]
    sized = ["--memory-size"] if command in ("perplexity", "recall", "sample") else []
    return (
        st.sampled_from(plain).map(lambda f: lambda ws: f)
        | st.sampled_from(workspace)
        | (huge_memory.map(lambda m: lambda ws: ["--memory-size", m]) if sized else st.nothing())
    )


def benchmark_faults():
    plain = [
        ["--memory-sizes", "100"],
        ["--memory-sizes", "a,b"],
        ["--memory-sizes", ","],
        ["--memory-sizes", "-128"],
        ["--timed-steps", "0"],
        ["--batch-size", "-1"],
        ["--preset", "nope"],
        ["--dtype", "float16"],
        ["--memory-sizes", "0,17179869184"],
        ["--search", "--train-only"],
        ["--search", "--memory-sizes", "0"],
        ["--rounds", "-2"],
        ["--search", "--rounds", "2"],
        ["--compile-jobs", "-1"],
        ["--search", "--compile-jobs", "3"],
        ["--json", ""],
        ["--profile", ""],
    ]
    workspace = [
        lambda ws: ["--json", str(ws)],
        lambda ws: ["--json", str(ws / "no" / "x.json")],
        lambda ws: ["--profile", str(ws / "afile")],
    ] + output_faults("--json", reads=False)
    return st.sampled_from(plain).map(lambda f: lambda ws: f) | st.sampled_from(workspace)


STEPS = {"table": "--steps", "finetune": "--pretrain-steps"}  # the runs' steps


def output_faults(flag, reads=True):
    """An output flag naming a file of the run (also through a link to it); for a command that reads
    a run (`reads`), also one inside its cache (ws/cachelink) or a corpus it reads (ws/texts,
    --data)."""
    faults = [lambda ws, name=name: [flag, str(ws / "run" / name)] for name in runs.RUN_FILES]
    faults += [lambda ws: [flag, str(ws / "link" / "eval.json")]]
    if reads:
        faults += [lambda ws: [flag, str(ws / "cachelink" / "out")]]
        faults += [
            lambda ws: ["--data", str(ws / "texts"), flag, str(ws / "texts" / "a.txt")],
            lambda ws: ["--data", str(ws / "texts"), flag, str(ws / "texts" / "new.txt")],
        ]
    return faults


ODD_CONTENTS = [
    b"",
    b"  \n\t\n",
    b"\x00\x01binary",
    b"\xff\xfe not UTF-8",
    b"x = 1\n" * 40,
    b"import a\nimport b\n",
    '{"text": "\\ud800"}\n{"text": "fine text"}\n'.encode(),
    b'{"text": ' + b"[" * 100000 + b"\n",
    b'{"text": 5}\n[1]\n{"no": "text"}\n',
    "théorie « x »\n".encode() * 20,
]
ODD_NAMES = [
    "a.py",
    "b.txt",
    "c.jsonl",
    "README",
    "ü.py",
    "sp ace.txt",
    ".hidden.py",
    "__pycache__",
    b"caf\xe9.py",
    "theory.thy",
]


@st.composite
def odd_corpora(draw):
    """A directory of odd files: binary, not UTF-8, empty, lone surrogates and deep nesting in
    JSONL, non-UTF-8 names, symlink loops and links to nowhere, nested directories."""
    entries = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["file", "file", "dir", "loop", "dangling"]),
                st.sampled_from(ODD_NAMES),
                st.sampled_from(ODD_CONTENTS) | st.binary(max_size=64),
            ),
            max_size=6,
        )
    )

    def build(root):
        os.makedirs(root)
        for i, (kind, name, content) in enumerate(entries):
            name = os.fsencode(name) if isinstance(name, str) else name
            folder = (
                os.path.join(os.fsencode(root), b"d%d" % i) if kind == "dir" else os.fsencode(root)
            )
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, name)
            if os.path.lexists(path):
                continue
            if kind == "loop":
                os.symlink(path, path)
            elif kind == "dangling":
                os.symlink(b"/no/such/target", path)
            else:
                with open(path, "wb") as f:
                    f.write(content)

    return build


@st.composite
def probes(draw):
    """(script, argv as a function of the workspace, run-file faults)."""
    command = draw(
        st.sampled_from(
            [
                "train",
                "train on odd files",
                "train --resume",
                "train on a broken cache",
                "perplexity",
                "compare",
                "inspect",
                "explore",
                "recall",
                "reach",
                "table",
                "finetune",
                "sample",
                "benchmark",
            ]
        )
    )
    if (
        command == "train on a broken cache"
    ):  # read (and rebuilt, with a line), then refused after tokenizing
        name, fraction = (
            draw(
                st.sampled_from(["tokens-*-train.npz", "tokens-*-valid.npz", "tokenizer-*.model"])
            ),
            draw(st.floats(0.0, 0.95)),
        )
        return (
            "train",
            lambda ws: (
                FAST
                + [
                    "--out",
                    str(ws / "new"),
                    "--cache-dir",
                    str(ws / "cache"),
                    "--min-doc-tokens",
                    "100000",
                ]
            ),
            [("cache", name, fraction)],
        )
    if command == "train":
        flags = draw(st.lists(train_faults(), min_size=1, max_size=3))
        return (
            "train",
            lambda ws: FAST + ["--out", str(ws / "new")] + sum((f(ws) for f in flags), []),
            [],
        )
    if (
        command == "train on odd files"
    ):  # read, skipped and counted, or refused; then more rows than documents
        corpus, fmt = (
            draw(odd_corpora()),
            draw(st.sampled_from(["auto", "repo", "repo-deps", "text", "jsonl"])),
        )
        return (
            "train",
            lambda ws: (
                FAST
                + [
                    "--out",
                    str(ws / "new"),
                    "--data",
                    str(ws / "corpus"),
                    "--data-format",
                    fmt,
                    "--batch-size",
                    "1000",
                ]
            ),
            [lambda run: corpus(run.parent / "corpus")],
        )
    if command == "train --resume":  # a broken run, or a --steps behind its checkpoint
        files = draw(st.lists(run_file_faults(), max_size=2))
        steps = ["--steps", "1"] if not files else draw(st.sampled_from([[], ["--steps", "5"]]))
        return "train", lambda ws: FAST + ["--out", str(ws / "run"), "--resume"] + steps, files
    if command == "benchmark":
        flags = draw(st.lists(benchmark_faults(), min_size=1, max_size=2))
        return "benchmark", lambda ws: sum((f(ws) for f in flags), []), []
    need = {
        "compare": lambda ws: ["--memory-sizes", "0,64", "--csv", str(ws / "out.csv")],
        "explore": lambda ws: ["--html", str(ws / "page.html")],
        "sample": lambda ws: ["--prompt", "KALO", "--tokens", "3"],
    }.get(command, lambda ws: [])
    if command in ("table", "finetune"):
        flags = draw(st.lists(evaluate_faults(command), min_size=1, max_size=2))
        return (
            "evaluate",
            lambda ws: (
                [command, "--data", "synthetic:40", STEPS[command], "2"]
                + ["--out-root", str(ws / command)]
                + sum((f(ws) for f in flags), [])
            ),
            [],
        )
    files = draw(st.lists(run_file_faults(), max_size=2))
    flags = draw(st.lists(evaluate_faults(command), min_size=0 if files else 1, max_size=2))
    if command == "sample":
        return (
            "sample",
            lambda ws: [str(ws / "run")] + need(ws) + sum((f(ws) for f in flags), []),
            files,
        )
    return (
        "evaluate",
        lambda ws: [command, str(ws / "run")] + need(ws) + sum((f(ws) for f in flags), []),
        files,
    )


@contextlib.contextmanager
def closed(stream):
    """The command run as if started with `stream` closed (`>&-`): Python's sys.stdout or sys.stderr
    is None then; and its exit (cli.exit_with) with os._exit raising SystemExit instead."""

    def exit_(code):
        raise SystemExit(code)

    saved, real_exit = (getattr(sys, stream) if stream else None), os._exit
    if stream:
        setattr(sys, stream, None)
    os._exit = exit_
    try:
        yield
    finally:
        os._exit = real_exit
        if stream:
            setattr(sys, stream, saved)


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(probe=probes(), stream=st.sampled_from([None, None, None, "stdout", "stderr"]))
def test_any_bad_flag_or_broken_run_is_refused_in_one_sentence_and_changes_no_file(
    tmp_path_factory, finished_run, cache, capsys, probe, stream
):
    script, argv, file_faults = probe
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(finished_run, ws / "run")
    (ws / "empty").mkdir()
    (ws / "afile").write_text("a file where a directory or a model should be")
    os.symlink(ws / "run", ws / "link")
    os.symlink(cache, ws / "cachelink")
    (ws / "texts").mkdir()  # a corpus that a command may read (--data)
    for name in ("a.txt", "b.txt"):
        (ws / "texts" / name).write_text(f"the document {name}\n" * 30)
    broken = []  # (a cache file broken on purpose: it may be rebuilt)
    for fault in file_faults:
        if isinstance(fault, tuple):
            shutil.copytree(
                cache, ws / "cache", ignore=shutil.ignore_patterns("jax"), dirs_exist_ok=True
            )
            # The file the run reads: its tokenizer, or tokens named by its hash (other probes
            # leave the shared cache files of other corpora and splits).
            used = data.file_hash(str(finished_run / "tokenizer.model"))
            files = sorted((ws / "cache").glob(fault[1]))
            broken += [p for p in files if used in p.name or data.file_hash(str(p)) == used]
            _truncate(broken[-1].name, fault[2])(ws / "cache")
            continue
        try:
            fault(ws / "run")
        except (FileNotFoundError, json.JSONDecodeError, KeyError, AttributeError, TypeError):
            pass  # a second fault on a file the first one removed or broke
    argv = argv(ws)
    if script == "train":
        argv = [a for a in argv] + (["--cache-dir", cache] if "--cache-dir" not in argv else [])
    before = snapshot(ws, cache)
    t0 = time.time()
    with closed(stream), pytest.raises(SystemExit) as left:
        cli.exit_with(SCRIPTS[script](argv))
    out, err = capsys.readouterr()
    assert left.value.code == 2, (argv, stream, err)
    if stream != "stderr":
        assert_refused(2, err, argv)
    assert "Traceback" not in out + err, (argv, out, err)
    assert time.time() - t0 < 60, argv  # refused before any step was compiled
    after = snapshot(ws, cache)
    changed = [p for p in before if after.get(p) != before[p]]
    created = [p for p in after if p not in before and not p.startswith((cache, str(ws / "cache")))]
    assert not [p for p in changed if p not in map(str, broken)] and not created, (
        argv,
        changed,
        created,
    )
    for path in broken:  # rebuilt, and said so (on stdout, where it is open)
        assert "cannot be read" in out or stream == "stdout", (argv, out)
        assert data.load_tokenizer(str(path)) if path.suffix == ".model" else np.load(path)
    shutil.rmtree(ws)


# ---------------------------------------------------------------------------- data mixed up or lost
def test_the_token_cache_follows_the_validation_split(tmp_path):
    """Issue 14.1: a cache built with one --valid-fraction is not reused for another."""

    def split(fraction, cache):
        args = train.build_parser().parse_args(
            FAST + ["--valid-fraction", fraction, "--cache-dir", str(cache)]
        )
        tokens, valid, _, _, _, _ = data.prepare(
            runs.data_options(args), evaluate.planned_config(args).vocab_size
        )
        return tokens, valid

    docs = corpora.load_documents("synthetic:40", verbose=False)
    n_train = {f: len(data.split_documents(docs, float(f))[0]) for f in ("0.05", "0.5")}
    assert n_train["0.5"] < n_train["0.05"] < 40
    shared = tmp_path / "shared"
    assert len(split("0.05", shared)[0]) == n_train["0.05"]
    for fraction in ("0.5", "0.05"):
        got, fresh = split(fraction, shared), split(fraction, tmp_path / f"fresh{fraction}")
        assert len(got[0]) == len(fresh[0]) == n_train[fraction]
        for a, b in zip(got[0] + got[1], fresh[0] + fresh[1]):
            np.testing.assert_array_equal(a, b)


def test_a_vocabulary_larger_than_the_tokenizer_is_noted(finished_run, tmp_path):
    """SentencePiece stops merging when the corpus has no more to learn: synthetic:40 asked
    for 2048 pieces gives fewer. A run names the unused rows once, in its log on stdout; at
    the size it names, the tokenizer has the same pieces."""
    out = (finished_run.parent / "stdout.txt").read_text()
    sp = data.load_tokenizer(str(finished_run / "tokenizer.model"))
    n = sp.get_piece_size()
    assert (
        n < 2048 == json.loads((finished_run / "config.json").read_text())["config"]["vocab_size"]
    )
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and f"has {n} pieces" in notes[0] and f"{2048 - n} rows" in notes[0], out
    assert f"--vocab-size {n} " in notes[0] and out.index("run ") < out.index("note:") < out.index(
        "step "
    )
    args = train.build_parser().parse_args(
        FAST + ["--cache-dir", str(tmp_path), "--vocab-size", str(n)]
    )
    smaller = data.load_tokenizer(
        data.prepare(runs.data_options(args), evaluate.planned_config(args).vocab_size)[3]
    )
    assert [smaller.id_to_piece(i) for i in range(smaller.get_piece_size())] == [
        sp.id_to_piece(i) for i in range(n)
    ]


def test_an_existing_run_is_never_overwritten_and_a_refused_run_writes_nothing(
    tmp_path, finished_run, cache, capsys
):
    """Issue 14.2 and 14.3: --out on a run without --resume is refused, whatever points at it
    (its own tokenizer, a symlink to it as --init-from); a check that fails after the data
    is read (more rows than documents) leaves no output directory."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    os.symlink(run, tmp_path / "link")
    before = snapshot(tmp_path)
    for extra in (
        [],
        ["--tokenizer", str(run / "tokenizer.model")],
        ["--init-from", str(tmp_path / "link")],
    ):
        code, _, err = call(
            "train", FAST + ["--out", str(run), "--cache-dir", cache] + extra, capsys
        )
        assert_refused(code, err, extra)
        assert "already holds a run" in err
    code, _, err = call(
        "train",
        FAST + ["--out", str(tmp_path / "new"), "--cache-dir", cache, "--batch-size", "1000"],
        capsys,
    )
    assert_refused(code, err, "batch-size")
    assert "fewer than the 1000 batch rows" in err
    assert snapshot(tmp_path) == before  # and no directory "new"


def test_resuming_a_finished_run_does_nothing_and_a_lost_final_evaluation_is_redone_once(
    tmp_path, finished_run, cache, capsys
):
    """Issue 14.4: --resume --steps 0 is refused; --resume of a finished run leaves it as it
    is; if its eval.json was lost (killed during the final evaluation) the evaluation runs
    again and metrics.jsonl keeps one evaluation line for the step."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    code, _, err = call("train", ["--out", str(run), "--resume", "--steps", "0"], capsys)
    assert_refused(code, err, "--steps 0")
    code, out, _ = call("train", ["--out", str(run), "--resume", "--cache-dir", cache], capsys)
    assert code == 0 and "nothing to do" in out
    assert snapshot(run) == before
    final = json.loads((run / "eval.json").read_text())
    (run / "eval.json").unlink()
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 2, "loss": 1.0, "perpl')  # and a line cut off by the kill
    assert call("train", ["--out", str(run), "--resume", "--cache-dir", cache], capsys)[0] == 0
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "eval_loss" in l] == [2]
    assert [l["step"] for l in lines if "loss" in l] == [1, 2]
    assert json.loads((run / "eval.json").read_text())["perplexity"] == pytest.approx(
        final["perplexity"], rel=1e-6
    )


def test_a_resume_on_a_changed_corpus_is_refused_and_on_a_touched_one_continues(
    tmp_path, cache, capsys
):
    """A --resume reads the corpus again. One that had lost documents since the checkpoint ended
    in an IndexError traceback; one whose documents were edited was trained on without a word,
    each row continuing mid-way into another document with the memory of the old one. The
    checkpoint now keeps a fingerprint of its documents' tokens: file times do not count.
    evaluate.py, on the run's own corpus, notes validation documents that changed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(
        corpora.load_documents("synthetic:40", verbose=False)
    ):  # FAST's documents, as files
        (corpus / f"d{i:02d}.txt").write_text(doc.text)
    run, old, touched = tmp_path / "run", tmp_path / "old", tmp_path / "touched"
    assert (
        call(
            "train",
            FAST + ["--data", str(corpus), "--steps", "2", "--out", str(run), "--cache-dir", cache],
            capsys,
        )[0]
        == 0
    )
    shutil.copytree(run, old)  # as a checkpoint from before fingerprints: none in its metadata
    with np.load(old / "checkpoint.npz") as z:
        arrays = dict(z)
    meta = json.loads(arrays.pop("__meta__").tobytes())
    assert meta.pop("documents")
    np.savez(
        old / "checkpoint.npz",
        __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        **arrays,
    )
    shutil.copytree(run, touched)
    later = time.time() + 1000
    for f in corpus.iterdir():
        os.utime(f, (later, later))  # the same documents with other times: resumes
    code, _, err = call(
        "train", ["--out", str(touched), "--resume", "--steps", "3", "--cache-dir", cache], capsys
    )
    assert code == 0, err
    perplexity = ["perplexity", str(run), "--eval-docs", "1", "--eval-tokens", "32"]
    assert call("evaluate", perplexity, capsys)[::2] == (
        0,
        "",
    )  # evaluate: no note on the same documents
    _, valid = data.split_documents(
        corpora.load_documents(str(corpus), verbose=False), 0.05, seed=0
    )
    with open(corpus / valid[-1].id, "a") as f:  # a validation document edited: evaluate says so
        f.write("one more line\n")
    code, _, err = call("evaluate", perplexity, capsys)
    assert (
        code == 0 and err.startswith("note: the validation documents of") and err.count("\n") == 1
    ), err
    with open(corpus / "d05.txt", "a") as f:
        f.write("one more line\n")
    before = snapshot(tmp_path)
    code, _, err = call(
        "train", ["--out", str(run), "--resume", "--steps", "3", "--cache-dir", cache], capsys
    )
    assert_refused(code, err, "edited")
    assert "is not the one the checkpoint in" in err and "--init-from" in err
    assert snapshot(tmp_path) == before
    for f in sorted(corpus.iterdir())[
        5:
    ]:  # five documents left: four to train on, for FAST's four rows
        f.unlink()
    before = snapshot(tmp_path)
    for r, message in (
        (run, "is not the one the checkpoint in"),
        (old, "does not fit the training documents"),
    ):
        code, _, err = call(
            "train", ["--out", str(r), "--resume", "--steps", "3", "--cache-dir", cache], capsys
        )
        assert_refused(code, err, r)
        assert message in err
    assert snapshot(tmp_path) == before


def test_a_run_that_another_train_is_writing_is_refused(
    tmp_path, finished_run, cache, capsys, monkeypatch
):
    """Two train.py on one --out (started twice, or resumed twice) once both wrote the same
    checkpoint and metrics. A run directory is locked (flock) while a train.py writes it; a new
    directory made by another train.py between our checks and our first write is refused too."""
    fcntl = pytest.importorskip("fcntl")
    run, empty = tmp_path / "run", tmp_path / "empty"
    shutil.copytree(finished_run, run)
    empty.mkdir()
    held = [os.open(d, os.O_RDONLY) for d in (run, empty)]  # as the other train.py holds them
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)
    before = snapshot(tmp_path)
    for argv in (["--out", str(run), "--resume", "--steps", "3"], FAST + ["--out", str(empty)]):
        code, _, err = call("train", argv + ["--cache-dir", cache], capsys)
        assert_refused(code, err, argv)
        assert "is in use: another train.py is writing this run" in err
    assert snapshot(tmp_path) == before
    for fd in held:
        os.close(fd)
    code, out, err = call("train", ["--out", str(run), "--resume", "--cache-dir", cache], capsys)
    assert code == 0 and "nothing to do" in out, err
    raced = tmp_path / "raced"
    real = data.prepare

    def racing(
        *args,
    ):  # while our data loads, another train.py makes the directory and starts its run
        result = real(*args)
        raced.mkdir()
        (raced / "config.json").write_text("{}")
        return result

    monkeypatch.setattr(data, "prepare", racing)
    code, _, err = call("train", FAST + ["--out", str(raced), "--cache-dir", cache], capsys)
    assert_refused(code, err, "raced")
    assert "another train.py started meanwhile" in err and os.listdir(raced) == ["config.json"]


# -------------------------------------------------------------------- one sentence, not a traceback
def test_compare_with_a_memory_size_of_zero_and_a_memory_model(finished_run, tmp_path, capsys):
    """Issue 14.5: each memory size gets its own parameters (0 has no gates)."""
    for sizes in ("0,64", "64,0"):
        out = tmp_path / f"{sizes}.csv"
        code, _, err = call(
            "evaluate",
            [
                "compare",
                str(finished_run),
                "--memory-sizes",
                sizes,
                "--csv",
                str(out),
                "--max-tokens",
                "100",
            ],
            capsys,
        )
        assert code == 0, err
        with open(out, newline="") as f:
            assert len(list(csv.reader(f))) == 101


@pytest.mark.parametrize(
    "script, argv",
    [("train", []), ("benchmark", []), ("sample", ["run"])]
    + [("evaluate", [c]) for c in evaluate.build_parser()._subparsers._group_actions[0].choices],
)
def test_help_gives_every_default_and_never_none(capsys, script, argv):
    """--help shows a flag's default where it has one; where it has none (None), the flag's
    own help says what leaving it unset means, rather than "(default: None)"."""
    code, out, _ = call(script, argv[:1] + ["--help"], capsys)
    assert code == 0 and "--" in out
    text = " ".join(out.split())
    assert "(default: None)" not in text
    if script == "train":  # a default other than None is still shown, and unset flags are explained
        assert "(default: 500)" in text and "--preset's value" in text
    if script == "benchmark":
        assert "(default: 0,8192,65536)" in text and "--peer PYTHON" in text


def test_a_negative_number_with_an_exponent_is_a_value_not_a_flag():
    """`--init-gate-bias -1e3` was refused as "expected one argument": Python 3.11's argparse
    took "-1e3" for a flag, as it knows only -3 and -.5 as negative numbers."""
    for value in ("-1e3", "-2.5E-1", "-3", "-.5", "-1e+30"):
        assert train.build_parser().parse_args(["--init-gate-bias", value]).init_gate_bias == float(
            value
        )
        assert evaluate.build_parser().parse_args(
            ["table", "--init-gate-bias", value]
        ).init_gate_bias == float(value)
        assert sample.build_parser().parse_args(
            ["run", "--prompt", "x", "--temperature", value]
        ).temperature == float(value)
    with pytest.raises(SystemExit):  # a flag is still a flag where a value was due
        train.build_parser().parse_args(["--init-gate-bias", "--lr", "1"])


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("train", ["--lr", "nan"], "argument --lr: must be a finite number"),
        (
            "train",
            ["--init-prev-token-bias", "nan"],
            "argument --init-prev-token-bias: must be a finite number",
        ),
        (
            "train",
            ["--valid-fraction", "inf"],
            "argument --valid-fraction: must be a finite number",
        ),
        ("train", ["--valid-fraction", "1"], "must be between 0 and 1"),
        ("train", ["--resume", "--steps", "-5"], "--steps: must be a positive integer, got -5"),
        ("train", ["--memory-size", "17179869184"], "GiB for its parameters, optimizer and memory"),
        ("train", ["--vocab-size", "10"], "cannot train a tokenizer of 10 pieces"),
        ("evaluate", ["table", "--segment-length", "100000"], "GiB for its parameters"),
        ("benchmark", ["--memory-sizes", "0,17179869184"], "GiB for its parameters"),
        # (the size was not named: only the config's words, "memory_size (100) must be ...")
        (
            "benchmark",
            ["--memory-sizes", "0,100"],
            "--memory-sizes 100: memory_size (100) must be a multiple of",
        ),
        (
            "train",
            ["--memory-layers", ","],
            "names no layer",
        ),  # was a memory run without a memory layer
        ("evaluate", ["table", "--rows", ""], "names no row"),  # was every row
        (
            "sample",
            ["--prompt", "\udcff\udcfe"],
            "--prompt is not UTF-8 text",
        ),  # bytes 0xff 0xfe from a shell
    ],
)
def test_flags_that_passed_the_old_checks_are_refused_in_one_sentence(
    tmp_path, finished_run, cache, capsys, script, argv, message
):
    """Issue 14.6, and later probes of the same kind."""
    if script == "train":
        argv = FAST + ["--out", str(tmp_path / "r"), "--cache-dir", cache] + argv
    if script == "evaluate":
        argv = argv + ["--out-root", str(tmp_path / "table")]
    if script == "sample":
        argv = [str(finished_run)] + argv
    before = snapshot(finished_run)
    code, _, err = call(script, argv, capsys)
    assert_refused(code, err, argv)
    assert message in err
    assert os.listdir(tmp_path) == [] and snapshot(finished_run) == before


@pytest.mark.parametrize(
    "script, argv, flag",
    [
        ("train", ["--out", ""], "--out"),
        ("train", ["--init-from", ""], "--init-from"),
        ("train", ["--tokenizer", ""], "--tokenizer"),
        ("train", ["--cache-dir", ""], "--cache-dir"),
        ("train", ["--data", ""], "--data"),
        ("evaluate", ["perplexity", ""], "run_dir"),
        ("evaluate", ["perplexity", "RUN", "--json", ""], "--json"),
        ("evaluate", ["inspect", "RUN", "--data", ""], "--data"),
        ("evaluate", ["compare", "RUN", "--memory-sizes", "0,64", "--csv", ""], "--csv"),
        (
            "evaluate",
            ["compare", "RUN", "--memory-sizes", "0,64", "--csv", "WS/d.csv", "--plot", ""],
            "--plot",
        ),
        ("evaluate", ["explore", "RUN", "--html", ""], "--html"),
        ("evaluate", ["recall", "RUN", "--json", ""], "--json"),
        ("evaluate", ["reach", "RUN", "--json", ""], "--json"),
        ("evaluate", ["finetune", "--out-root", ""], "--out-root"),
        ("evaluate", ["table", "--cache-dir", ""], "--cache-dir"),
        ("sample", ["RUN", "--prompt-file", ""], "--prompt-file"),
        ("sample", ["", "--prompt", "x"], "run_dir"),
        ("benchmark", ["--json", ""], "--json"),
        ("benchmark", ["--profile", ""], "--profile"),
        ("benchmark", ["--peer", ""], "--peer"),
    ],
)
def test_an_empty_path_is_refused_not_taken_as_unset_or_as_the_current_directory(
    tmp_path, finished_run, cache, capsys, monkeypatch, script, argv, flag
):
    """`--out "$DIR"` with DIR unset. train.py took an empty --out, --init-from or --tokenizer as
    not given (a fresh run under runs/, a run from scratch, a new tokenizer); --json "" wrote
    nothing and said nothing; an empty --csv or --out failed after the work with a temporary file's
    name."""
    monkeypatch.chdir(tmp_path)  # anything written to the current directory would show
    argv = [str(finished_run) if a == "RUN" else a.replace("WS", str(tmp_path)) for a in argv]
    if script == "train":
        argv = (
            FAST
            + ["--cache-dir", cache]
            + (argv if "--out" in argv else ["--out", str(tmp_path / "r")] + argv)
        )
    before = snapshot(finished_run)
    code = SCRIPTS[script](argv)
    _, err = capsys.readouterr()
    assert_refused(code, err, argv)
    assert f"argument {flag}: needs a path, got an empty string" in err, err
    assert os.listdir(tmp_path) == [] and snapshot(finished_run) == before


def test_an_empty_mt_cache_is_unset_and_the_default_cache_is_beside_the_scripts(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("MT_CACHE", "")  # the default --cache-dir stays (an empty one is refused)
    monkeypatch.chdir(tmp_path)  # whatever the directory a script is run from
    here = os.path.dirname(os.path.abspath(train.__file__))
    assert train.build_parser().parse_args([]).cache_dir == os.path.join(here, ".cache")
    monkeypatch.setenv("MT_CACHE", "/some/cache")
    assert train.build_parser().parse_args([]).cache_dir == "/some/cache"


def test_fewer_layers_than_the_presets_memory_layer_asks_for_memory_layers(tmp_path, cache, capsys):
    """tiny's memory is in layer 1: `--num-layers 1` alone was refused with "memory layer index
    1 is out of range for 1 layers", a flag the user never gave."""
    for extra in (
        [],
        ["--memory-size", "0"],
    ):  # (a run without memory keeps the layer for a later --memory-size)
        argv = (
            TINY_FAST
            + ["--num-layers", "1", "--out", str(tmp_path / "r"), "--cache-dir", cache]
            + extra
        )
        code, _, err = call("train", argv, capsys)
        assert_refused(code, err, argv)
        assert (
            "the tiny preset's memory layer 1 is out of range for --num-layers 1; give "
            "--memory-layers too" in err
        )
    assert os.listdir(tmp_path) == []


def test_a_run_or_cache_inside_its_own_corpus_is_refused(tmp_path, cache, capsys, monkeypatch):
    """`cd corpus && train.py --data .` put the run in ./runs/<timestamp>, inside the corpus: its
    metrics.jsonl then made the next run, or its own --resume, read the corpus as JSONL ("no
    readable document")."""
    corpus = tmp_path / "corpus"
    for i in range(8):
        (corpus / f"p{i}").mkdir(parents=True)
        (corpus / f"p{i}" / "m.py").write_text(f"x = {i}\n" * 50)
    monkeypatch.chdir(corpus)
    before = snapshot(tmp_path)
    for extra in ([], ["--out", "."], ["--out", str(tmp_path / "r"), "--cache-dir", "cache"]):
        argv = FAST + ["--data", ".", "--cache-dir", cache] + extra
        code, _, err = call("train", argv, capsys)
        assert_refused(code, err, extra)
        assert (
            "is inside the corpus --data .: what the run writes there would be read as part of its "
            "own corpus" in err
        )
    assert snapshot(tmp_path) == before


def test_unusable_paths_are_refused_before_anything_runs(
    tmp_path, finished_run, cache, capsys, monkeypatch
):
    """Issue 14.6: a cache directory that is a file or cannot be written; benchmark --json naming a
    directory, refused before the benchmark runs; a failed benchmark row is one line."""
    (tmp_path / "afile").write_text("x")
    code, _, err = call(
        "train",
        FAST + ["--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "afile")],
        capsys,
    )
    assert_refused(code, err, "cache-dir file")
    locked = str(tmp_path / "locked")
    os.mkdir(locked)
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == locked else real_access(p, mode)
    )
    code, _, err = call(
        "train", FAST + ["--out", str(tmp_path / "r"), "--cache-dir", locked], capsys
    )
    assert_refused(code, err, "cache-dir locked")
    assert "--cache-dir" in err and "not a writable directory" in err
    monkeypatch.setattr(
        benchmark,
        "run_child",
        lambda cmd, env=None: pytest.fail("a row ran before --json was checked"),
    )
    code, _, err = call("benchmark", ["--memory-sizes", "0", "--json", str(tmp_path)], capsys)
    assert_refused(code, err, "--json dir")
    # A directory where no file can be made, though os.access passes it as root: /proc.
    before = snapshot(finished_run)
    for script, argv in (
        ("train", FAST + ["--out", "/proc/mt-run", "--cache-dir", cache]),
        ("train", FAST + ["--out", str(tmp_path / "r"), "--cache-dir", "/proc/mt-cache"]),
        ("benchmark", ["--memory-sizes", "0", "--json", "/proc/mt.json"]),
        ("evaluate", ["perplexity", str(finished_run), "--json", "/proc/mt.json"]),
    ):
        code, _, err = call(script, argv, capsys)
        assert_refused(code, err, argv)
        assert "not a writable directory" in err and "/proc" in err, err
    assert snapshot(finished_run) == before and not (tmp_path / "r").exists()
    monkeypatch.setattr(
        benchmark,
        "run_child",
        lambda cmd, env=None: (
            1,
            "",
            'Traceback (most recent call last):\n  File "x", line 1\nValueError: boom\n',
        ),
    )
    code, _, err = call("benchmark", ["--memory-sizes", "0"], capsys)
    assert (
        code == 1 and err.count("\n") == 1 and "Traceback" not in err and "ValueError: boom" in err
    )


def test_an_output_named_as_a_pipe_is_written_to_it_not_replaced(tmp_path, finished_run, capsys):
    """`--json /dev/stdout` or a named pipe: the output goes into the stream. (A rename over it
    once replaced the pipe with a file, so its reader waited forever; as root, /dev/stdout
    itself would have been replaced.)"""
    got = {}
    for flag, argv in (
        ("--json", ["perplexity", str(finished_run), "--eval-docs", "1", "--eval-tokens", "64"]),
        ("--csv", ["compare", str(finished_run), "--memory-sizes", "0,64", "--max-tokens", "64"]),
    ):
        pipe = tmp_path / f"pipe{flag}"
        os.mkfifo(pipe)
        reader = threading.Thread(
            target=lambda p=pipe, f=flag: got.__setitem__(f, p.read_text()), daemon=True
        )
        reader.start()
        code, _, err = call("evaluate", argv + [flag, str(pipe)], capsys)
        reader.join(timeout=60)
        assert code == 0, err
        assert not reader.is_alive() and stat.S_ISFIFO(os.stat(pipe).st_mode), flag
        assert all(
            name.startswith("pipe") for name in os.listdir(tmp_path)
        )  # no temporary file left
    assert json.loads(got["--json"])["perplexity"] > 1
    assert got["--csv"].splitlines()[0].startswith("index,target,")
    # Text ends in a newline, JSON too (a shell's prompt after `--json /dev/stdout` was on its last
    # line).
    assert got["--json"].endswith("}\n") and got["--csv"].endswith("\n")
    assert all(
        (finished_run / name).read_text().endswith("}\n") for name in ("config.json", "eval.json")
    )


def test_a_full_disk_is_named_in_one_line_and_leaves_the_old_file(
    tmp_path, finished_run, capsys, monkeypatch
):
    """A write that fails for want of space names no file: the line was once `error: No space
    left on device: None` (for a checkpoint that could not be saved, or --json /dev/full)."""
    if os.path.exists(
        "/dev/full"
    ):  # a device that is always full: --json to it is written to, and fails
        code, _, err = call(
            "evaluate",
            [
                "perplexity",
                str(finished_run),
                "--eval-docs",
                "1",
                "--eval-tokens",
                "64",
                "--json",
                "/dev/full",
            ],
            capsys,
        )
        assert (code, err) == (2, "error: No space left on device: /dev/full\n")
    target = tmp_path / "checkpoint.npz"
    target.write_bytes(b"the previous checkpoint")

    def full(f, content):
        f.write(b"half of it")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runs, "_write_content", full)
    assert cli.run_command(lambda args: runs.atomic_write(str(target), b"new"), None) == 2
    assert capsys.readouterr().err == f"error: {os.strerror(errno.ENOSPC)}: {target}\n"
    assert (
        os.listdir(tmp_path) == ["checkpoint.npz"]
        and target.read_bytes() == b"the previous checkpoint"
    )

    def stdout_full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as print() to a full stdout does

    assert cli.run_command(stdout_full, None) == 2
    assert capsys.readouterr().err == f"error: {os.strerror(errno.ENOSPC)}\n"


def test_broken_run_directories_are_refused_in_one_sentence(tmp_path, finished_run, cache, capsys):
    """Issue 14.7: config.json without args or with args null; a tokenizer with more pieces than
    the run's vocabulary (here: the run's config says 64)."""
    run = tmp_path / "run"
    for edit, message in (
        (lambda o: o.pop("args"), "not a valid run config"),
        (lambda o: o.update(args=None), "not a valid run config"),
        (lambda o: o["config"].update(vocab_size=64), "not the run's tokenizer"),
    ):
        shutil.copytree(finished_run, run)
        _json_edit("config.json", edit)(run)
        before = snapshot(run)
        for script, argv in (
            ("train", ["--out", str(run), "--resume", "--cache-dir", cache]),
            ("evaluate", ["perplexity", str(run)]),
        ):
            code, _, err = call(script, argv, capsys)
            assert_refused(code, err, (script, message))
            assert (
                message in err or script == "train"
            )  # train.py meets the resized checkpoint first
        assert snapshot(run) == before
        shutil.rmtree(run)


def test_a_table_row_is_reused_only_if_it_is_this_rows_run_and_whole(
    tmp_path, table_of_two_seeds, capsys
):
    """Issue 14.7: evaluate.py table reuses a row only if its eval.json is whole and of --steps.
    And only if the run is the row's: one of another --segment-length, batch or data was once
    reused (or resumed) without a word and reported as the row asked for. The row: the XL row
    that test_evaluate.py's table trained with the flags below (and --seeds 2), copied."""
    row = tmp_path / "XL_cache"
    shutil.copytree(table_of_two_seeds[1] / "XL_cache", row)
    its_cache = tmp_path / "its_cache"  # the table's own, so that a resume's use of it shows
    argv = [
        "table",
        "--rows",
        "XL cache",
        "--out-root",
        str(tmp_path),
        "--cache-dir",
        str(its_cache),
        "--steps",
        "2",
        "--segment-length",
        "32",
        "--batch-size",
        "4",
        "--num-neighbors",
        "8",
        "--data",
        "synthetic:40",
    ]
    before = snapshot(tmp_path)
    left_out = argv[:-4] + argv[-2:]  # no --num-neighbors: the preset's 32
    assert left_out[-4:] == ["--batch-size", "4", "--data", "synthetic:40"]
    for probe in [
        argv + other
        for other in (
            ["--segment-length", "16"],
            ["--batch-size", "8"],
            ["--data", "synthetic:41"],
            ["--num-neighbors", "4"],
        )
    ] + [left_out]:
        code, _, err = call("evaluate", probe, capsys)
        assert_refused(code, err, probe)
        assert "holds a run of other settings" in err and snapshot(tmp_path) == before, (probe, err)
    # ... nor one of another setting that the table has no flag for (the model's size, ...)
    saved = (row / "config.json").read_bytes()
    other = json.loads(saved)
    other["config"].update(num_layers=4, memory_layers=[2])
    (row / "config.json").write_text(json.dumps(other))
    code, _, err = call("evaluate", argv, capsys)
    assert_refused(code, err, argv)
    assert "holds a run of other settings (--num-layers 2 here, 4 there)" in err
    (row / "config.json").write_bytes(saved)
    assert snapshot(tmp_path) == before
    (row / "eval.json").write_text('{"step": 2, "perplexity": 3')
    code, out, err = call("evaluate", argv, capsys)
    assert code == 0, err
    assert "resuming XL cache" in out
    assert json.loads((row / "eval.json").read_text())["step"] == 2
    assert sorted(p.name.split("-")[0] for p in its_cache.iterdir()) == [
        "tokens",
        "tokens",
    ]  # the run's tokenizer
    assert json.loads((tmp_path / "table.json").read_text())[0]["perplexity"] > 1


def test_unreadable_and_odd_corpus_files_are_skipped_and_counted(tmp_path, capsys, monkeypatch):
    """Issue 14.8: a file name that is not UTF-8, a symlink loop, an unreadable file, a JSONL text
    with a lone surrogate, JSON nested 100,000 deep."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    with open(os.path.join(os.fsencode(repo / "pkg"), b"caf\xe9.py"), "w") as f:
        f.write("y = 2\n")
    os.symlink(repo / "pkg" / "loop.py", repo / "pkg" / "loop.py")
    (repo / "pkg" / "secret.py").write_text("z = 3\n")
    real_open = open
    monkeypatch.setattr(
        corpora,
        "open",
        lambda p, *a, **k: (
            (_ for _ in ()).throw(PermissionError(13, "denied", p))
            if str(p).endswith("secret.py")
            else real_open(p, *a, **k)
        ),
        raising=False,
    )
    docs = corpora.load_documents(str(repo), "repo")
    assert (
        len(docs) == 1
        and "x = 1" in docs[0].text
        and "y = 2" in docs[0].text
        and "z = 3" not in docs[0].text
    )
    assert "# file: pkg/caf\\xe9.py" in docs[0].text
    assert "2 unreadable" in capsys.readouterr().out  # the loop and the locked file
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text('{"text": "fine"}\n{"text": "\\ud800"}\n' + '{"text": ' + "[" * 100000 + "\n")
    docs = corpora.load_documents(str(jsonl))
    assert [d.text for d in docs] == ["fine"]
    assert "2 bad json" in capsys.readouterr().out


# ----------------------------------------------------------------------------- checkpoints
def test_a_checkpoint_is_created_like_any_other_file_and_an_unreadable_one_is_named(
    tmp_path, finished_run, monkeypatch
):
    """Issue 14.10: not mkstemp's 0600."""
    old = os.umask(0o022)
    try:
        meta, arrays = runs.load_checkpoint(str(finished_run / "checkpoint.npz"))
        runs.atomic_write(str(tmp_path / "c.npz"), (finished_run / "checkpoint.npz").read_bytes())
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "c.npz").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(finished_run / "checkpoint.npz").st_mode) == 0o666 & ~old
    monkeypatch.setattr(
        np, "load", lambda p: (_ for _ in ()).throw(PermissionError(13, "denied", p))
    )
    with pytest.raises(cli.UsageError, match="permission denied"):
        runs.load_checkpoint(str(tmp_path / "c.npz"))


@pytest.mark.parametrize(
    "fault, want",
    [
        (CHECKPOINT_EDITS[0], "of dtype <U"),
        (CHECKPOINT_EDITS[1], "of dtype complex64"),
        (CHECKPOINT_EDITS[2], "non-finite values in params['embed']"),
        (CHECKPOINT_EDITS[3], "is truncated or corrupt"),
        (_json_edit("config.json", lambda o: o["args"].update(valid_fraction=5.0)), "between 0"),
        (_json_edit("config.json", lambda o: o["args"].update(valid_fraction=-0.5)), "between 0"),
    ],
    ids=["string", "complex", "nan", "step -5", "fraction 5", "fraction -0.5"],
)
def test_a_run_file_of_the_right_form_with_a_wrong_value_is_refused_by_every_reader(
    tmp_path, finished_run, cache, capsys, fault, want
):
    """A checkpoint array of the right shape but another dtype (a string, a complex number),
    weights that are NaN, a negative step, a flag's copy in config.json out of the flag's range:
    evaluate.py, sample.py and train.py --resume each refuse it in one sentence with exit code 2,
    and no file changes (a resume from step -5 once cut metrics.jsonl to nothing)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    fault(run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    commands = [
        (evaluate.main, ["perplexity", str(run), "--eval-tokens", "64"]),
        (sample.main, [str(run), "--prompt", "a", "--tokens", "2"]),
        (train.main, FAST + ["--out", str(run), "--resume", "--steps", "5", "--cache-dir", cache]),
    ]
    for main, argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert want in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def _cache_edit(pattern, edit):
    def fault(cache_dir):
        (path,) = [p for p in cache_dir.glob(pattern)]
        edit(path)

    return fault


def _tokens_edit(change):
    def edit(path):
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        change(arrays)
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    return edit


def _directory_in_place(path):
    path.unlink()
    (path / "inside").mkdir(parents=True)


@pytest.mark.parametrize(
    "pattern, edit",
    [
        ("tokens-*-train.npz", _tokens_edit(lambda a: a["tokens"].__setitem__(0, 10**6))),
        ("tokens-*-train.npz", _tokens_edit(lambda a: a.update(offsets=a["offsets"][::-1]))),
        ("tokenizer-*.model", _directory_in_place),
    ],
    ids=["token id 10^6", "offsets reversed", "tokenizer a directory"],
)
def test_a_cache_file_of_the_right_form_with_wrong_values_is_rebuilt(
    tmp_path, capsys, pattern, edit
):
    """A cached token file that is a valid npz with an id past the vocabulary, or its offsets
    reversed, and a cached tokenizer that a directory has replaced: the run says the cache
    cannot be read, rebuilds it, and trains (it once ended in a traceback after writing its
    run files, or was refused naming a temporary file)."""
    cache = tmp_path / "cache"
    argv = FAST + ["--steps", "1", "--eval-every", "0", "--cache-dir", str(cache)]
    assert train.main(argv + ["--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    edit(next(cache.glob(pattern)))
    assert train.main(argv + ["--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "note: the " in out and ("cannot be read" in out or "not a file" in out), out
    assert data.load_tokenizer(str(next(cache.glob("tokenizer-*.model"))))


def test_xla_flags_that_hold_no_flag_are_refused_in_one_sentence(tmp_path):
    """XLA_FLAGS=garbage once ended every script with exit 1 and XLA's own log line."""
    env = child_env(XLA_FLAGS="garbage --xla_cpu_use_fusion_emitters=false")
    argv = [sys.executable, "train.py", *FAST, "--steps", "1", "--out", str(tmp_path / "run")]
    proc = subprocess.run(argv, cwd=HERE, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "XLA_FLAGS holds 'garbage'" in proc.stderr and not (tmp_path / "run").exists()


def test_a_first_checkpoint_that_cannot_be_written_leaves_no_run_behind(
    tmp_path, monkeypatch, capsys
):
    """On a full disk the run failed at its first checkpoint and left config.json,
    metrics.jsonl and tokenizer.model, which the next --resume refused; now one sentence, exit
    code 2, and the directory as it was. A cache file that cannot be written is named."""
    import errno

    def full(path, *_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(runs, "save_checkpoint", full)
    out = tmp_path / "run"
    out.mkdir()
    argv = FAST + ["--steps", "2", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot write the checkpoint" in err and "No space left" in err and err.count("\n") == 1
    assert list(out.iterdir()) == []
    monkeypatch.setattr(data.np, "savez", lambda f, **_: full(None))
    assert (
        train.main(FAST + ["--out", str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c2")]) == 2
    )
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(tmp_path / "c2") in err, err


def test_the_runs_first_line_gives_the_share_of_tokens_held_out(finished_run):
    out = (finished_run.parent / "stdout.txt").read_text()
    line = next(line for line in out.splitlines() if line.startswith("run "))
    share = re.search(r"held-out documents \((\d+\.\d)% of the tokens\)", line)
    assert share and 0 < float(share.group(1)) < 20, line


def test_every_config_field_is_a_train_flag_with_its_help_and_rule_and_a_resume_check():
    """A knob is written once, in Config (or RunConfig), with its default, rule and help: it is a
    train.py flag with that help, whose values the rule refuses in one sentence, and a flag that
    --resume refuses to change, with no other file naming it."""
    parser = train.build_parser()
    tiny = presets.PRESETS["tiny"]
    saved = {"config": tiny, "args": {"data": "stdlib"}}
    for field in dataclasses.fields(presets.RunConfig):
        flag = "--" + field.name.replace("_", "-")
        action = parser._option_string_actions[flag]
        assert " ".join(field.metadata["help"].split()) in action.help, flag
        value = getattr(tiny, field.name)
        if field.type is bool:
            argv = [flag if not value else "--no-" + flag[2:]]
        elif field.metadata["rule"].choices:
            others = [c for c in field.metadata["rule"].choices if c not in (value, None)]
            argv = [flag, others[-1]]  # (memory_dtype's None reads as dtype's float32)
        elif field.type is tuple:
            argv = [flag, "0"]
        else:
            argv = [flag, str(value + 1 if field.type is int else value / 2 + 0.25)]
        args = parser.parse_args(argv)
        conflict = runs.resume_conflict(args, saved, "out", {field.name})
        if field.name in runs.RESUME_MAY_CHANGE:
            assert conflict is None, flag
        else:
            assert conflict and conflict[0].startswith(argv[0]), (flag, conflict)
        if field.type in (int, float) and field.metadata["rule"](-7):  # refused: its sentence
            with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
                parser.parse_args([flag, "-7"])
            assert field.metadata["rule"](-7) in err.getvalue(), (flag, err.getvalue())

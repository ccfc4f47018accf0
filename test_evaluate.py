"""evaluate.py: its eight subcommands (perplexity, compare, inspect, explore, recall, reach,
finetune, table) on tiny models trained for a few steps."""

import argparse
import csv
import json
import math
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cli
import corpora
import data
import evaluate
import evaluation
import memorizing_transformer as mt
import presets
import runs
import train
from conftest import child_env
from test_train import FAST, HERE  # the same small runs, so compiled steps are shared


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cache = str(tmp_path_factory.mktemp("cache"))
    assert train.main(FAST + ["--steps", "3", "--out", str(out), "--cache-dir", cache]) == 0
    return str(out)


def test_perplexity_reports_memory_on_and_off_and_a_larger_memory(run_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        evaluate.main(
            ["perplexity", run_dir, "--eval-docs", "1", "--eval-tokens", "96", "--json", str(out)]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["memory_size"] == 64 and r["tokens"] == 96
    assert r["perplexity"] == pytest.approx(math.exp(r["loss"])) and "perplexity_memory_off" in r
    # Synthetic data marks the referenced values: their loss is reported apart, on and off.
    assert r["reference_loss"] > 0 and r["reference_loss_memory_off"] > 0
    assert "memory off" in capsys.readouterr().out
    assert (
        evaluate.main(
            [
                "perplexity",
                run_dir,
                "--memory-size",
                "256",
                "--eval-docs",
                "1",
                "--eval-tokens",
                "96",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["memory_size"] == 256
    assert evaluate.main(["perplexity", run_dir, "--memory-size", "100"]) == 2
    assert "multiple of segment_length" in capsys.readouterr().err


def test_perplexity_matches_the_training_runs_final_evaluation(run_dir, tmp_path):
    out = tmp_path / "p.json"
    assert (
        evaluate.main(
            ["perplexity", run_dir, "--eval-docs", "2", "--eval-tokens", "64", "--json", str(out)]
        )
        == 0
    )
    with open(f"{run_dir}/eval.json") as f:
        ev = json.load(f)
    r = json.loads(out.read_text())
    assert r["tokens"] == ev["tokens"]
    assert r["perplexity"] == pytest.approx(ev["perplexity"], rel=1e-5)
    assert r["perplexity_memory_off"] == pytest.approx(ev["perplexity_memory_off"], rel=1e-5)


def test_perplexity_with_exact_topk_scores_the_same_weights_with_the_exact_search(
    run_dir, tmp_path
):
    """At M = 256, k = 8 the binned search keeps one slot of each 2 (128 bins of 2 rows), so it
    differs from the exact one; --exact-topk's perplexity is the numpy reference model's with
    the exact top-8 of the held keys (test_memorizing_transformer.reference_forward)."""
    import argparse

    from test_memorizing_transformer import reference_forward

    def perplexity(*flags):
        out = tmp_path / "p.json"
        argv = ["perplexity", run_dir, "--memory-size", "256", "--eval-docs", "1"]
        assert evaluate.main(argv + ["--eval-tokens", "200", "--json", str(out), *flags]) == 0
        return json.loads(out.read_text())

    exact, binned = perplexity("--exact-topk"), perplexity()
    config, params, sp, run_args = evaluate.load_run(run_dir)
    config = config.replace(memory_size=256, exact_topk=True)
    assert mt.bin_layout(config.num_neighbors, 256, config.topk_recall_target)[1] == 2
    docs, _ = evaluate.validation_docs(
        argparse.Namespace(data=None, data_format=None), run_args, sp, config
    )
    doc = np.asarray(docs[0][:201])
    T = config.segment_length
    N = -(-200 // T) * T  # whole segments, the last one padded
    tokens, mask = np.zeros((1, N), np.int64), np.zeros((1, N), bool)
    tokens[0, :200], mask[0, :200] = doc[:200], True
    logits = reference_forward(params, tokens, config, mask=mask)[0, :200]  # [200, V]
    top = logits.max(-1)
    logsumexp = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    want = np.mean(logsumexp - logits[np.arange(200), doc[1:]])
    assert exact["exact_topk"] is True and exact["tokens"] == 200
    assert exact["loss"] == pytest.approx(want, rel=1e-6)
    assert binned["loss"] != pytest.approx(want, rel=1e-6)  # the binned search is another one


def test_the_runs_own_corpus_however_spelled_is_read_with_the_runs_format_and_suffixes(
    run_dir, tmp_path, monkeypatch
):
    """--data ./corpus/ (or a link) on a run of --data corpus --data-format repo --suffixes .py is
    the run's own corpus, so its validation documents are read as the run read them: only the
    .py files. Another corpus is read with its own format and every file."""
    monkeypatch.chdir(tmp_path)
    for i in range(6):
        (tmp_path / "corpus" / f"pkg{i}").mkdir(parents=True)
        (tmp_path / "corpus" / f"pkg{i}" / "a.py").write_text(f"x = {i}\n" * 20)
        (tmp_path / "corpus" / f"pkg{i}" / "notes.md").write_text(f"# notes {i}\n" * 20)
    shutil.copytree(tmp_path / "corpus", tmp_path / "copy")
    os.symlink(tmp_path / "corpus", tmp_path / "link")
    config, _, sp, run_args = evaluate.load_run(run_dir)
    run_args = dict(run_args, data="corpus", data_format="repo", suffixes=".py", min_doc_tokens=0)

    def texts(data_flag):
        docs, _ = evaluate.validation_docs(
            argparse.Namespace(data=data_flag, data_format=None), run_args, sp, config
        )
        return [sp.decode([int(t) for t in d]) for d in docs]

    own = texts(None)
    assert own and all("x = " in t and "notes" not in t for t in own)
    assert texts("./corpus/") == texts("link") == texts(str(tmp_path / "corpus")) == own
    assert any("notes" in t for t in texts("copy"))
    monkeypatch.chdir(tmp_path / "copy")  # the run's relative path, from elsewhere: named
    with pytest.raises(cli.UsageError, match="'corpus' does not exist from .*started in"):
        texts(None)


def test_perplexity_scores_by_default_what_the_run_scored(run_dir, tmp_path):
    """The run's own --eval-docs, --eval-tokens and --min-doc-tokens filter (Sec. 4.1's
    C4(4K+)) are evaluate.py's defaults: with no flags, `perplexity` equals eval.json."""
    sp = data.load_tokenizer(f"{run_dir}/tokenizer.model")
    _, valid = data.split_documents(
        corpora.load_documents("synthetic:40", verbose=False), 0.25, seed=0
    )
    lengths = sorted(len(t) for t in data.tokenize(valid, sp)[0])
    cut = lengths[len(lengths) // 2]  # the shorter documents go
    assert lengths[0] < cut
    out = tmp_path / "run"
    assert (
        train.main(
            FAST
            + [
                "--steps",
                "1",
                "--valid-fraction",
                "0.25",
                "--min-doc-tokens",
                str(cut),
                "--eval-docs",
                "3",
                "--eval-tokens",
                "100",
                "--tokenizer",
                f"{run_dir}/tokenizer.model",
                "--out",
                str(out),
                "--cache-dir",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    assert evaluate.main(["perplexity", str(out), "--json", str(tmp_path / "p.json")]) == 0
    ev, r = (
        json.loads((out / "eval.json").read_text()),
        json.loads((tmp_path / "p.json").read_text()),
    )
    assert r["tokens"] == ev["tokens"] == 300
    assert r["perplexity"] == pytest.approx(ev["perplexity"], rel=1e-5)


def test_compare_with_equal_memory_sizes_gives_zero_delta_everywhere(run_dir, tmp_path, capsys):
    path = tmp_path / "d.csv"
    assert (
        evaluate.main(
            [
                "compare",
                run_dir,
                "--memory-sizes",
                "64,64",
                "--max-tokens",
                "200",
                "--csv",
                str(path),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == 200 and [int(r["index"]) for r in rows] == list(range(1, 201))
    assert all(float(r["delta"]) == 0.0 for r in rows)
    assert "0.0% of tokens improved" in capsys.readouterr().out
    assert (
        evaluate.main(
            [
                "compare",
                run_dir,
                "--memory-sizes",
                "32,128",
                "--max-tokens",
                "200",
                "--csv",
                str(path),
            ]
        )
        == 0
    )
    rows = list(csv.DictReader(open(path)))
    deltas = np.array([float(r["delta"]) for r in rows])
    np.testing.assert_allclose(
        deltas, [float(r["ce_a"]) - float(r["ce_b"]) for r in rows], atol=2e-6
    )
    # Until the 32-slot memory starts dropping entries (the third segment), both hold the same.
    np.testing.assert_allclose(deltas[:64], 0.0, atol=1e-5)
    assert np.any(np.abs(deltas[64:]) > 1e-4)


def test_inspect_prints_the_retrieval_table(run_dir, capsys):
    assert evaluate.main(["inspect", run_dir, "--top", "3", "--max-tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nquery ") == 3 and "memory" in out and "head" in out


def test_a_checkpoint_without_gates_is_loaded_with_fresh_gates_and_every_other_weight_its_own(
    run_dir, tmp_path
):
    """A run trained without memory, evaluated with one: its checkpoint has no gate_bias, so
    only then are parameters initialized (the gates at init_gate_bias); every other weight is
    the checkpoint's. With the gates in the checkpoint, nothing is initialized."""
    meta, arrays = runs.load_checkpoint(f"{run_dir}/checkpoint.npz")
    config, params, _, _ = evaluate.load_run(run_dir)
    gates = {k for k in arrays if "gate_bias" in k}
    assert gates and any(
        np.any(arrays[k] != config.init_gate_bias) for k in gates
    )  # trained away from init
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    kept = {k: v for k, v in arrays.items() if k not in gates}
    runs.atomic_write(
        str(run / "checkpoint.npz"),
        lambda f: np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **kept),
    )
    for path, loaded in ((run_dir, params), (str(run), evaluate.load_run(str(run))[1])):
        for p, x in jax.tree_util.tree_flatten_with_path(loaded)[0]:
            key = "params" + jax.tree_util.keystr(p)
            expected = (
                arrays[key]
                if path == run_dir or key not in gates
                else np.full(x.shape, config.init_gate_bias)
            )
            np.testing.assert_array_equal(np.asarray(x), expected, err_msg=key)
    # Only the gates: a checkpoint that lacks a layer's weights too is refused, not filled in.
    last = f"params['layers'][{config.num_layers - 1}]"
    runs.atomic_write(
        str(run / "checkpoint.npz"),
        lambda f: np.savez(
            f,
            __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
            **{k: v for k, v in kept.items() if not k.startswith(last)},
        ),
    )
    with pytest.raises(cli.UsageError, match=re.escape(f"has no {last}[")):
        evaluate.load_run(str(run))


def test_slot_positions_follow_the_ring_buffer_layout():
    cfg = mt.Config(
        segment_length=4,
        memory_size=12,
        num_neighbors=4,
        memory_layers=(0,),
        num_layers=1,
        d_model=8,
        num_heads=1,
        head_dim=8,
        d_ff=8,
        vocab_size=8,
    )
    # While segment 5 is processed, the memory holds segments 2, 3, 4 at slot blocks 2, 0, 1.
    assert [evaluate.slot_position(s, 5, cfg) for s in (0, 3, 4, 7, 8, 11)] == [
        12,
        15,
        16,
        19,
        8,
        11,
    ]


def table(tmp, *flags):
    """evaluate.py table in a subprocess, for an early job: (its process, its --out-root)."""
    argv = [
        "table",
        "--data",
        "synthetic:40",
        "--steps",
        "2",
        "--segment-length",
        "32",
        "--batch-size",
        "4",
        "--num-neighbors",
        "8",
        "--out-root",
        str(tmp / "table"),
        "--rows",
        "XL cache,memory 4T + XL",
        "--cache-dir",
        str(tmp / "cache"),
    ] + list(flags)
    return subprocess.run(
        [sys.executable, "evaluate.py"] + argv,
        cwd=HERE,
        capture_output=True,
        text=True,
        env=child_env(),
    ), tmp / "table"


@pytest.fixture(scope="session")
def table_of_two_seeds(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("table_of_two_seeds")
    # Two of the five rows keep the suite fast (the other three differ only in their flags), and
    # one job serves both table tests and test_cli's: its seed-0 runs are a one-seed table's.
    # The table as the job wrote it is kept beside it (table.json is rewritten by the tests).
    proc, root = table(tmp, "--seeds", "2", "--init-gate-bias", "-2")
    if proc.returncode == 0:
        shutil.copy(root / "table.json", tmp / "job_table.json")
    return proc, root


def test_table_trains_the_paper_rows_and_writes_table_json(table_of_two_seeds, capsys):
    proc, root = table_of_two_seeds
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((root.parent / "job_table.json").read_text())
    assert [r["name"] for r in rows] == ["XL cache", "memory 4T + XL"]
    assert [(r["memory_size"], r["xl_cache"]) for r in rows] == [(0, True), (128, True)]
    assert all(r["steps"] == 2 and r["perplexity"] > 1 for r in rows)
    assert [r["perplexity_memory_off"] is None for r in rows] == [True, False]
    assert "memory off" in proc.stdout
    # --cache-dir reached the rows' runs: the tokenizer and the tokens are cached there.
    cached = sorted(p.name.split("-")[0] for p in (root.parent / "cache").iterdir() if p.is_file())
    assert cached == ["tokenizer", "tokens", "tokens"], cached
    # The ceiling, from an explicit scan of the validation tokens (segment 32 + XL cache 32).
    config, _, sp, run_args = evaluate.load_run(rows[1]["run"])
    docs, _ = evaluate.validation_docs(
        argparse.Namespace(data=None, data_format=None), run_args, sp, config
    )
    hits = total = 0
    for doc in docs:
        doc = [int(x) for x in doc]
        for i in range(1, len(doc)):
            back = [i - j for j in range(2, i) if doc[j - 2 : j + 1] == doc[i - 2 : i + 1]]
            hits += bool(back) and 64 < min(back) <= 64 + 128
            total += 1
    assert hits > 0 and rows[0]["ceiling"] == 0 and abs(rows[1]["ceiling"] - hits / total) < 1e-12
    # One seed, the table's default: seed 0's runs, reused, each row's numbers that run's alone.
    one = proc.args[2 : proc.args.index("--seeds")] + proc.args[proc.args.index("--seeds") + 2 :]
    assert evaluate.main(one) == 0
    out = capsys.readouterr().out
    assert "training" not in out and "±" not in out
    for row, two in zip(json.loads((root / "table.json").read_text()), rows):
        ev = json.loads((pathlib.Path(two["run"]) / "eval.json").read_text())
        assert [r["run"] for r in row["seeds"]] == [two["run"]] and row["perplexity"] == ev[
            "perplexity"
        ]
        assert row["perplexity_std"] is None and row["perplexity_memory_off_std"] is None
        assert row["perplexity_memory_off"] == ev.get("perplexity_memory_off")
        assert (
            row["far_repeat_loss"] == ev.get("far_repeat_loss")
            and row["far_repeat_loss_std"] is None
        )
        per_seed = ("perplexity", "far_repeat")  # the means over seeds: one seed's here
        assert {k: v for k, v in row.items() if not k.startswith(per_seed) and k != "seeds"} == {
            k: v for k, v in two.items() if not k.startswith(per_seed) and k != "seeds"
        }
    # Without --init-gate-bias the memory row's run is the preset's gate: these runs are not it.
    default_gate = one[: one.index("--init-gate-bias")] + one[one.index("--init-gate-bias") + 2 :]
    assert evaluate.main(default_gate) == 2
    assert (
        f"holds a run of other settings (--init-gate-bias {presets.PRESETS['tiny'].init_gate_bias} "
        "here, -2.0 there)" in capsys.readouterr().err
    )
    # The job's command (its argv after `python evaluate.py`) again, in this process: it reuses the
    # runs, and writes the table the job wrote.
    assert evaluate.main(proc.args[2:]) == 0
    assert "training" not in capsys.readouterr().out
    assert json.loads((root / "table.json").read_text()) == rows


def test_table_with_seeds_reports_the_mean_and_spread_of_every_rows_seeds(table_of_two_seeds):
    proc, root = table_of_two_seeds
    assert proc.returncode == 0, proc.stderr
    assert "±" in proc.stdout
    rows = json.loads((root.parent / "job_table.json").read_text())
    for row, base, memory in zip(rows, ["XL_cache", "memory_4T_plus_XL"], [False, True]):
        assert [r["run"] for r in row["seeds"]] == [str(root / base), str(root / f"{base}_seed1")]
        evs = [json.loads((root / d / "eval.json").read_text()) for d in (base, f"{base}_seed1")]
        saved = [
            json.loads((root / d / "config.json").read_text())["config"]
            for d in (base, f"{base}_seed1")
        ]
        assert [c["seed"] for c in saved] == [0, 1]
        assert [c["init_gate_bias"] for c in saved] == ([-2.0, -2.0] if memory else [0.0, 0.0])
        ppl = [e["perplexity"] for e in evs]
        assert ppl[0] != ppl[1]  # another init and data order
        assert row["perplexity"] == pytest.approx(np.mean(ppl)) and row[
            "perplexity_std"
        ] == pytest.approx(abs(ppl[0] - ppl[1]) / math.sqrt(2))
        if memory:
            off = [e["perplexity_memory_off"] for e in evs]
            assert row["perplexity_memory_off"] == pytest.approx(np.mean(off))
            assert row["perplexity_memory_off_std"] == pytest.approx(np.std(off, ddof=1))
        else:
            assert row["perplexity_memory_off"] is None and row["perplexity_memory_off_std"] is None


FINETUNE = [
    "finetune",
    "--preset",
    "tiny",
    "--data",
    "synthetic:40",
    "--pretrain-steps",
    "4",
    "--finetune-steps",
    "2",
    "--eval-every",
    "2",
    "--eval-docs",
    "2",
    "--eval-tokens",
    "64",
    "--segment-length",
    "32",
    "--batch-size",
    "4",
    "--num-neighbors",
    "8",
    "--memory-size",
    "64",
]


@pytest.fixture(scope="session")
def finetune_runs(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("finetune_runs")
    """evaluate.py finetune, in subprocesses beside the suite: its three runs, then --fresh-start's
    one more. (The two processes, the first one's flags, its --out-root and its --cache-dir.)"""
    flags = FINETUNE + ["--out-root", str(tmp / "ft"), "--cache-dir", str(tmp / "cache")]
    procs = []
    for extra in ([], ["--fresh-start"]):
        procs.append(
            subprocess.run(
                [sys.executable, "evaluate.py"] + flags + extra,
                cwd=HERE,
                capture_output=True,
                text=True,
                env=child_env(),
            )
        )
        if procs[-1].returncode:
            break
    return procs, flags, tmp / "ft", tmp / "cache"


def test_finetune_trains_without_memory_then_with_it_and_prints_both_curves(finetune_runs, capsys):
    procs, flags, root, cache = finetune_runs
    assert [p.returncode for p in procs] == [0, 0], procs[-1].stderr
    assert procs[0].stdout.count("training") == 3
    assert sorted(p.name.split("-")[0] for p in cache.iterdir() if p.is_file()) == [
        "tokenizer",
        "tokens",
        "tokens",
    ]
    saved = {
        k: json.loads((root / k / "config.json").read_text())
        for k in ("no_memory", "fine_tuned", "memory")
    }
    assert [saved[k]["config"]["memory_size"] for k in ("no_memory", "fine_tuned", "memory")] == [
        0,
        64,
        64,
    ]
    assert saved["fine_tuned"]["args"]["init_from"] == str(root / "no_memory")
    assert not saved["fine_tuned"]["args"]["fresh_start"]
    assert [json.loads((root / k / "eval.json").read_text())["step"] for k in saved] == [4, 6, 6]
    result = json.loads((root / "finetune.json").read_text())
    assert [c["step"] for c in result["curve"]] == [2, 4, 6]
    assert [c["fine_tuned_has_memory"] for c in result["curve"]] == [False, False, True]
    # The curve is the runs' logged evaluations: without memory up to step 4, fine-tuned after.
    logged = lambda k: {
        r["step"]: r
        for r in map(json.loads, (root / k / "metrics.jsonl").read_text().splitlines())
        if "eval_loss" in r
    }
    assert [c["fine_tuned"] for c in result["curve"]] == [
        logged("no_memory")[2],
        logged("no_memory")[4],
        logged("fine_tuned")[6],
    ]
    assert [c["memory_from_scratch"] for c in result["curve"]] == [
        logged("memory")[s] for s in (2, 4, 6)
    ]
    # --fresh-start: one more run, counting its steps from 0, shown after the no-memory steps.
    assert procs[1].stdout.count("training") == 1
    fresh = root / "fine_tuned_fresh_start"
    assert json.loads((fresh / "config.json").read_text())["args"]["fresh_start"]
    assert json.loads((fresh / "eval.json").read_text())["step"] == 2
    curve = json.loads((root / "finetune_fresh_start.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [2, 4, 6] and curve[2]["fine_tuned"]["step"] == 2
    assert curve[2]["memory_from_scratch"] == result["curve"][2]["memory_from_scratch"]
    # The first command again, in this process: it reuses the three runs and writes the same curve.
    assert evaluate.main(flags) == 0
    assert "training" not in capsys.readouterr().out
    assert json.loads((root / "finetune.json").read_text()) == result
    # ... only with the settings they were trained with (another k was once reused unremarked)
    assert evaluate.main(flags + ["--num-neighbors", "4"]) == 2
    assert (
        "holds a run of other settings (--num-neighbors 4 here, 8 there)" in capsys.readouterr().err
    )


def test_bad_input_gets_one_sentence_and_exit_code_2(tmp_path, run_dir, capsys):
    assert evaluate.main(["perplexity", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert evaluate.main(["inspect", run_dir, "--doc", "99"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert (
        evaluate.main(
            ["compare", run_dir, "--memory-sizes", "64", "--csv", str(tmp_path / "x.csv")]
        )
        == 2
    )
    assert "A,B" in capsys.readouterr().err
    assert evaluate.main(["table", "--rows", "huge memory"]) == 2
    assert "unknown --rows" in capsys.readouterr().err


def test_recall_on_real_keys_of_a_trained_model_is_high_but_below_one_when_binned(
    run_dir, tmp_path
):
    out = tmp_path / "r.json"
    assert (
        evaluate.main(
            ["recall", run_dir, "--memory-size", "512", "--max-tokens", "600", "--json", str(out)]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["bins"] == 128 and r["retrievals"] > 0  # k = 8: 128 bins of 4 slots
    # Every query of a segment after the first (T = 32 >= k) counts once a head; the padding of
    # the last segment does not (it once did, its queries and neighbours included).
    config, _, sp, run_args = evaluate.load_run(run_dir, 512)
    doc, _ = evaluate._doc(
        argparse.Namespace(data=None, data_format=None, doc=0, max_tokens=600), run_args, sp, config
    )
    assert (len(doc) - 1) % config.segment_length  # the last segment is padded
    assert r["retrievals"] == config.num_heads * (len(doc) - 1 - config.segment_length)
    assert 0.8 <= r["recall"] < 1.0
    # The same weights in bfloat16 (keys, queries, memory and scores): still mostly found.
    assert (
        evaluate.main(
            [
                "recall",
                run_dir,
                "--memory-size",
                "512",
                "--max-tokens",
                "600",
                "--dtype",
                "bfloat16",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert 0.8 <= json.loads(out.read_text())["recall"] < 1.0


def test_recall_on_a_document_too_short_to_retrieve_from_is_refused(run_dir, capsys):
    """One segment (FAST: T = 32) holds no earlier memories: a recall of 0 on 0 queries is no
    answer."""
    assert evaluate.main(["recall", run_dir, "--max-tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert "no query had 8 memories" in err and "give at least 33" in err and err.count("\n") == 1
    assert (
        evaluate.main(["recall", run_dir, "--max-tokens", "33"]) == 0
    )  # one query in the second segment


def test_broken_runs_and_bad_paths_get_one_sentence_and_exit_code_2(tmp_path, run_dir, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    ckpt = broken / "checkpoint.npz"
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[:1000])
    cases = [
        (["perplexity", str(broken)], "truncated or corrupt"),
        (["perplexity", run_dir, "--json", str(tmp_path / "no" / "dir.json")], "cannot write"),
        (["perplexity", run_dir, "--memory-size", "-32"], "must be a non-negative integer"),
        (
            ["perplexity", run_dir, "--memory-size", "16"],
            "memory size 16 does not fit the run in",
        ),  # T = 32
        (
            ["compare", run_dir, "--memory-sizes", "0,4", "--csv", str(tmp_path / "c.csv")],
            "memory size 4 does not fit",
        ),
        (["perplexity", run_dir, "--eval-docs", "0"], "must be positive"),
        (["inspect", run_dir, "--max-tokens", "-1"], "must not be negative"),
        (["perplexity", run_dir, "--data", str(tmp_path / "missing")], "does not exist"),
    ]
    for argv, message in cases:
        assert evaluate.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    ckpt.write_bytes(good)
    (broken / "tokenizer.model").write_text("not a model")
    assert evaluate.main(["perplexity", str(broken)]) == 2
    assert "not a SentencePiece model" in capsys.readouterr().err


def test_explore_page_is_self_contained_and_holds_the_tokens_and_compares_and_inspects_numbers(
    run_dir, tmp_path, capsys
):
    import argparse
    import re
    from html.parser import HTMLParser

    page = tmp_path / "page.html"
    assert (
        evaluate.main(
            ["explore", run_dir, "--max-tokens", "300", "--html", str(page), "--memories", "3"]
        )
        == 0
    )
    capsys.readouterr()

    class Page(HTMLParser):
        def __init__(self):
            super().__init__()
            self.external, self.scripts, self.current = [], {}, None

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if attrs.get("src") or (tag == "link" and attrs.get("href")):
                self.external.append((tag, attrs))
            if tag == "script":
                self.current = attrs.get("id", "code")
                self.scripts[self.current] = ""

        def handle_data(self, text):
            if self.current:
                self.scripts[self.current] += text

        def handle_endtag(self, tag):
            self.current = None if tag == "script" else self.current

    parsed = Page()
    parsed.feed(page.read_text())
    assert parsed.external == [] and "http" not in parsed.scripts["code"]
    d = json.loads(parsed.scripts["data"])
    # Exactly the document's tokens, in order.
    config, _, sp, run_args = evaluate.load_run(run_dir)
    docs, _ = evaluate.validation_docs(
        argparse.Namespace(data=None, data_format=None), run_args, sp, config
    )
    doc = docs[0][:301]
    assert d["ids"] == doc.tolist() and d["pieces"] == [evaluate.token_text(sp, t) for t in doc]
    assert "".join(d["pieces"]) == sp.decode(
        doc.tolist()
    )  # synthetic text is ASCII: each piece reads as itself
    # The losses are compare's (memory size 0 is the memory-off ablation: no memory path at all).
    csv_path = tmp_path / "c.csv"
    assert (
        evaluate.main(
            [
                "compare",
                run_dir,
                "--memory-sizes",
                f"0,{config.memory_size}",
                "--max-tokens",
                "300",
                "--csv",
                str(csv_path),
            ]
        )
        == 0
    )
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["target"]) for r in rows] == d["ids"][1:]
    np.testing.assert_allclose(d["loss_memory_off"], [float(r["ce_a"]) for r in rows], atol=2e-4)
    np.testing.assert_allclose(d["loss"], [float(r["ce_b"]) for r in rows], atol=2e-4)
    # The retrievals are inspect's: its first line for each query is that head's top memory.
    capsys.readouterr()
    assert evaluate.main(["inspect", run_dir, "--max-tokens", "300", "--top", "5"]) == 0
    H, R = d["heads"], d["top"]
    blocks = re.findall(
        r"query (\d+): .*?gain ([-+.\d]+).*?\n\s+head (\d+) weight ([.\d]+) memory\s+(\d+):",
        capsys.readouterr().out,
    )
    assert len(blocks) == 5
    for i, gain, h, w, pos in blocks:
        i, h, k = int(i), int(h), (int(i) * H + int(h)) * R
        assert d["memory_pos"][k] == int(pos)
        assert abs(d["memory_weight"][k] / 1000 - float(w)) <= 0.0015
        assert abs(d["loss_memory_off"][i] - d["loss"][i] - float(gain)) <= 0.0015


def test_the_explore_page_keeps_a_documents_markup_as_text():
    """A code corpus has "<" in its tokens. In the page's data, no "<" is left to end the
    <script> element early ("</script>") or to change how it is parsed ("<!--<script>"), and
    the data reads back the same; in the page's script, every piece of the document that goes
    into innerHTML goes through esc (the query line once put pieces such as "<b>" in raw)."""
    import re

    value = {"pieces": ["</script>", "<!--<script>", "a<b&c>", "\u2028", '"'], "n": [1, 2.5]}
    blob = evaluate.script_json(value)
    assert "<" not in blob and json.loads(blob) == value
    here = os.path.dirname(os.path.abspath(evaluate.__file__))
    with open(os.path.join(here, "explore.html")) as f:
        script = f.read().split("<script>")[1]
    assert "const esc = (t) =>" in script
    built = script[
        script.index("let html =") : script.index(".innerHTML = html")
    ]  # the HTML that show() builds
    inserts = re.findall(r"\$\{(.*?)\}", built)  # ${expression} in the template strings
    assert len(inserts) >= 10
    for expr in inserts:
        if "pieces" in expr or "text(" in expr:
            assert expr.startswith(("esc(", "line(")), expr
    assert "const line = (t) => esc(t)" in built


def test_token_kinds_and_context_reach_against_explicit_definitions():
    class Pieces:  # a stand-in tokenizer: ids name pieces
        pieces = ["\u2581for", "x_1", "\u2581(", "42", "\u2581", "<0x41>", "<0xE9>", "a+"]

        def id_to_piece(self, i):
            return self.pieces[i]

    kinds = [evaluate.token_kind(Pieces(), i) for i in range(8)]
    assert kinds == [
        "keyword/punct",
        "identifier",
        "keyword/punct",
        "number",
        "other",
        "identifier",
        "other",
        "other",
    ]
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 3, 200)
    got = data.context_distance(doc)
    for i in range(1, len(doc)):  # the nearest earlier j with the same 3 tokens ending at j
        js = [
            j
            for j in range(2, i)
            if i >= 2 and list(doc[j - 2 : j + 1]) == list(doc[i - 2 : i + 1])
        ]
        assert got[i - 1] == (i - js[-1] if js and i >= 2 else 0), i
    assert [data.reach(d, 256, 512) for d in (0, 1, 256, 257, 768, 769)] == [
        "new",
        "window",
        "window",
        "memory",
        "memory",
        "beyond",
    ]


# ----------------------------------------------------------------------------- reach (Sec. 4.4)
def test_a_probes_definition_is_in_the_memory_exactly_when_within_reach_says_so(run_dir):
    """Stream a synthetic-long document through the run's model with memories of several sizes.
    After the call for the probe's segment, the state's memory is what that segment searched:
    the definition's key is in a valid slot (or in the window) exactly where within_reach says,
    so with M below the distance no slot holds it, and with M above it one does."""
    config, params, sp, _ = evaluate.load_run(run_dir)  # FAST: T = 32, XL cache
    T = config.segment_length
    (doc,), (ref,) = data.tokenize(corpora.synthetic_long_documents(1, 150, seed=3), sp)
    dist = data.reference_distances(doc, ref)
    probes = [
        (int(p) - int(dist[p]), int(p) - 1) for p in np.flatnonzero(ref)
    ]  # (key, query) positions
    seen = {True: 0, False: 0}
    for m in (64, 128, 256):
        cfg = config.replace(memory_size=m)
        step = evaluation.make_forward_step(evaluation.step_config(cfg))
        state, states = mt.init_state(cfg, 1), []
        for batch in data.SegmentBatches([doc], 1, T, epochs=1):
            state = step(params, state, evaluation.model_inputs(batch)).state
            states.append(jax.tree.map(np.array, state))
        for key, query in probes:
            layer = cfg.memory_layers[0]
            k = states[key // T].prev_k[0, layer, :, key % T]  # [H, D] the key as written
            s = states[query // T]
            held = [
                slot
                for slot in range(m)
                if s.mem_valid[0, slot] and (s.mem_k[0, 0, :, slot] == k).all()
            ]
            in_window = query // T - key // T <= 1  # the query's segment, or the XL cache
            assert (bool(held) or in_window) == evaluate.within_reach(key, query, cfg), (
                m,
                key,
                query,
            )
            seen[bool(held)] += 1
    assert seen[True] and seen[False]  # both cases occurred


def test_reach_takes_distinct_distances_and_memory_sizes(run_dir, capsys):
    """Each (distance, memory size) is a row of reach's table: a repeated distance or size
    (once evaluated twice, as rows of the same name) is refused in one line. (compare of a
    size with itself stays: its zero differences are a test of their own.)"""
    import argparse

    assert cli.int_list(1)("64,1024") == [64, 1024]
    for text in ("64,64", "0,1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.int_list(1)(text)
    for flags in (["--distances", "64,128,64"], ["--memory-sizes", "64,64"]):
        assert evaluate.main(["reach", run_dir] + flags) == 2
        err = capsys.readouterr().err
        assert "names a value twice" in err and err.count("\n") == 1, err


def test_reach_writes_far_loss_by_distance_and_memory_size(run_dir, tmp_path, capsys):
    out = tmp_path / "reach.json"
    assert (
        evaluate.main(
            [
                "reach",
                run_dir,
                "--distances",
                "100,200",
                "--memory-sizes",
                "64,256",
                "--docs",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [(r["distance"], r["memory_size"]) for r in rows] == [
        (100, 64),
        (100, 256),
        (200, 64),
        (200, 256),
    ]
    printed = capsys.readouterr().out
    assert "far loss" in printed and "in 3 documents per distance" in printed
    assert corpora.plural(1, "document") == "1 document" and corpora.plural(0, "step") == "0 steps"
    config, params, sp, _ = evaluate.load_run(run_dir)
    for r in rows:
        assert {"far_loss", "far_loss_memory_off", "tokens", "in_reach", "mean_distance"} <= set(r)
        # Independently: each document alone (one row), its per-token loss at the probes.
        docs, refs = data.tokenize(corpora.synthetic_long_documents(3, r["distance"], seed=0), sp)
        cfg = config.replace(memory_size=r["memory_size"])
        on = np.concatenate(
            [evaluation.per_token_loss(params, cfg, d)[0][f[1:]] for d, f in zip(docs, refs)]
        )
        off = np.concatenate(
            [
                evaluation.per_token_loss(mt.memory_off(params), cfg, d)[0][f[1:]]
                for d, f in zip(docs, refs)
            ]
        )
        assert r["tokens"] == len(on) >= 3 * 8
        assert r["far_loss"] == pytest.approx(on.mean(), rel=1e-5)
        assert r["far_loss_memory_off"] == pytest.approx(off.mean(), rel=1e-5)
    # M = 64 (2 segments) holds no definition 100 or 200 tokens back; M = 256 (8 segments) holds
    # all.
    assert [r["in_reach"] for r in rows] == [0.0, 1.0, 0.0, 1.0]


def test_reach_refuses_bad_input_in_one_sentence(run_dir, tmp_path, capsys):
    import shutil

    stdlib_run = tmp_path / "stdlib"
    shutil.copytree(run_dir, stdlib_run)
    saved = json.loads((stdlib_run / "config.json").read_text())
    saved["args"]["data"] = "stdlib"
    (stdlib_run / "config.json").write_text(json.dumps(saved))
    for argv, message in [
        (["--distances", "100,x"], "comma-separated integers"),
        (["--distances", "0"], "positive integers"),
        (["--memory-sizes", "64,100"], "multiple of segment_length"),
        (["--docs", "0"], "must be positive"),
        # (documents made in memory: these once ran without end)
        (["--docs", "1000000"], "ask for about 82,944,000,000 tokens of probe documents"),
        (["--docs", "1", "--distances", "30000000"], "reach makes at most 20,000,000"),
    ]:
        assert evaluate.main(["reach", run_dir] + argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert evaluate.main(["reach", str(stdlib_run)]) == 2
    assert "needs a run trained with --data synthetic" in capsys.readouterr().err


# ----------------------------------------------------------------------------- repeat bands
@settings(deadline=None, max_examples=30, derandomize=True)
@given(
    doc=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    window=st.integers(1, 20),
    memory=st.integers(0, 40),
)
def test_repeat_bands_equal_a_brute_force_reading_of_their_definition(doc, window, memory):
    """A target is far_repeat when its 3-token context (ending at it) occurred earlier in the
    document, every earlier occurrence more than `window` back and one within window + memory;
    near_repeat when one is within the window; new when there is none; else beyond."""
    got = data.repeat_bands(np.asarray(doc), window, memory)
    assert len(got) == len(doc) - 1
    for i in range(1, len(doc)):
        back = [i - j for j in range(2, i) if i >= 2 and doc[j - 2 : j + 1] == doc[i - 2 : i + 1]]
        if not back:
            want = "new"
        elif any(d <= window for d in back):
            want = "near_repeat"
        elif any(d <= window + memory for d in back):
            want = "far_repeat"
        else:
            want = "beyond"
        assert got[i - 1] == want, (i, back)


@settings(deadline=None, max_examples=30, derandomize=True)
@given(
    doc=st.lists(st.integers(0, 1), min_size=1, max_size=120),
    window=st.integers(1, 20),
    memory=st.integers(0, 40),
    n=st.integers(4, 6),
)
def test_span_band_is_far_repeat_with_a_whole_long_context_last_seen_in_the_memory(
    doc, window, memory, n
):
    """far_span: a far_repeat target whose n-token context (ending at it) was last seen more than
    `window` and at most window + memory tokens back."""
    got = data.span_band(np.asarray(doc), window, memory, n)
    far = data.repeat_bands(np.asarray(doc), window, memory) == "far_repeat"
    for i in range(1, len(doc)):
        context = doc[i - n + 1 : i + 1] if i >= n - 1 else None
        seen = [j for j in range(n - 1, i) if doc[j - n + 1 : j + 1] == context]
        last = i - max(seen) if seen else 0
        want = far[i - 1] and window < last <= window + memory
        assert got[i - 1] == want, (i, last)


def test_every_evaluation_reports_each_bands_loss_with_the_memory_off_beside_it(run_dir, tmp_path):
    """eval.json and evaluate.py perplexity carry far_repeat_loss, its _memory_off and _tokens,
    and the same for near_repeat and new: the mean per-token loss of the band's targets."""
    out = tmp_path / "p.json"
    argv = ["perplexity", run_dir, "--eval-docs", "1", "--eval-tokens", "300", "--json", str(out)]
    assert evaluate.main(argv + ["--memory-size", "64"]) == 0
    r = json.loads(out.read_text())
    config, params, sp, run_args = evaluate.load_run(run_dir)
    docs, _ = evaluate.validation_docs(
        argparse.Namespace(data=None, data_format=None), run_args, sp, config
    )
    doc = np.asarray(docs[0][:301])
    losses, _ = evaluation.per_token_loss(params, config, doc)
    off, _ = evaluation.per_token_loss(mt.memory_off(params), config, doc)
    window = config.segment_length + config.cache_length
    band = data.repeat_bands(doc, window, config.memory_size)
    assert sum(r[f"{b}_tokens"] for b in data.REPEAT_BANDS) == 300  # beyond the memory among them
    for b in data.REPEAT_BANDS:
        assert r[f"{b}_tokens"] == int(np.sum(band == b))
        if r[f"{b}_tokens"]:
            assert r[f"{b}_loss"] == pytest.approx(losses[band == b].mean(), rel=1e-5)
            assert r[f"{b}_loss_memory_off"] == pytest.approx(off[band == b].mean(), rel=1e-5)
    assert r["far_repeat_tokens"] > 0 and r["near_repeat_tokens"] > 0
    span = data.span_band(doc, window, config.memory_size)
    assert r["far_span_tokens"] == int(span.sum()) and span.sum() <= r["far_repeat_tokens"]
    if span.any():
        assert r["far_span_loss"] == pytest.approx(losses[span].mean(), rel=1e-5)
        assert r["far_span_loss_memory_off"] == pytest.approx(off[span].mean(), rel=1e-5)
    # With no memory, --band-memory scores the same tokens' bands: what local attention alone does
    # on the memory's far-repeat tokens.
    assert evaluate.main(argv + ["--memory-size", "0", "--band-memory", "64"]) == 0
    xl = json.loads(out.read_text())
    assert all(xl[f"{b}_tokens"] == r[f"{b}_tokens"] for b in data.REPEAT_BANDS)
    assert xl["far_repeat_loss"] == pytest.approx(r["far_repeat_loss_memory_off"], rel=1e-5)
    with open(os.path.join(run_dir, "eval.json")) as f:
        assert {"far_repeat_tokens", "near_repeat_tokens", "new_tokens"} <= set(json.load(f))


@pytest.mark.commands  # a whole run and four evaluations of its own
def test_by_default_whole_documents_are_scored_so_a_larger_memory_changes_the_perplexity(
    tmp_path, capsys
):
    """Sec. 4.6: for a document's first M tokens, memories of M and of 4M slots hold the same keys.
    With train.py's and evaluate.py's default evaluation flags, a validation document longer than
    T + cache + 16384 tokens is scored to its end, so M = 4096 and M = 16384 score differently;
    and the line says how many of the scored tokens came after the memory had filled."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(64)]
    (tmp_path / "corpus").mkdir()
    for i in range(3):  # one held out, two for the two rows
        text = " ".join(rng.choice(words) for _ in range(17000))
        (tmp_path / "corpus" / f"doc{i}.txt").write_text(text)
    out = tmp_path / "run"
    flags = ["--data", str(tmp_path / "corpus"), "--vocab-size", "512", "--steps", "1"]
    flags += ["--segment-length", "128", "--memory-size", "128", "--batch-size", "2"]
    flags += ["--num-layers", "2", "--memory-layers", "1", "--num-neighbors", "8"]
    flags += ["--d-model", "32", "--num-heads", "1", "--head-dim", "32", "--d-ff", "64"]
    flags += ["--exact-topk", "--init-gate-bias", "3"]  # the retrieved values weigh 0.95
    flags += ["--valid-fraction", "0.3", "--out", str(out), "--cache-dir", str(tmp_path / "c")]
    assert train.main(flags) == 0
    config = evaluate.load_run(str(out))[0]
    ev = json.loads((out / "eval.json").read_text())
    assert ev["tokens"] > config.segment_length + config.cache_length + 16384  # the whole document
    assert f"{ev['tokens_memory_full']} after the memory filled" in capsys.readouterr().out

    def perplexity(memory_size, *flags):
        path = tmp_path / "p.json"
        argv = ["perplexity", str(out), "--memory-size", str(memory_size), "--json", str(path)]
        assert evaluate.main(argv + list(flags)) == 0
        return json.loads(path.read_text())

    small, large = perplexity(4096), perplexity(16384)
    assert small["tokens"] == large["tokens"] == ev["tokens"]
    assert small["tokens_memory_full"] == small["tokens"] - 4096  # targets from offset 4096 on
    assert large["tokens_memory_full"] == large["tokens"] - 16384
    assert abs(small["loss"] - large["loss"]) > 1e-5  # (an untrained model's loss moves little)
    assert small["loss_memory_off"] == pytest.approx(large["loss_memory_off"], rel=1e-6)
    # The old default, each document's first 4096 tokens: the two memories never differ.
    small, large = (
        perplexity(4096, "--eval-tokens", "4096"),
        perplexity(16384, "--eval-tokens", "4096"),
    )
    assert small["tokens"] == 4096 and abs(small["loss"] - large["loss"]) < 1e-7

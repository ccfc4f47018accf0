"""train.py: Adafactor against its definition, the schedule, checkpoints, resume, init-from,
sharding, the smoke run and the command line's answers to bad input."""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cli
import evaluate
import evaluation
import kernels
import memorizing_transformer as mt
import optimizer
import presets
import runs
import train
from conftest import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
# A model small enough that a run of a few steps takes seconds: the tiny preset with short
# segments and a small batch and memory (TINY_FAST, the layers that evaluate.py table and
# finetune train), and at two layers, the second with the memory (FAST, which compiles faster).
TINY_FAST = [
    "--data",
    "synthetic:40",
    "--segment-length",
    "32",
    "--memory-size",
    "64",
    "--batch-size",
    "4",
    "--num-neighbors",
    "8",
    "--eval-docs",
    "2",
    "--eval-tokens",
    "64",
    "--log-every",
    "1",
]
FAST = TINY_FAST + ["--num-layers", "2", "--memory-layers", "1"]


# ----------------------------------------------------------------------------- Adafactor
def np_adafactor(
    x, grads, lr, beta1=None, factored=True, d=1.0, eps1=1e-30, eps2=1e-3, scale_by_param=True
):
    """Adafactor written from the paper (Shazeer & Stern, 2018, Alg. 4 and 5), loop by loop."""
    x = x.astype(np.float64).copy()
    n, m = x.shape if x.ndim == 2 else (x.shape[0], 1)
    R, C, V, M = np.zeros(n), np.zeros(m), np.zeros(x.shape), np.zeros(x.shape)
    for t, g in enumerate(grads, 1):
        beta2 = 1 - t**-0.8
        U = np.zeros(x.shape)
        if factored:
            for i in range(n):
                R[i] = beta2 * R[i] + (1 - beta2) * sum(g[i, j] ** 2 + eps1 for j in range(m)) / m
            for j in range(m):
                C[j] = beta2 * C[j] + (1 - beta2) * sum(g[i, j] ** 2 + eps1 for i in range(n)) / n
            for i in range(n):
                for j in range(m):
                    U[i, j] = g[i, j] / math.sqrt(R[i] * C[j] / (sum(R) / n))
        else:
            for idx in np.ndindex(x.shape):
                V[idx] = beta2 * V[idx] + (1 - beta2) * (g[idx] ** 2 + eps1)
                U[idx] = g[idx] / math.sqrt(V[idx])
        U = U / max(1.0, math.sqrt(np.mean(U**2)) / d)
        if beta1 is not None:
            M = beta1 * M + (1 - beta1) * U
            U = M
        alpha = lr(t) * (max(eps2, math.sqrt(np.mean(x**2))) if scale_by_param else 1.0)
        x = x - alpha * U
    return x


def np_adafactor_3d(x, grads, lr, batch_axis, factored, eps1=1e-30, eps2=1e-3):
    """np_adafactor for a leaf of rank 3, such as wq [E, H, D] or wo [H, D, E]: factored over
    its two other axes, slice by slice along batch_axis; the update's clipping and the
    parameter's scale over the whole leaf. Loop by loop."""
    x = np.moveaxis(x.astype(np.float64), batch_axis, 0).copy()  # [k, n, m]
    grads = [np.moveaxis(g.astype(np.float64), batch_axis, 0) for g in grads]
    k, n, m = x.shape
    R, C, V = np.zeros((k, n)), np.zeros((k, m)), np.zeros(x.shape)
    for t, g in enumerate(grads, 1):
        beta2 = 1 - t**-0.8
        U = np.zeros(x.shape)
        for s in range(k):
            for i in range(n):
                for j in range(m):
                    if not factored:
                        V[s, i, j] = beta2 * V[s, i, j] + (1 - beta2) * (g[s, i, j] ** 2 + eps1)
                        U[s, i, j] = g[s, i, j] / math.sqrt(V[s, i, j])
            if factored:
                for i in range(n):
                    row = sum(g[s, i, j] ** 2 + eps1 for j in range(m)) / m
                    R[s, i] = beta2 * R[s, i] + (1 - beta2) * row
                for j in range(m):
                    column = sum(g[s, i, j] ** 2 + eps1 for i in range(n)) / n
                    C[s, j] = beta2 * C[s, j] + (1 - beta2) * column
                for i in range(n):
                    for j in range(m):
                        U[s, i, j] = g[s, i, j] / math.sqrt(R[s, i] * C[s, j] / np.mean(R[s]))
        U = U / max(1.0, math.sqrt(np.mean(U**2)))
        x = x - lr(t) * max(eps2, math.sqrt(np.mean(x**2))) * U
    return np.moveaxis(x, 0, batch_axis)


def test_adafactor_on_the_models_rank_3_leaves_matches_its_definition():
    """wq [E, H, D] and wo [H, D, E] factor over their two largest axes, each head's slice apart;
    a rank-3 leaf with an axis below 32 among its two largest is not factored."""
    rng = np.random.default_rng(2)
    params = {
        "wq": rng.standard_normal((40, 3, 36)).astype(np.float32),  # [E, H, D]
        "wo": rng.standard_normal((3, 36, 40)).astype(np.float32),  # [H, D, E]
        "narrow": rng.standard_normal((40, 3, 8)).astype(np.float32),
    }
    grads = [
        {k: (rng.standard_normal(v.shape) * s).astype(np.float32) for k, v in params.items()}
        for s in (1.0, 0.01, 3.0)
    ]
    lr = lambda t: 0.1 / t
    init, update = optimizer.adafactor(lr)
    update = jax.jit(update)
    p = jax.tree.map(jnp.asarray, params)
    state = init(p)
    for g in grads:
        u, state = update(jax.tree.map(jnp.asarray, g), state, p)
        p = jax.tree.map(jnp.add, p, u)
    for name, batch_axis, factored in (("wq", 1, True), ("wo", 0, True), ("narrow", 1, False)):
        want = np_adafactor_3d(params[name], [g[name] for g in grads], lr, batch_axis, factored)
        np.testing.assert_allclose(p[name], want, rtol=2e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_adafactor_matches_its_definition_computed_by_hand(beta1):
    rng = np.random.default_rng(0)
    params = {
        "w": rng.standard_normal((40, 36)).astype(np.float32),  # factored (both dims >= 32)
        "small": rng.standard_normal((3, 4)).astype(np.float32),  # too small to factor
        "b": rng.standard_normal(5).astype(np.float32),
    }  # a vector: no parameter scaling
    grads = [
        {k: (rng.standard_normal(v.shape) * s).astype(np.float32) for k, v in params.items()}
        for s in (1.0, 0.01, 3.0)
    ]  # 3.0 makes update clipping matter
    lr = lambda t: 0.1 / t
    init, update = optimizer.adafactor(lr, beta1=beta1)
    update = jax.jit(update)  # one program, as in a train step
    p, state = jax.tree.map(jnp.asarray, params), None
    state = init(p)
    for g in grads:
        u, state = update(jax.tree.map(jnp.asarray, g), state, p)
        p = jax.tree.map(jnp.add, p, u)
    for name, factored, by_param in (
        ("w", True, True),
        ("small", False, True),
        ("b", False, False),
    ):
        want = np_adafactor(
            params[name], [g[name] for g in grads], lr, beta1, factored, scale_by_param=by_param
        )
        np.testing.assert_allclose(p[name], want, rtol=2e-5, atol=1e-6)


def test_the_previous_token_prior_sets_only_distance_1_in_half_the_first_layers_heads():
    c = presets.PRESETS["synthetic"]
    params = mt.init_params(c, jax.random.PRNGKey(0))
    want = np.zeros((c.num_buckets, c.num_heads))
    want[1, : c.num_heads // 2] = c.init_prev_token_bias
    np.testing.assert_array_equal(params["layers"][0]["rel_bias"], want)
    assert not np.any(params["layers"][1]["rel_bias"])
    assert (
        int(mt.relative_position_bucket(-1, c.num_buckets, c.max_distance)) == 1
    )  # bucket 1 is distance 1


def test_the_gate_bias_flag_sets_every_memory_layers_initial_gate():
    args = train.build_parser().parse_args(
        [
            "--preset",
            "tiny",
            "--num-layers",
            "4",
            "--memory-layers",
            "1,3",
            "--init-gate-bias",
            "-2",
        ]
    )
    c = cli.config_from_args(args, presets.PRESETS["tiny"], "the tiny preset")
    params = mt.init_params(c, jax.random.PRNGKey(0))
    for i, layer in enumerate(params["layers"]):
        assert ("gate_bias" in layer) == (i in (1, 3))
        if i in (1, 3):
            np.testing.assert_array_equal(
                layer["gate_bias"], np.full(c.num_heads, -2.0, np.float32)
            )
            assert layer["gate_bias"].dtype == np.float32
    assert (
        mt.init_params(presets.PRESETS["tiny"], jax.random.PRNGKey(0))["layers"][1][
            "gate_bias"
        ].tolist()
        == [0.0] * 4
    )


def test_the_t5_bias_tables_take_the_plain_step():
    """A bias table starts at 0: it must move by lr_t a step, not by 1e-3 * lr_t (frozen)."""
    c = presets.PRESETS["tiny"].replace(vocab_size=64, num_layers=2, memory_layers=(1,))
    params = mt.init_params(c, jax.random.PRNGKey(0))
    init, update = optimizer.make_optimizer(c)
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    u, _ = jax.jit(update)(grads, init(params), params)  # one program, as in a train step
    lr = lambda t: float(optimizer.learning_rate(t, c.lr, c.warmup_steps))
    for i in range(c.num_layers):
        x, g = (
            np.asarray(params["layers"][i]["rel_bias"]),
            np.asarray(grads["layers"][i]["rel_bias"]),
        )
        want = np_adafactor(x, [g], lr, factored=False, scale_by_param=False) - x
        np.testing.assert_allclose(u["layers"][i]["rel_bias"], want, rtol=1e-5, atol=1e-9)
        # a weight matrix still steps relative to its scale
        w, uw = np.asarray(params["layers"][i]["w1"]), np.asarray(u["layers"][i]["w1"])
        assert np.sqrt(np.mean(uw**2)) <= lr(1) * np.sqrt(np.mean(w**2)) * 1.0001


def test_adafactor_is_finite_for_parameters_whose_gradient_is_zero():
    init, update = optimizer.adafactor(0.1)
    p = {"embed": jnp.ones((64, 48))}
    g = {"embed": jnp.zeros((64, 48)).at[0].set(1e-3)}  # most rows unused, as in an embedding
    u, _ = update(g, init(p), p)
    assert np.all(np.isfinite(u["embed"]))


def test_learning_rate_is_linear_warmup_then_square_root_decay():
    for t, want in [
        (1, 1 / 1000 / math.sqrt(1000)),
        (500, 0.5 / math.sqrt(1000)),
        (1000, 1 / math.sqrt(1000)),
        (4000, 1 / math.sqrt(4000)),
    ]:
        assert float(optimizer.learning_rate(t, 1.0, 1000)) == pytest.approx(want, rel=1e-6)


def test_evaluate_reports_reference_loss_by_distance_band():
    """The per-band losses of a batched evaluation equal those of each document alone."""

    c = presets.PRESETS["tiny"].replace(
        vocab_size=64,
        segment_length=16,
        memory_size=32,
        num_layers=2,
        memory_layers=(1,),
        num_neighbors=4,
    )
    params = mt.init_params(c, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, n).astype(np.int32) for n in (50, 90, 33)]  # rows switch documents
    dists = [rng.choice([0, 0, -1, 5, 16, 17, 32, 33, 80], len(d)) for d in docs]
    got = evaluation.evaluate(params, c, docs, 2, distances=dists)
    ce = np.concatenate(
        [evaluation.per_token_loss(params, c, d)[0] for d in docs]
    )  # ce[j] predicts token j + 1
    dist = np.concatenate([d[1:] for d in dists])
    assert got["loss"] == pytest.approx(ce.mean(), rel=1e-5)
    for band, sel in (
        ("near", (dist >= 1) & (dist <= 16)),
        ("mid", (dist > 16) & (dist <= 32)),
        ("far", dist > 32),
        ("", dist != 0),
    ):
        key = f"reference_loss_{band}".rstrip("_")
        assert got[key] == pytest.approx(ce[sel].mean(), rel=1e-5)
        assert got[key.replace("loss", "tokens")] == sel.sum()


# ----------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def run(out, cache, *extra):
    return train.main(FAST + ["--out", str(out), "--cache-dir", cache] + list(extra))


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_ops_plain_trains_the_model_files_own_pieces_to_the_losses_of_the_kernels(
    tmp_path, cache, capsys, monkeypatch
):
    """--ops plain runs memorizing_transformer.py's own pieces, what a reader edits; the
    default, kernels.py's drop-ins. A few steps both ways give the same losses and the same
    final evaluation, to float32 rounding; the run's first line says which pieces ran."""
    steps = ["--steps", "4", "--eval-every", "2"]
    assert run(tmp_path / "fast", cache, *steps) == 0
    monkeypatch.setattr(kernels, "fast", lambda *a: pytest.fail("a kernel in a plain run"))
    assert run(tmp_path / "plain", cache, *steps, "--ops", "plain") == 0
    out = capsys.readouterr().out
    assert "ops fast (kernels.py)" in out and "ops plain (memorizing_transformer.py)" in out
    fast, plain = losses(tmp_path / "fast"), losses(tmp_path / "plain")
    assert sorted(fast) == sorted(plain) == [1, 2, 3, 4]
    np.testing.assert_allclose([plain[s] for s in fast], list(fast.values()), rtol=1e-5)
    evals = [json.loads((tmp_path / d / "eval.json").read_text()) for d in ("fast", "plain")]
    assert evals[0]["loss"] == pytest.approx(evals[1]["loss"], rel=1e-5)
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["config"]["ops"] == "plain"


def test_the_cross_batch_ramp_grows_d_a_row_at_a_time_in_equal_stages():
    """cross_batch 4 over a ramp of 8000 steps: 2000 steps each of d = 1, 2, 3, then 4 from step
    8000 on; without a ramp, d from the first step. The reference writes the stages out."""
    c = presets.PRESETS["tiny"].replace(cross_batch=4, cross_batch_ramp=8000)
    stages = [1] * 2000 + [2] * 2000 + [3] * 2000 + [4] * 2000 + [4] * 4000
    assert [presets.cross_batch_at(c, s) for s in range(12000)] == stages
    flat = c.replace(cross_batch_ramp=0)
    assert {presets.cross_batch_at(flat, s) for s in range(0, 12000, 7)} == {4}


def test_a_ramped_run_trains_each_step_with_its_d_and_its_first_stage_as_a_plain_run(
    tmp_path, cache, monkeypatch
):
    """--cross-batch 2 --cross-batch-ramp 4: steps 1-2 search one row's memory, 3-6 two rows'.
    Each step runs the step compiled for its d, and the first stage's losses are those of a run
    without cross-batch, to the bit."""
    make = train.make_train_step
    used = []

    def spy(config, ops=None):
        step = make(config, ops)

        def recorded(*args):
            used.append(config.cross_batch)
            return step(*args)

        return recorded

    monkeypatch.setattr(train, "make_train_step", spy)
    steps = ["--steps", "6", "--eval-every", "100"]
    ramped = ["--cross-batch", "2", "--cross-batch-ramp", "4"]
    assert run(tmp_path / "ramp", cache, *steps, *ramped) == 0
    assert used == [1, 1, 2, 2, 2, 2]
    assert run(tmp_path / "plain", cache, *steps) == 0
    ramp, plain = losses(tmp_path / "ramp"), losses(tmp_path / "plain")
    assert [ramp[s] for s in (1, 2)] == [plain[s] for s in (1, 2)]
    assert ramp[3] != plain[3]  # two rows' memories from step 3 on


def test_resume_reproduces_the_uninterrupted_run(tmp_path, cache, monkeypatch):
    assert (
        run(tmp_path / "full", cache, "--steps", "8", "--save-every", "100", "--eval-every", "4")
        == 0
    )
    assert (
        run(tmp_path / "part", cache, "--steps", "3", "--save-every", "100", "--eval-every", "4")
        == 0
    )
    # Only --steps: the run's intervals go on (--log-every 1, --eval-every 4), not the defaults
    # (10 and 500), which once logged step 8 alone; and its --cache-dir, not the default .cache,
    # where its data were once tokenized again.
    monkeypatch.chdir(tmp_path)
    assert train.main(["--out", str(tmp_path / "part"), "--resume", "--steps", "8"]) == 0
    assert not (tmp_path / ".cache").exists()
    full, part = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert sorted(part) == list(range(1, 9))
    with open(tmp_path / "part" / "metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if "eval_loss" in r] == [
            3,
            4,
            8,
        ]  # 3: the first run's end
    np.testing.assert_allclose(
        [part[s] for s in range(1, 9)], [full[s] for s in range(1, 9)], rtol=1e-6
    )
    with open(tmp_path / "full" / "eval.json") as f:
        a = json.load(f)
    with open(tmp_path / "part" / "eval.json") as f:
        b = json.load(f)
    assert (
        a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)
        and a["tokens"] == b["tokens"] > 0
    )


def test_the_curves_evaluations_score_curve_tokens_and_the_final_one_whole_documents(
    tmp_path, cache, capsys
):
    """--eval-tokens 0 (the default): eval.json scores each validation document to its end; the
    evaluations every --eval-every steps score each one's first --curve-tokens targets."""
    flags = ["--steps", "2", "--eval-every", "1", "--eval-tokens", "0", "--curve-tokens", "40"]
    assert run(tmp_path / "r", cache, *flags) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("eval")]
    config, _, sp, run_args = evaluate.load_run(str(tmp_path / "r"))
    docs, _ = evaluate.validation_docs(
        argparse.Namespace(data=None, data_format=None), run_args, sp, config
    )
    whole = sum(len(d) - 1 for d in docs[:2])  # FAST's --eval-docs 2
    assert min(len(d) for d in docs[:2]) > 41 and whole > 80
    assert len(lines) == 2 and "| 80 tokens (" in lines[0]  # (none after the memory filled)
    assert f"| {whole} tokens (" in lines[1]
    assert json.loads((tmp_path / "r" / "eval.json").read_text())["tokens"] == whole


def test_memory_combine_is_a_flag_kept_in_the_run_and_its_ablation_turns_the_memory_off(
    tmp_path, cache
):
    assert run(tmp_path / "r", cache, "--steps", "2", "--memory-combine", "joint") == 0
    config = json.loads((tmp_path / "r" / "config.json").read_text())["config"]
    ev = json.loads((tmp_path / "r" / "eval.json").read_text())
    assert config["memory_combine"] == "joint"
    assert ev["loss"] != ev["loss_memory_off"]
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert not [k for l in lines for k in json.loads(l) if k.startswith("gate")]  # b_g: no gate


def test_init_from_loads_weights_into_a_larger_memory_and_into_a_memory_model(tmp_path, cache):
    assert run(tmp_path / "nomem", cache, "--steps", "2", "--memory-size", "0") == 0
    assert run(tmp_path / "mem", cache, "--steps", "2") == 0
    for src, out in (("mem", "bigger"), ("nomem", "added")):
        _, before = runs.load_checkpoint(str(tmp_path / src / "checkpoint.npz"))
        assert (
            run(
                tmp_path / out,
                cache,
                "--steps",
                "1",
                "--memory-size",
                "128",
                "--lr",
                "1e-9",
                "--init-from",
                str(tmp_path / src),
            )
            == 0
        )
        _, after = runs.load_checkpoint(str(tmp_path / out / "checkpoint.npz"))
        for k, v in before.items():
            if k.startswith("params"):  # copied (a step at lr 1e-9 moves nothing visibly)
                np.testing.assert_allclose(after[k], v, atol=1e-6, err_msg=k)
        gate = "params['layers'][1]['gate_bias']"
        assert gate in after and (src == "mem") == (gate in before)
        if src == "nomem":
            np.testing.assert_allclose(after[gate], 0.0, atol=1e-6)  # fresh: g = 0.5


def test_init_from_fine_tunes_on_from_the_checkpoints_step_and_optimizer_unless_fresh_start(
    tmp_path, cache, capsys
):
    """Sec. 4.4 fine-tunes "for an additional 20K steps": the step count (so the schedule, no
    second warmup) and Adafactor's statistics continue; --fresh-start restarts them."""
    assert run(tmp_path / "src", cache, "--steps", "3") == 0
    meta, src = runs.load_checkpoint(str(tmp_path / "src" / "checkpoint.npz"))
    assert meta["step"] == 3
    for extra, first in (([], 4), (["--fresh-start"], 1)):
        out = tmp_path / f"ft{first}"
        assert (
            run(
                out,
                cache,
                "--steps",
                "2",
                "--memory-size",
                "128",
                "--init-from",
                str(tmp_path / "src"),
                *extra,
            )
            == 0
        )
        with open(out / "metrics.jsonl") as f:
            logged = [r for r in map(json.loads, f) if "loss" in r]
        assert [r["step"] for r in logged] == [first, first + 1]
        lr = float(
            optimizer.learning_rate(
                first, presets.PRESETS["tiny"].lr, presets.PRESETS["tiny"].warmup_steps
            )
        )
        assert logged[0]["lr"] == pytest.approx(lr, rel=1e-6)
        _, after = runs.load_checkpoint(str(out / "checkpoint.npz"))
        assert int(after["opt['count']"]) == first + 1
        if first == 4:
            assert json.loads((out / "config.json").read_text())["config"]["steps"] == 5
    # Without --preset, the run's config (2 layers, T 32, k 8, batch 4: none of them tiny's) and
    # data (synthetic:40, 2 documents of 64 tokens to validate on) with the flags given. They
    # were once the preset's and the defaults: every flag of the source run had to be given
    # again, or the run was refused, or trained on stdlib.
    assert (
        train.main(
            [
                "--cache-dir",
                cache,
                "--out",
                str(tmp_path / "own"),
                "--init-from",
                str(tmp_path / "src"),
                "--steps",
                "1",
                "--memory-size",
                "128",
                "--num-neighbors",
                "4",
            ]
        )
        == 0
    )
    source, own = (runs.read_run_config(str(tmp_path / d)) for d in ("src", "own"))
    assert source["config"].segment_length != presets.PRESETS["tiny"].segment_length
    assert own["config"] == source["config"].replace(memory_size=128, num_neighbors=4, steps=4)
    assert {k: own["args"][k] for k in runs.RUN_DATA_ARGS} == {
        k: source["args"][k] for k in runs.RUN_DATA_ARGS
    }
    assert source["args"]["data"] == "synthetic:40"
    assert run(tmp_path / "bad", cache, "--fresh-start") == 2
    # The run's model as it is: not a layer more or fewer (once loaded or dropped without a word),
    # named by the configs' fields; and by the checkpoint's arrays where a config.json says
    # otherwise.
    for name, layers, memory_layers in (("edited", 3, [1]), ("edited_fewer", 1, [0])):
        shutil.copytree(tmp_path / "src", tmp_path / name)
        saved = json.loads((tmp_path / "src" / "config.json").read_text())
        saved["config"].update(num_layers=layers, memory_layers=memory_layers)
        (tmp_path / name / "config.json").write_text(json.dumps(saved))
    for src, layers, message in (
        ("src", ["--num-layers", "3"], "its num_layers 2 (this run: 3)"),
        ("src", ["--num-layers", "1", "--memory-layers", "0"], "its num_layers 2 (this run: 1)"),
        (
            "src",
            [
                "--preset",
                "tiny",
                "--num-layers",
                "2",
                "--memory-layers",
                "1",
                "--d-model",
                "64",
                "--head-dim",
                "16",
            ],
            "its d_model 128 (this run: 64), head_dim 32 (this run: 16)",
        ),
        ("edited", ["--num-layers", "3"], "has no params['layers'][2]['attn_norm']"),
        (
            "edited_fewer",
            ["--num-layers", "1", "--memory-layers", "0"],
            "has params['layers'][1]['attn_norm'], which this config has no place for",
        ),
    ):
        capsys.readouterr()
        assert run(tmp_path / "bad", cache, "--init-from", str(tmp_path / src), *layers) == 2
        err = capsys.readouterr().err
        assert message in err and "only memory may be added" in err and err.count("\n") == 1, err
        assert not (tmp_path / "bad").exists()
    # The source run's tokenizer, always (another --tokenizer was once dropped without a word).
    other = tmp_path / "other.model"
    other.write_bytes((tmp_path / "src" / "tokenizer.model").read_bytes())
    capsys.readouterr()
    assert (
        run(
            tmp_path / "bad", cache, "--init-from", str(tmp_path / "src"), "--tokenizer", str(other)
        )
        == 2
    )
    assert (
        "keeps its run's tokenizer" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    )


def test_fine_tuning_matches_adafactors_statistics_to_parameters_by_name():
    """A run without memory has no gate: adding one shifts every later parameter's place in
    Adafactor's lists, so the statistics must follow the names, not the places."""
    c0, c1 = presets.PRESETS["tiny"].replace(memory_size=0), presets.PRESETS["tiny"]
    p0, p1 = mt.init_params(c0, jax.random.PRNGKey(0)), mt.init_params(c1, jax.random.PRNGKey(0))
    init0, _ = optimizer.make_optimizer(c0)
    s0 = init0(p0)
    names0 = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(p0)[0]]
    s0 = {
        **s0,
        "count": jnp.int32(7),
        "v": [jax.tree.map(lambda x, i=i: x + i + 1, v) for i, v in enumerate(s0["v"])],
    }
    arrays = {f"opt{k}": v for k, v in runs._flat(s0).items()}
    got = runs.restore_optimizer(optimizer.make_optimizer(c1)[0](p1), p1, arrays, c0, "ckpt")
    assert int(got["count"]) == 7
    for (path, _), v in zip(jax.tree_util.tree_flatten_with_path(p1)[0], got["v"]):
        name = jax.tree_util.keystr(path)
        want = names0.index(name) + 1 if name in names0 else 0  # the gate is new: fresh zeros
        for x in jax.tree.leaves(v):
            np.testing.assert_array_equal(x, want, err_msg=name)


def test_a_killed_checkpoint_write_leaves_the_previous_checkpoint_loadable(
    tmp_path, cache, monkeypatch
):
    assert run(tmp_path / "r", cache, "--steps", "2") == 0
    path = str(tmp_path / "r" / "checkpoint.npz")
    with open(path, "rb") as f:
        good = f.read()

    def dies(*a, **k):
        raise KeyboardInterrupt  # a kill in the middle of writing the temporary file

    monkeypatch.setattr(np, "savez", dies)
    with pytest.raises(KeyboardInterrupt):
        runs.save_checkpoint(
            path, 3, {"a": np.zeros(2)}, {}, mt.init_state(presets.PRESETS["tiny"], 1), {}
        )
    with open(path, "rb") as f:
        assert f.read() == good
    assert sorted(os.listdir(tmp_path / "r")) == sorted(
        runs.RUN_FILES
    )  # its temporary file removed


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("smoke_run")
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--preset",
            "tiny",
            "--data",
            "synthetic:40",
            "--steps",
            "10",
            "--warmup-steps",
            "5",
            "--log-every",
            "5",
            "--out",
            str(tmp / "smoke"),
            "--cache-dir",
            str(tmp / "cache"),
        ],
        cwd=HERE,
        capture_output=True,
        text=True,
        env=child_env(),
    )
    return proc, tmp / "smoke"


def test_smoke_run_from_the_command_line_writes_a_valid_eval_json(smoke_run):
    proc, out = smoke_run
    assert proc.returncode == 0, proc.stderr
    with open(out / "eval.json") as f:
        ev = json.load(f)
    assert ev["step"] == 10 and ev["tokens"] > 0 and math.isfinite(ev["loss"])
    assert ev["perplexity"] == pytest.approx(math.exp(ev["loss"]))
    assert "perplexity_memory_off" in ev
    with open(out / "config.json") as f:
        assert json.load(f)["config"]["segment_length"] == presets.PRESETS["tiny"].segment_length
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [l["step"] for l in lines if "loss" in l] == [5, 10]
    assert [l for l in lines if "loss" in l][-1][
        "loss"
    ] < 7.0  # falling from ln(2048) = 7.6 at the start
    assert "step     10 | loss" in proc.stdout
    assert all(0 < l["gate_1"] < 1 for l in lines if "loss" in l) and " g1 0." in proc.stdout


@pytest.fixture(scope="session")
def three_runs_with_a_cache_dir(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("three_runs_with_a_cache_dir")
    """Three runs with one --cache-dir, the third with JAX_COMPILATION_CACHE_DIR naming another
    cache: each run's process and the --cache-dir's compiled programs after it."""

    def train_run(out, **env):
        proc = subprocess.run(
            [sys.executable, "train.py"]
            + FAST
            + ["--steps", "2", "--out", str(tmp / out), "--cache-dir", str(tmp / "cache")],
            cwd=HERE,
            capture_output=True,
            text=True,
            env=child_env(**env),
        )
        return proc, sorted(os.listdir(tmp / "cache" / "jax"))

    return tmp, [
        train_run("r1"),
        train_run("r2"),
        train_run("r3", JAX_COMPILATION_CACHE_DIR=str(tmp / "named")),
    ]


def test_a_second_run_loads_its_compiled_programs_from_the_cache_dir_and_gives_the_same_numbers(
    three_runs_with_a_cache_dir,
):
    """train.py keeps its compiled programs in --cache-dir's jax/ folder: a second run of the same
    config compiles nothing (no new entry) and gives the same numbers to the last digit; where
    JAX_COMPILATION_CACHE_DIR names a cache, that one is used instead."""
    tmp, runs = three_runs_with_a_cache_dir
    for proc, _ in runs:
        assert proc.returncode == 0, proc.stderr
    first, second = (
        (json.loads((tmp / out / "eval.json").read_text()), losses(tmp / out))
        for out in ("r1", "r2")
    )
    entries = runs[0][1]
    assert any(e.startswith("jit_step-") for e in entries), entries
    assert second == first and runs[1][1] == entries
    assert any(e.startswith("jit_step-") for e in os.listdir(tmp / "named"))
    assert runs[2][1] == entries


@pytest.fixture(scope="session")
def runs_on_cpu_devices(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("runs_on_cpu_devices")
    """FAST runs on 4 CPU devices, and where this session's backend is not a CPU on 1: each run's
    process and output directory, by number of devices."""

    def run_on(devices):
        env = child_env(
            JAX_PLATFORMS="cpu",  # the session's flags (conftest), and the devices
            XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={devices}",
        )
        proc = subprocess.run(
            [sys.executable, "train.py"]
            + FAST
            + ["--steps", "2", "--out", str(tmp / str(devices)), "--cache-dir", str(tmp / "cache")],
            cwd=HERE,
            capture_output=True,
            text=True,
            env=env,
        )
        return proc, tmp / str(devices)

    return {
        devices: run_on(devices) for devices in ([4] if jax.default_backend() == "cpu" else [1, 4])
    }


def test_a_sharded_step_on_4_devices_gives_the_same_loss_as_on_one(
    tmp_path, cache, runs_on_cpu_devices
):
    for devices, (proc, _) in runs_on_cpu_devices.items():
        assert proc.returncode == 0, proc.stderr
        assert f"x{devices}" in proc.stdout
    if (
        jax.default_backend() == "cpu"
    ):  # one CPU device: this process, whose step is compiled already
        assert run(tmp_path / "one", cache, "--steps", "2") == 0
        one = losses(tmp_path / "one")
    else:
        one = losses(runs_on_cpu_devices[1][1])
    four = losses(runs_on_cpu_devices[4][1])
    np.testing.assert_allclose([four[1], four[2]], [one[1], one[2]], rtol=1e-5)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "/no/such/path"], "does not exist"),
        (["--memory-size", "100"], "multiple of segment_length"),
        (["--num-neighbors", "128"], "num_neighbors"),
        (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
        (["--segment-length", "-4"], "--segment-length: must be a positive integer, got -4"),
        (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["--memory-layers", "9"], "out of range"),
        (["--eval-docs", "0"], "eval-docs"),
        (["--resume", "--init-from", "x"], "cannot be combined"),
        (["--min-doc-tokens", "100000"], "no document of at least 100000 tokens"),
        (["--data", "synthetic:0"], "synthetic:N"),
        (["--d-model", "100"], "must equal d_model (100)"),
        (["--memory-layers", "2"], "memory layer index 2 is out of range: num_layers is 2"),
        (
            ["--num-layers", "1", "--memory-layers", "1"],
            "out of range: num_layers is 1 and the indices are 0-based",
        ),  # (once "1 layers")
        (["--valid-fraction", "0.99"], "the corpus has 1 document, fewer than the 4 batch rows"),
        (["--suffixes", ".py,,.c"], "comma-separated file name endings"),
        (["--suffixes", ".py"], "--suffixes applies to a repository PATH"),
        (["--cross-batch-ramp", "8"], "cross_batch_ramp (8) needs a cross_batch above 1"),
    ],
)
def test_bad_flags_get_one_sentence_and_exit_code_2(tmp_path, cache, capsys, flags, message):
    assert run(tmp_path / "bad", cache, *flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_model_size_flags_set_the_config_and_the_parameter_shapes(tmp_path, cache):
    """Sec. 4.5 trains other sizes: every size field of Config has its flag (and the local
    attention's formulation, here the fused one, has one too)."""
    assert (
        run(
            tmp_path / "r",
            cache,
            "--steps",
            "1",
            "--d-model",
            "48",
            "--num-heads",
            "3",
            "--head-dim",
            "16",
            "--d-ff",
            "96",
            "--num-layers",
            "2",
            "--memory-layers",
            "1",
            "--vocab-size",
            "1024",
            "--attention",
            "fused",
        )
        == 0
    )
    with open(tmp_path / "r" / "config.json") as f:
        c = json.load(f)["config"]
    assert (
        c["d_model"],
        c["num_heads"],
        c["head_dim"],
        c["d_ff"],
        c["num_layers"],
        c["vocab_size"],
        c["attention"],
    ) == (48, 3, 16, 96, 2, 1024, "fused")
    _, arrays = runs.load_checkpoint(str(tmp_path / "r" / "checkpoint.npz"))
    assert arrays["params['embed']"].shape == (1024, 48) and arrays["params['w_out']"].shape == (
        48,
        1024,
    )
    assert arrays["params['layers'][1]['wq']"].shape == (48, 3, 16) and arrays[
        "params['layers'][1]['w1']"
    ].shape == (48, 96)
    assert "params['layers'][2]['wq']" not in arrays


def test_bad_files_get_one_sentence_and_exit_code_2(tmp_path, cache, capsys):
    (tmp_path / "bad.model").write_text("not sentencepiece")
    assert run(tmp_path / "a", cache, "--tokenizer", str(tmp_path / "bad.model")) == 2
    assert "not a SentencePiece model" in capsys.readouterr().err
    assert run(tmp_path / "nothing", cache, "--resume") == 2
    assert "no run to resume" in capsys.readouterr().err
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    assert run(tmp_path / "garbled", cache, "--resume") == 2
    assert "not a valid run config" in capsys.readouterr().err
    (tmp_path / "blocked").write_text("a file where the output directory should be")
    assert run(tmp_path / "blocked" / "out", cache) == 2
    assert "cannot write" in capsys.readouterr().err
    assert run(tmp_path / "r", cache, "--steps", "1") == 0
    ckpt = tmp_path / "r" / "checkpoint.npz"
    good = ckpt.read_bytes()
    ckpt.write_bytes(good[: len(good) // 2])  # truncated
    assert run(tmp_path / "r", cache, "--steps", "2", "--resume") == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    # A checkpoint of another config (M = 64) in a run whose config has M = 128: mismatched shapes.
    assert run(tmp_path / "r3", cache, "--steps", "1", "--memory-size", "128") == 0
    (tmp_path / "r3" / "checkpoint.npz").write_bytes(good)
    assert (
        train.main(
            ["--out", str(tmp_path / "r3"), "--cache-dir", cache, "--steps", "2", "--resume"]
        )
        == 2
    )
    assert "this config needs" in capsys.readouterr().err


def test_resume_refuses_a_flag_that_would_change_the_run_and_takes_one_that_would_not(
    tmp_path, cache, capsys, monkeypatch
):
    """--resume once ignored every model, training and data flag without a word (--lr 0.5 trained
    on at the run's own rate). Now such a flag is refused before anything is written, also at
    its default value (--data stdlib on a run of other data); one that repeats the run's value,
    or says how often to log, is taken."""
    out = tmp_path / "r"
    assert run(out, cache, "--steps", "1") == 0
    capsys.readouterr()
    other = tmp_path / "other.model"
    other.write_bytes((out / "tokenizer.model").read_bytes())
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    for flag in (
        ["--lr", "0.5"],
        ["--memory-size", "128"],
        ["--memory-layers", "0"],
        ["--seed", "3"],
        ["--no-xl-cache"],
        ["--dtype", "bfloat16"],
        ["--preset", "small"],
        ["--data", "synthetic:41"],
        ["--eval-docs", "3"],
        ["--tokenizer", str(other)],
        ["--data", "stdlib"],
    ):
        assert run(out, cache, "--steps", "2", "--resume", *flag) == 2, flag
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1 and " ".join(flag) + " would" in err and "would change it" in err
        ), (flag, err)
        assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before, flag
    same = [
        "--preset",
        "tiny",
        "--memory-layers",
        "1",
        "--memory-dtype",
        "float32",
        "--xl-cache",
        "--tokenizer",
        str(out / "tokenizer.model"),
        "--log-every",
        "2",
        "--save-every",
        "1",
    ]
    assert run(out, cache, "--steps", "2", "--resume", *same) == 0
    assert json.loads((out / "eval.json").read_text())["step"] == 2
    # A run of a relative --data path, resumed from another directory: named, not a bare "does not
    # exist".
    saved = json.loads((out / "config.json").read_text())
    saved["args"]["data"] = "corpus"
    (out / "config.json").write_text(json.dumps(saved))
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    assert train.main(["--out", str(out), "--resume", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"'corpus' does not exist from {tmp_path}" in err
        and "started in" in err
    ), err
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


def test_resume_takes_the_runs_data_directory_however_it_is_spelled(tmp_path, monkeypatch):
    """--data corpus on the command line that trained the run, --data ./corpus/ or a link to it on
    the one that resumes it: the same directory, taken. Another directory is refused, and so is
    a path that merely reads like the embedded corpus's name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "other").mkdir()
    os.symlink(tmp_path / "corpus", tmp_path / "link")
    config = presets.PRESETS["tiny"]

    def conflict(was, value):
        saved = {"config": config, "args": {"data": was}}
        return runs.resume_conflict(
            argparse.Namespace(data=value), saved, str(tmp_path / "run"), {"data"}
        )

    for same in ("corpus", "./corpus/", str(tmp_path / "corpus"), "link", "other/../corpus"):
        assert conflict("corpus", same) is None, same
    assert conflict("corpus", "other") == ("--data other", "corpus")
    assert conflict("stdlib", "stdlib") is None and conflict("synthetic:40", "synthetic:40") is None
    (tmp_path / "stdlib").mkdir()
    assert conflict("stdlib", "./stdlib") == ("--data ./stdlib", "stdlib")
    assert conflict("./stdlib", "stdlib") == ("--data stdlib", "./stdlib")
    assert conflict("synthetic:40", "synthetic:41") == ("--data synthetic:41", "synthetic:40")


# ----------------------------------------------------------------------------- interruptions
def start(out, cache, *extra):
    """train.py with FAST in a subprocess, from an early job (so with child_env())."""
    return subprocess.Popen(
        [sys.executable, "train.py"]
        + FAST
        + ["--out", str(out), "--cache-dir", cache]
        + list(extra),
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def ending(proc):
    """A process's exit code and stderr, once it ends. Its pipes are read meanwhile: a process
    that went on printing past a pipe's buffer (64 KiB) would wait for a reader forever (an
    interrupted train.py that trained on instead, seen on an H200, hung a test for 120 s)."""
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1]) >= step:
            return
    raise AssertionError(f"train.py ended before step {step}: {proc.stderr.read()}")


@pytest.fixture(scope="session")
def run_stopped_by_ctrl_c(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("run_stopped_by_ctrl_c")
    """A run that saves only when stopped, stopped by SIGINT after its third step: its exit code,
    stderr and directory, and its cache."""
    proc = start(tmp / "r", str(tmp / "cache"), "--steps", "100000", "--save-every", "100000")
    wait_for_step(proc, 3)
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=60), proc.stderr.read(), tmp / "r", str(tmp / "cache")


def test_sigint_saves_a_checkpoint_and_resume_matches_the_uninterrupted_run(
    tmp_path, cache, run_stopped_by_ctrl_c
):
    code, err, out, its_cache = run_stopped_by_ctrl_c
    assert code == 130 and "interrupted at step" in err
    meta, _ = runs.load_checkpoint(str(out / "checkpoint.npz"))
    k = meta["step"]
    assert run(out, its_cache, "--steps", str(k + 3), "--resume") == 0
    assert run(tmp_path / "full", cache, "--steps", str(k + 3), "--save-every", "100000") == 0
    got, want = losses(out), losses(tmp_path / "full")
    np.testing.assert_allclose(
        [got[s] for s in range(1, k + 4)], [want[s] for s in range(1, k + 4)], rtol=1e-6
    )


@pytest.fixture(scope="session")
def run_killed_at_random_points(tmp_path_factory, runs_commands):
    tmp = tmp_path_factory.mktemp("run_killed_at_random_points")
    """A run's first checkpoint, then three times: resumed, saving at every step, and killed
    (SIGKILL) 0-0.5 s after a step. The first run's ending, what loading the checkpoint gave
    after each kill (its metadata, or the exception), the run's directory and its cache."""
    rng = np.random.default_rng(0)
    out, cache = tmp / "r", str(tmp / "cache")
    first = ending(start(out, cache, "--steps", "1", "--save-every", "1"))
    loaded = []
    for _ in range(3):
        proc = start(out, cache, "--steps", "100000", "--resume", "--save-every", "1")
        wait_for_step(proc, 1)
        time.sleep(rng.uniform(0.0, 0.5))  # saves happen every step: often mid-write
        proc.kill()
        proc.wait()
        try:
            loaded.append(runs.load_checkpoint(str(out / "checkpoint.npz"))[0])
        except Exception as e:  # noqa: BLE001  (the test names it)
            loaded.append(e)
    return first, loaded, out, cache


def test_kill_9_at_random_points_never_loses_the_last_checkpoint(
    tmp_path, cache, run_killed_at_random_points
):
    (code, err), loaded, out, its_cache = run_killed_at_random_points
    assert code == 0, err  # a first checkpoint
    for meta in loaded:  # loadable, whatever the timing
        assert isinstance(meta, dict) and meta["step"] >= 1, meta
    k = runs.load_checkpoint(str(out / "checkpoint.npz"))[0]["step"]
    # What a kill during a save leaves (a checkpoint-sized file each time, once kept forever),
    # by the names atomic_write gives (and gave), goes at the next resume; other files stay.
    left = [
        ".checkpoint.npz.k1ll3d_x.partial",
        ".metrics.jsonl.abcdefgh.partial",
        "tmpk1ll3d_x.tmp",
    ]
    for name in left + ["notes.tmp", ".checkpoint.npz.mine.partial"]:
        (out / name).write_bytes(b"x")
    assert run(out, its_cache, "--steps", str(k + 2), "--resume") == 0
    assert sorted(os.listdir(out)) == sorted(
        list(runs.RUN_FILES) + ["notes.tmp", ".checkpoint.npz.mine.partial"]
    )
    assert run(tmp_path / "full", cache, "--steps", str(k + 2), "--save-every", "100000") == 0
    got, want = losses(out), losses(tmp_path / "full")
    np.testing.assert_allclose(
        [got[s] for s in range(1, k + 3)], [want[s] for s in range(1, k + 3)], rtol=1e-6
    )


def test_a_non_finite_loss_stops_training_naming_the_step_and_keeps_the_last_checkpoint(
    tmp_path, cache, capsys
):
    out = tmp_path / "r"
    assert run(out, cache, "--steps", "2") == 0
    # Weights near the float32 limit: the next forward pass overflows.
    meta, arrays = runs.load_checkpoint(str(out / "checkpoint.npz"))
    arrays = {
        k: (v * 1e37 if k.startswith("params") and k.endswith("['wq']") else v)
        for k, v in arrays.items()
    }
    np.savez(
        out / "checkpoint.npz",
        __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        **arrays,
    )
    before = (out / "checkpoint.npz").read_bytes()
    assert run(out, cache, "--steps", "5", "--resume", "--save-every", "1") == 3
    err = capsys.readouterr().err
    assert "non-finite at step 3;" in err and "is kept" in err and err.count("\n") == 1
    assert (out / "checkpoint.npz").read_bytes() == before


def test_after_a_reset_no_array_of_the_row_in_a_checkpoint_holds_the_finished_document(tmp_path):
    """Ethics section: clearing the memory at a document's end must clear it physically. Row 0
    reads a secret document of 3 segments, then starts another; every key and value vector
    the secret produced (any layer) is searched for in row 0 of every saved state array."""
    cfg = presets.RunConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        d_ff=48,
        segment_length=8,
        memory_layers=(1,),
        memory_size=32,
        num_neighbors=4,
        batch_size=2,
    )
    params = mt.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    fwd = jax.jit(mt.forward, static_argnums=4)
    state, secret = mt.init_state(cfg, 2), set()
    for n in range(3):
        _, state = fwd(params, state, rng.integers(0, 64, (2, 8)), jnp.full(2, n == 0), cfg)
        for a in (state.prev_k, state.prev_v):  # every layer's keys and values of the segment
            secret |= {v.tobytes() for v in np.asarray(a[0]).reshape(-1, cfg.head_dim)}
    _, state = fwd(params, state, rng.integers(0, 64, (2, 8)), jnp.array([True, False]), cfg)
    path = str(tmp_path / "checkpoint.npz")
    runs.save_checkpoint(path, 4, params, {}, state, {})
    _, arrays = runs.load_checkpoint(path)
    found, rows_1 = [], 0
    for name, a in arrays.items():
        if name.startswith("state") and a.dtype == np.float32:
            found += [name for v in a[0].reshape(-1, cfg.head_dim) if v.tobytes() in secret]
            rows_1 += sum(v.any() for v in a[1].reshape(-1, cfg.head_dim))
    assert not found, sorted(set(found))
    assert rows_1 > 0  # the other row keeps its document


@pytest.mark.parametrize("memory_size,xl_cache", [(16, True), (0, False)])
def test_gradient_accumulation_gives_the_same_step_as_one_big_batch(memory_size, xl_cache):
    """Also without a memory and an XL cache, whose state arrays then have a length of 0 (their
    micro-batches were once put back together with a reshape that divides by it)."""
    cfg = presets.RunConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        d_ff=48,
        segment_length=8,
        memory_layers=(1,),
        memory_size=memory_size,
        num_neighbors=4,
        batch_size=4,
        warmup_steps=1,
        xl_cache=xl_cache,
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 8)).astype(np.int32)
    mask = rng.random((4, 8)) < 0.8
    batch = {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, 1),
        "mask": mask,
        "reset": np.ones(4, bool),
    }
    results = []
    for accum in (1, 2):
        c = cfg.replace(grad_accum=accum)
        params = mt.init_params(c, jax.random.PRNGKey(0))
        out = train.make_train_step(c)(
            params, optimizer.make_optimizer(c)[0](params), mt.init_state(c, 4), batch
        )
        results.append(jax.device_get(out))
    (p1, _, s1, m1), (p2, _, s2, m2) = results
    assert (
        m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
        and m1["tokens"] == m2["tokens"] == mask.sum()
    )
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(s1, s2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_run_compiles_its_train_step_once():
    """The step's outputs have the types of its inputs, so feeding them back never recompiles.
    (Parameters made with a Python float, e.g. jnp.full(shape, 5.66), are 'weakly typed' float32,
    a different input type from the step's float32 output: every run compiled its step twice.)"""
    c = presets.RunConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=2,
        head_dim=16,
        d_ff=48,
        segment_length=8,
        memory_layers=(1,),
        memory_size=16,
        num_neighbors=4,
        batch_size=4,
        warmup_steps=1,
    )
    tokens = np.random.default_rng(0).integers(0, 64, (4, 8)).astype(np.int32)
    batch = {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, 1),
        "mask": np.ones((4, 8), bool),
        "reset": np.zeros(4, bool),
    }
    step = train.make_train_step.__wrapped__(c)  # a fresh jit, not the one other tests share
    params = mt.init_params(c, jax.random.PRNGKey(0))
    carry = (params, optimizer.make_optimizer(c)[0](params), mt.init_state(c, 4))
    for _ in range(3):
        carry = step(*carry, batch)[:3]
    assert step._cache_size() == 1


def test_a_run_that_reads_its_training_tokens_more_than_once_says_how_many_times(capsys):
    import types

    run = lambda steps, dropout=0.0: types.SimpleNamespace(
        config=presets.PRESETS["tiny"].replace(steps=steps, dropout=dropout),
        train_docs=[np.zeros(1000)] * 4096,
    )  # 4.096M tokens; a step reads 8 x 128 of them
    train.note_repeats(run(10000))  # 10.24M tokens read: 2.5 times
    out = capsys.readouterr().out
    assert "read the 4.10M training tokens 2.5 times" in out and "--dropout" in out
    train.note_repeats(run(10000, dropout=0.1))  # it is already given: no advice
    out = capsys.readouterr().out
    assert "2.5 times" in out and "--dropout" not in out
    train.note_repeats(run(4000))  # 4.096M: once
    assert capsys.readouterr().out == ""

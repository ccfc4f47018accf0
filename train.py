"""Train a Memorizing Transformer (Sec. 4.2): Adafactor, the schedule, the steps and the loop.

  python train.py                              # the tiny preset on the stdlib, minutes on a CPU
  python train.py --preset small --data PATH   # one GPU
  python train.py --out runs/a --resume        # continue an interrupted run exactly
  python train.py --init-from runs/a --memory-size 2048 --steps 200   # fine-tune (Sec. 4.4)
  python train.py --out runs/b --coordinator HOST:PORT --num-processes 2 --process-id 0

A run writes config.json, metrics.jsonl (one JSON object per logged step and per evaluation),
eval.json, tokenizer.model and checkpoint.npz to --out; runs.py does the files, flags and signals.
"""

import startup  # first: before JAX loads (malloc on a CPU; an early Ctrl-C leaves in one line)

if __name__ == "__main__":
    startup.leave_on_early_signals()

import contextlib
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import data
import kernels
import memorizing_transformer as mt
import multihost
import runs


# ----------------------------------------------------------------------------- Adafactor
def adafactor(
    learning_rate,
    decay_rate=0.8,
    eps1=1e-30,
    eps2=1e-3,
    clip_threshold=1.0,
    beta1=None,
    multiply_by_parameter_scale=True,
    min_dim_size_to_factor=32,
    plain=None,
):
    """Adafactor (Shazeer & Stern, 2018) with optax's (init, update) convention.

    For a gradient G at step t (from 1), with beta2_t = 1 - t^(-decay_rate):
      factored (rank >= 2, the two largest axes r, c both >= min_dim_size_to_factor):
        R = beta2 R + (1 - beta2) mean_c(G^2 + eps1);  C = beta2 C + (1 - beta2) mean_r(G^2 + eps1)
        V = R C / mean_r(R)
      otherwise V = beta2 V + (1 - beta2) (G^2 + eps1)
      U = G / sqrt(V);  U = U / max(1, RMS(U) / clip_threshold)          (update clipping)
      with beta1: M = beta1 M + (1 - beta1) U, and U = M
      update = -lr_t * max(eps2, RMS(X)) * U    (relative to the parameter's scale, rank >= 2)
    Vectors (norm weights, gate biases, q/k scales), and the leaves that `plain` (a pytree of bools
    shaped like the params) marks, take the plain step -lr_t * U: their scale says nothing about a
    good step. learning_rate is a number or a function of the step t.
    """
    lr_fn = learning_rate if callable(learning_rate) else (lambda t: learning_rate)

    def axes(x):
        if x.ndim < 2:
            return None
        r, c = sorted(np.argsort(x.shape, kind="stable")[-2:])
        return (int(r), int(c)) if min(x.shape[r], x.shape[c]) >= min_dim_size_to_factor else None

    @jax.jit  # zeros only: one compiled program makes them all
    def init(params):
        leaves = jax.tree.leaves(params)
        v = []
        for x in leaves:
            ax = axes(x)
            if ax is None:
                v.append({"v": jnp.zeros_like(x)})
            else:
                v.append(
                    {
                        "r": jnp.zeros_like(jnp.mean(x, axis=ax[1], keepdims=True)),
                        "c": jnp.zeros_like(jnp.mean(x, axis=ax[0], keepdims=True)),
                    }
                )
        m = [jnp.zeros_like(x) for x in leaves] if beta1 is not None else None
        return {"count": jnp.zeros((), jnp.int32), "v": v, "m": m}

    def update(grads, state, params):
        t = state["count"] + 1
        beta2 = 1.0 - t.astype(jnp.float32) ** -decay_rate
        lr = lr_fn(t)
        g_leaves, treedef = jax.tree.flatten(grads)
        p_leaves = jax.tree.leaves(params)
        plain_leaves = jax.tree.leaves(plain) if plain is not None else [False] * len(p_leaves)
        new_v, new_m, updates = [], [], []
        for i, (g, x) in enumerate(zip(g_leaves, p_leaves)):
            g2 = g * g + eps1
            ax = axes(x)
            if ax is None:
                v = beta2 * state["v"][i]["v"] + (1 - beta2) * g2
                new_v.append({"v": v})
            else:
                r = beta2 * state["v"][i]["r"] + (1 - beta2) * jnp.mean(
                    g2, axis=ax[1], keepdims=True
                )
                c = beta2 * state["v"][i]["c"] + (1 - beta2) * jnp.mean(
                    g2, axis=ax[0], keepdims=True
                )
                new_v.append({"r": r, "c": c})
                v = (r / jnp.mean(r, axis=ax[0], keepdims=True)) * c  # this order never underflows
            u = g * jax.lax.rsqrt(v)
            u = u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(u * u)) / clip_threshold)
            if beta1 is not None:
                u = beta1 * state["m"][i] + (1 - beta1) * u
                new_m.append(u)
            scale = lr
            if multiply_by_parameter_scale and x.ndim >= 2 and not plain_leaves[i]:
                scale = lr * jnp.maximum(eps2, jnp.sqrt(jnp.mean(x * x)))
            updates.append(-scale * u)
        return jax.tree.unflatten(treedef, updates), {
            "count": t,
            "v": new_v,
            "m": new_m if beta1 is not None else None,
        }

    return init, update


def learning_rate(step, base_lr, warmup_steps):
    """Sec. 4.2: linear warmup, then square-root decay: base * min(1, t/W) / sqrt(max(t, W))."""
    t = jnp.asarray(step, jnp.float32)
    w = max(warmup_steps, 1)
    return base_lr * jnp.minimum(1.0, t / w) * jax.lax.rsqrt(jnp.maximum(t, float(w)))


def make_optimizer(config):
    """Adafactor on the schedule. The T5 bias tables take the plain step: they start at 0, where a
    step relative to their scale would leave them, and the model's only position signal, frozen."""
    shapes = jax.eval_shape(lambda: mt.init_params(config, jax.random.PRNGKey(0)))
    plain = jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) == "rel_bias" for k in path), shapes
    )
    return adafactor(lambda t: learning_rate(t, config.lr, config.warmup_steps), plain=plain)


# ----------------------------------------------------------------------------- the steps
def step_config(config):
    """The fields a compiled step depends on: runs that differ only in steps or seed share it."""
    return config.replace(steps=1, seed=0)


@functools.lru_cache(maxsize=8)
def make_train_step(config, ops=kernels.FAST):
    """One jitted step: forward over a segment of every row, carry the state, update the params.
    With grad_accum > 1 the rows are split into micro-batches (each with its own memories) and the
    gradients summed over all tokens before one update. The buffers are donated, so the memory is
    updated in place."""
    _, opt_update = make_optimizer(config)

    def summed_loss(params, state, batch):
        logits, new_state = mt.forward(
            params, state, batch["tokens"], batch["reset"], config, mask=batch["mask"], ops=ops
        )
        m = batch["mask"].astype(jnp.float32)
        return jnp.sum(mt.cross_entropy(logits, batch["targets"]) * m), (new_state, jnp.sum(m))

    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)

    def step(params, opt_state, state, batch):
        A = config.grad_accum
        if A == 1:
            (total, (state, n)), grads = grad_fn(params, state, batch)
        else:
            # Micro-batch a takes the a-th A-th of every device's rows, so that no row, and no
            # memory, leaves its device: [B, ...] -> [devices, A, B/(devices A), ...] -> [A, B/A,
            # ...] (on one device, a reshape). The sizes are written out: a state of length 0 has
            # no -1 to infer.
            B, devices = config.batch_size, jax.device_count()
            rows = B // (devices * A)  # of one device in one micro-batch

            def split(x):  # [B, ...] -> [A, B/A, ...]
                x = x.reshape((devices, A, rows) + x.shape[1:]).swapaxes(0, 1)
                return x.reshape((A, B // A) + x.shape[3:])

            def merge(x):  # [A, B/A, ...] -> [B, ...]
                x = x.reshape((A, devices, rows) + x.shape[2:]).swapaxes(0, 1)
                return x.reshape((B,) + x.shape[3:])

            def micro(acc, xs):
                (l, (s, n)), g = grad_fn(params, xs[0], xs[1])
                return jax.tree.map(jnp.add, acc, (l, n, g)), s

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (total, n, grads), states = jax.lax.scan(
                micro, zeros, (jax.tree.map(split, state), jax.tree.map(split, batch))
            )
            state = jax.tree.map(merge, states)
        n = jnp.maximum(n, 1.0)
        updates, opt_state = opt_update(jax.tree.map(lambda g: g / n, grads), opt_state, params)
        params = jax.tree.map(jnp.add, params, updates)
        finite = jnp.isfinite(total) & jnp.all(
            jnp.array([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)])
        )
        metrics = {"loss": total / n, "tokens": n, "finite": finite}
        gated = config.active_memory_layers if config.memory_combine == "gate" else ()
        for i in gated:  # in add and joint, b_g is a constant, not a gate
            metrics[f"gate_{i}"] = jnp.mean(jax.nn.sigmoid(params["layers"][i]["gate_bias"]))
        if config.active_memory_layers:
            metrics["memory_fill"] = jnp.mean(state.mem_valid)
        return params, opt_state, state, metrics

    return jax.jit(step, donate_argnums=(0, 1, 2))


MODEL_INPUTS = ("tokens", "targets", "mask", "reset")


def model_inputs(batch):
    """The arrays of a batch that the steps take (data.py adds doc and offset, to read by)."""
    return {k: batch[k] for k in MODEL_INPUTS}


@functools.lru_cache(maxsize=16)
def make_forward_step(config, donate=True, logits=False, retrievals=False, ops=kernels.FAST):
    """forward over a segment of every row, jitted once per config, for training's evaluation,
    evaluate.py and sample.py: (params, state, batch) -> (state, cross-entropy [B, T] (0 on
    padding), logits [B, T, V] or None, retrievals or None). donate=False keeps the state given."""

    def step(params, state, batch):
        tokens, reset, mask = batch["tokens"], batch["reset"], batch["mask"]
        out, state, found = mt.forward(
            params, state, tokens, reset, config, mask=mask, return_retrievals=True, ops=ops
        )
        ce = mt.cross_entropy(out, batch["targets"]) * mask  # [B, T]
        return state, ce, out if logits else None, found if retrievals else None

    return jax.jit(step, donate_argnums=(1,) if donate else ())


# ----------------------------------------------------------------------------- evaluation
# How far back a reference's value last appeared, in segments: within the local window, beyond it
# but within 2 segments, or more than 2 back (only the memory reaches it).
DISTANCE_BANDS = {"near": (0, 1), "mid": (1, 2), "far": (2, float("inf"))}  # (lo, hi]


def evaluate(params, config, docs, batch_size, eval_step=None, distances=None, band_memory=None):
    """Token-level validation loss, each document from its start with a fresh memory, and the
    loss in each of data.REPEAT_BANDS (far_repeat_loss, far_repeat_tokens, ...), by the reach of
    a memory of band_memory slots (default: the config's). distances (synthetic data, per
    document): how far back each reference token's value last appeared; the result then also
    has the loss on the references in each band, e.g. reference_loss_far."""
    eval_step = eval_step or make_forward_step(step_config(config))
    rows = max(1, min(batch_size, len(docs)))
    state = mt.init_state(config, rows)
    window = config.segment_length + config.cache_length
    memory = config.memory_size if band_memory is None else band_memory
    bands = [data.repeat_bands(doc, window, memory) for doc in docs]  # per target
    total, count, full, ref_ce, ref_dist, band_ce, band_of = 0.0, 0, 0, [], [], [], []
    batches = data.SegmentBatches(docs, rows, config.segment_length, epochs=1)
    for i, batch in enumerate(batches):
        state, ce, _, _ = eval_step(params, state, model_inputs(batch))
        ce = np.asarray(ce, np.float64)
        if i == 0:  # the step is compiled (if it was not before): take the compiler's holes
            startup.fill_heap_holes()
        total, count = total + float(ce.sum()), count + int(batch["mask"].sum())
        for b in range(rows):
            n = int(batch["mask"][b].sum())
            if not n:
                continue
            d, off = batch["doc"][b], batch["offset"][b]  # target j here: doc token off + 1 + j
            full += n if off >= config.memory_size else 0  # the memory holds tokens [0, off)
            band_ce.append(ce[b, :n])
            band_of.append(bands[d][off : off + n])
            if distances is not None:
                ref_ce.append(ce[b, :n])
                ref_dist.append(distances[d][off + 1 : off + 1 + n])
    loss = total / max(count, 1)
    result = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
    if config.active_memory_layers:
        result["tokens_memory_full"] = full  # scored after the memory's M slots had filled
    if band_ce:
        ce, band = np.concatenate(band_ce), np.concatenate(band_of)
        for name in data.REPEAT_BANDS:
            if np.any(band == name):
                result[f"{name}_loss"] = float(ce[band == name].mean())
            result[f"{name}_tokens"] = int(np.sum(band == name))
    if ref_ce:
        ce, dist = np.concatenate(ref_ce), np.concatenate(ref_dist)
        result.update(
            reference_loss=float(ce[dist != 0].mean()), reference_tokens=int((dist != 0).sum())
        )
        for band, (lo, hi) in DISTANCE_BANDS.items():
            sel = (dist > lo * config.segment_length) & (dist <= hi * config.segment_length)
            if sel.any():
                result[f"reference_loss_{band}"] = float(ce[sel].mean())
                result[f"reference_tokens_{band}"] = int(sel.sum())
    return result


def full_evaluation(params, config, docs, distances, eval_step, band_memory=None):
    """evaluate(), and for a memory model the memory-off ablation's loss, perplexity, band and
    reference losses under the same names with a _memory_off suffix."""
    B = config.batch_size
    result = evaluate(params, config, docs, B, eval_step, distances, band_memory)
    if config.active_memory_layers:
        off = evaluate(mt.memory_off(params), config, docs, B, eval_step, distances, band_memory)
        for k, v in off.items():
            if k in ("loss", "perplexity") or k.endswith("_loss") or k.startswith("reference_loss"):
                result[f"{k}_memory_off"] = v
    return result


def format_eval(step, r):
    """The printed line of an evaluation: loss, perplexity, memory off, the far-repeat tokens'
    loss (only the memory reaches them), reference losses; each with the memory off beside it."""
    off = f" (memory off {r['perplexity_memory_off']:.2f})" if "perplexity_memory_off" in r else ""
    line = f"eval {step:6d} | loss {r['loss']:.4f} | ppl {r['perplexity']:9.2f}{off}"
    parts = [("far-repeat", "far_repeat_loss")]
    parts += [(f"ref {b}", f"reference_loss_{b}") for b in DISTANCE_BANDS]
    for label, key in parts:
        if key in r:
            line += f" | {label} {r[key]:.3f}"
            line += f" (off {r[key + '_memory_off']:.3f})" if key + "_memory_off" in r else ""
    return f"{line} | {scored(r)}"


def scored(r):
    """How many tokens an evaluation scored, and how many after the memory was full."""
    full = r.get("tokens_memory_full")
    tokens = data.plural(r["tokens"], "token")
    return tokens + ("" if full is None else f" ({full} after the memory filled)")


def eval_record(step, r):
    """An evaluation as one metrics.jsonl record."""
    return {
        "step": step,
        "eval_loss": r["loss"],
        "eval_perplexity": r["perplexity"],
        **{
            k: v
            for k, v in r.items()
            if k.startswith(("reference_loss", "perplexity_memory_off", *data.REPEAT_BANDS))
        },
    }


# ----------------------------------------------------------------------------- the run
def log_step(log, step, metrics, config, tokens_per_s):
    """One training line: to metrics.jsonl (JSON) and to stdout."""
    rec = {
        "step": step,
        "loss": float(metrics["loss"]),
        "perplexity": math.exp(min(float(metrics["loss"]), 50)),
        "lr": float(learning_rate(step, config.lr, config.warmup_steps)),
        "tokens_per_s": tokens_per_s,
    }
    rec.update({k: float(v) for k, v in metrics.items() if k.startswith(("gate", "memory"))})
    log.write(json.dumps(rec) + "\n")
    log.flush()
    gates = " ".join(f"g{k[5:]} {v:.3f}" for k, v in rec.items() if k.startswith("gate_"))
    fill = f" fill {rec['memory_fill']:.2f}" if "memory_fill" in rec else ""
    print(
        f"step {step:6d} | loss {rec['loss']:.4f} | ppl {rec['perplexity']:9.2f} | lr "
        f"{rec['lr']:.2e} | "
        f"{rec['tokens_per_s']:8.0f} tok/s{fill} {gates}",
        flush=True,
    )


def train(args, given):
    """Join the run's other processes, if any (multihost.py), train, and leave together."""
    multihost.start(args)
    try:
        with contextlib.ExitStack() as quiet:
            if not multihost.is_main():  # process 0 prints the run's lines
                quiet.enter_context(
                    contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w")))
                )
            return train_run(args, given)
    finally:
        multihost.stop()


def fresh_start(config):
    """New parameters and optimizer state for the run's config and seed."""
    params = mt.init_params(config, jax.random.PRNGKey(config.seed))
    return params, make_optimizer(config)[0](params)


def train_run(args, given):
    """Train to config.steps from runs.open_run's start, saving every --save-every steps and on
    Ctrl-C, then evaluate. given: the flags argv gave. Only process 0 writes."""
    t_start, is_main = time.time(), multihost.is_main()
    with contextlib.ExitStack() as held:  # the run directory's lock
        run = runs.open_run(args, given, held, fresh_start)  # every check, before any write
        if run.done:
            print(
                f"{run.out} finished at step {run.step} (eval.json): nothing to do; give "
                "--steps to train further."
            )
            return 0
        config, out, stream, step = run.config, run.out, run.stream, run.step
        params, opt_state, state, place = multihost.distribute(run.params, run.opt_state, run.state)
        train_step = make_train_step(step_config(config))
        eval_step = make_forward_step(step_config(config))
        curve_docs = data.first_tokens(run.valid_docs, args.curve_tokens)  # the learning curve's
        curve_distances = run.distances and data.first_tokens(run.distances, args.curve_tokens)
        print(describe(run, params), flush=True)
        runs.note_unused_pieces(run.tok_path, config.vocab_size)
        ckpt_path = os.path.join(out, "checkpoint.npz")
        tok_hash = data.file_hash(run.tok_path)
        metrics_path = os.path.join(out, "metrics.jsonl") if is_main else os.devnull
        with runs.interrupt_flag() as stop, open(metrics_path, "a") as log:
            t_log, tokens_since = time.time(), 0
            while step < config.steps:
                batch = next(stream)
                data.check_tokens(batch["tokens"], config.vocab_size)
                inputs = place(model_inputs(batch))
                params, opt_state, state, metrics = train_step(params, opt_state, state, inputs)
                step += 1
                metrics = multihost.gather(metrics)
                if step == run.step + 1:  # compiled: the heap is full of the compiler's holes
                    startup.fill_heap_holes()
                if not metrics["finite"]:  # a non-finite loss, or weights that overflowed
                    runs.say(
                        f"error: the loss or the weights became non-finite at step {step}; "
                        f"stopped, the last checkpoint ({ckpt_path}) is kept."
                    )
                    return 3
                stopping = multihost.any_of(stop["signal"])  # a Ctrl-C on one stops them all
                tokens_since += int(metrics["tokens"])
                if step % args.log_every == 0 or step == config.steps:
                    log_step(log, step, metrics, config, tokens_since / (time.time() - t_log))
                    t_log, tokens_since = time.time(), 0
                if args.eval_every and step % args.eval_every == 0 and step < config.steps:
                    r = full_evaluation(params, config, curve_docs, curve_distances, eval_step)
                    print(format_eval(step, r), flush=True)
                    log.write(json.dumps(eval_record(step, r)) + "\n")
                if step % args.save_every == 0 or step == config.steps or stopping:
                    whole = multihost.gather((params, opt_state, state))  # every process's rows
                    if is_main:  # (the first checkpoint that cannot be written undoes the run)
                        position = stream.position()
                        save = (step, *whole, position, run.documents, tok_hash)
                        runs.save_first_or_undo(out, run.step, ckpt_path, *save)
                if stopping:
                    runs.say(
                        f"interrupted at step {step}: checkpoint saved to {ckpt_path}; "
                        f"continue with --out {out} --resume"
                    )
                    return 130
        try:
            result = full_evaluation(params, config, run.valid_docs, run.distances, eval_step)
        except KeyboardInterrupt:
            runs.say(
                f"interrupted during the final evaluation; the checkpoint of step {step} is "
                f"saved: --out {out} --resume evaluates it."
            )
            return 130
        result = {"step": step, **result}
        if is_main:
            with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(eval_record(step, result)) + "\n")
            runs.atomic_write(os.path.join(out, "eval.json"), runs.json_text(result))
        print(
            f"{format_eval(step, result)} | {time.time() - t_start:.0f} s total | {out}/eval.json",
            flush=True,
        )
        return 0


def describe(run, params):
    """The run's first line: its size, data, devices and memory."""
    c = run.config
    processes = f" in {jax.process_count()} processes" if multihost.several() else ""
    size = sum(x.size for x in jax.tree.leaves(params)) / 1e6
    tokens = sum(map(len, run.train_docs)) / 1e6
    return (
        f"run {run.out}: {size:.2f}M params, {tokens:.2f}M train tokens, "
        f"{len(run.train_docs)} train / {run.held_out[0]} held-out documents ("
        f"{run.held_out[1]:.1%} of the tokens), {len(run.valid_docs)} evaluated, device "
        f"{jax.devices()[0].platform} x{jax.device_count()}{processes}, memory "
        f"{c.memory_size} in layers {list(c.active_memory_layers)}"
    )


def main(argv=None):
    # argv is parsed a second time to tell which flags it gives; having parsed once, it cannot fail
    return runs.run_main(
        runs.train_parser(), lambda args: train(args, runs.given_flags(argv)), argv
    )


if __name__ == "__main__":
    runs.exit_with(main())

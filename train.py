"""Train a Memorizing Transformer (Sec. 4.2): what is trained, the step, and the loop.

  python train.py                              # the tiny preset on the stdlib, minutes on a CPU
  python train.py --preset small --data PATH   # one GPU
  python train.py --out runs/a --resume        # continue an interrupted run exactly
  python train.py --init-from runs/a --memory-size 2048 --steps 200   # fine-tune (Sec. 4.4)
  python train.py --out runs/b --coordinator HOST:PORT --num-processes 2 --process-id 0

A run writes config.json, metrics.jsonl (one JSON object per logged step and per
evaluation), eval.json, tokenizer.model and checkpoint.npz to --out: runs.py
keeps the files, optimizer.py is Adafactor and the schedule, evaluation.py
scores the held-out documents.
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

import cli
import data
import evaluation
import kernels
import memorizing_transformer as mt
import multihost
import optimizer
import presets
import runs

# ----------------------------------------------------------------------------- what is trained
DATA = ["--data", "--data-format", "--suffixes", "--min-doc-tokens"]
RUN = ["--out", "--resume", "--init-from", "--fresh-start", "--log-every", "--eval-every"]
RUN += ["--save-every", "--eval-docs", "--eval-tokens", "--curve-tokens", "--valid-fraction"]
RUN += ["--tokenizer", "--cache-dir"]
PROCESSES = ["--coordinator", "--num-processes", "--process-id", "--coordinator-timeout"]


def build_parser():
    """train.py's flags. A model or training flag left unset is None: the
    preset's (or the run's) value."""
    p = cli.parser(
        "Train a Memorizing Transformer (Wu et al., ICLR 2022). A model or training flag left "
        "unset takes the --preset's value (with --init-from, that run's, unless --preset is "
        "given)."
    )
    cli.add(p, ["--preset"] + DATA + cli.CONFIG_FLAGS + RUN)
    several = p.add_argument_group(
        "several processes (one per host; docs/usage.md)",
        "each process runs the same command but its --process-id; started by SLURM's srun, its "
        "variables stand in for these flags, and JAX_COORDINATOR_ADDRESS for --coordinator. --out "
        "and --cache-dir must be on a file system that every process sees",
    )
    cli.add(several, PROCESSES)
    return p


# ----------------------------------------------------------------------------- the step
@functools.lru_cache(maxsize=8)
def make_train_step(config, ops=None):
    """One jitted step: forward over a segment of every row, carry the state,
    update the params. With grad_accum > 1 the rows are split into micro-batches
    (each with its own memories) and the gradients summed over all tokens before
    one update. The buffers are donated, so the memory is updated in place. The
    pieces are ops, or where none is given kernels.of(config): the model file's
    own where config.ops is "plain", else kernels.py's. The step's dropout draws
    from its seed and the step count."""
    ops = ops or kernels.of(config)
    _, opt_update = optimizer.make_optimizer(config)

    def summed_loss(params, state, batch, rng):
        logits, new_state = mt.forward(
            params, state, batch["tokens"], batch["reset"], config, mask=batch["mask"], ops=ops,
            rng=rng,
        )
        m = batch["mask"].astype(jnp.float32)
        return jnp.sum(mt.cross_entropy(logits, batch["targets"]) * m), (new_state, jnp.sum(m))

    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)

    def step(params, opt_state, state, batch, seed=0):
        A = config.grad_accum
        rng = jax.random.fold_in(jax.random.PRNGKey(seed), opt_state["count"])  # dropout's
        if A == 1:
            (total, (state, n)), grads = grad_fn(params, state, batch, rng)
        else:
            # Micro-batch a takes the a-th A-th of every device's rows, so that no row,
            # and no memory, leaves its device: [B, ...] -> [devices, A, B/(devices A),
            # ...] -> [A, B/A, ...] (on one device, a reshape). The sizes are written out:
            # a state of length 0 has no -1 to infer.
            B, devices = config.batch_size, jax.device_count()
            rows = B // (devices * A)  # of one device in one micro-batch

            def split(x):  # [B, ...] -> [A, B/A, ...]
                x = x.reshape((devices, A, rows) + x.shape[1:]).swapaxes(0, 1)
                return x.reshape((A, B // A) + x.shape[3:])

            def merge(x):  # [A, B/A, ...] -> [B, ...]
                x = x.reshape((A, devices, rows) + x.shape[2:]).swapaxes(0, 1)
                return x.reshape((B,) + x.shape[3:])

            def micro(acc, xs):
                (l, (s, n)), g = grad_fn(params, *xs)
                return jax.tree.map(jnp.add, acc, (l, n, g)), s

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            xs = (jax.tree.map(split, state), jax.tree.map(split, batch), jax.random.split(rng, A))
            (total, n, grads), states = jax.lax.scan(micro, zeros, xs)
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


def fresh_start(config):
    """New parameters and optimizer state for the run's config and seed."""
    params = mt.init_params(config, jax.random.PRNGKey(config.seed))
    return params, optimizer.make_optimizer(config)[0](params)


# ----------------------------------------------------------------------------- the loop
def train(args, given):
    """Join the run's other processes, if any (multihost.py), train, and leave
    together.
"""
    multihost.start(args)
    try:
        with contextlib.ExitStack() as quiet:
            if not multihost.is_main():  # process 0 prints the run's lines
                devnull = quiet.enter_context(open(os.devnull, "w"))
                quiet.enter_context(contextlib.redirect_stdout(devnull))
            return train_run(args, given)
    finally:
        multihost.stop()


def train_run(args, given):
    """Train to config.steps from runs.open_run's start, saving every
    --save-every steps and on Ctrl-C, then evaluate. given: the flags argv gave.
    Only process 0 writes."""
    t_start = time.time()
    with contextlib.ExitStack() as held:  # the run directory's lock
        run = runs.open_run(args, given, held, fresh_start)  # every check, before any write
        if run.done:
            return say_done(run)
        config, stream, step = run.config, run.stream, run.step
        params, opt_state, state, place = multihost.distribute(run.params, run.opt_state, run.state)
        steps_by_d = {}  # a compiled step per d that the cross-batch ramp reaches

        def train_step(step, *carry):
            d = presets.cross_batch_at(config, step)
            if d not in steps_by_d:
                fixed = evaluation.step_config(config.replace(cross_batch=d, cross_batch_ramp=0))
                steps_by_d[d] = startup.after_compile(make_train_step(fixed))
            return steps_by_d[d](*carry)

        print(describe(run, params), flush=True)
        note_repeats(run)
        runs.note_unused_pieces(run.tok_path, config.vocab_size)
        with cli.interrupt_flag() as stop, Books(run, args, t_start) as books:
            while step < config.steps:
                batch = place(model_inputs(next(stream), config))
                params, opt_state, state, metrics = train_step(
                    step, params, opt_state, state, batch, config.seed
                )
                step += 1
                metrics = multihost.gather(metrics)
                if not metrics["finite"]:  # a non-finite loss, or weights that overflowed
                    return books.diverged(step)
                stopping = multihost.any_of(stop["signal"])  # a Ctrl-C on one stops them all
                books.log(step, metrics)
                books.evaluate(step, params)
                books.save(step, (params, opt_state, state), stopping)
                if stopping:
                    return books.interrupted(step)
        return books.final_evaluation(step, params)


# ----------------------------------------------------------------------------- the loop's chores
def model_inputs(batch, config):
    """The arrays of a batch the step takes, its token ids checked against the
    vocabulary."""
    data.check_tokens(batch["tokens"], config.vocab_size)
    return evaluation.model_inputs(batch)


class Books:
    """What the loop writes and prints: a line a --log-every steps
    (metrics.jsonl and stdout), the learning curve's evaluations every
    --eval-every steps, the checkpoints every --save-every steps, and the final
    evaluation (eval.json). Only process 0 writes."""

    def __init__(self, run, args, t_start):
        self.run, self.args, self.config = run, args, run.config
        self.t_start, self.is_main = t_start, multihost.is_main()
        self.eval_step = evaluation.make_forward_step(evaluation.step_config(run.config))
        self.curve_docs = data.first_tokens(run.valid_docs, args.curve_tokens)
        self.curve_distances = run.distances and data.first_tokens(run.distances, args.curve_tokens)
        self.ckpt_path = os.path.join(run.out, "checkpoint.npz")
        self.tok_hash = data.file_hash(run.tok_path)
        self.metrics_path = os.path.join(run.out, "metrics.jsonl")
        self.t_log, self.tokens_since = time.time(), 0

    def __enter__(self):
        self.file = open(self.metrics_path if self.is_main else os.devnull, "a")
        return self

    def __exit__(self, *exc):
        self.file.close()

    def log(self, step, metrics):
        """One training line, to metrics.jsonl (JSON) and to stdout, every
        --log-every steps."""
        self.tokens_since += int(metrics["tokens"])
        if step % self.args.log_every and step != self.config.steps:
            return
        tokens_per_s = self.tokens_since / (time.time() - self.t_log)
        self.t_log, self.tokens_since = time.time(), 0
        c, loss = self.config, float(metrics["loss"])
        rec = {
            "step": step,
            "loss": loss,
            "perplexity": math.exp(min(loss, 50)),
            "lr": float(optimizer.learning_rate(step, c.lr, c.warmup_steps)),
            "tokens_per_s": tokens_per_s,
        }
        rec.update({k: float(v) for k, v in metrics.items() if k.startswith(("gate", "memory"))})
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        gates = " ".join(f"g{k[5:]} {v:.3f}" for k, v in rec.items() if k.startswith("gate_"))
        fill = f" fill {rec['memory_fill']:.2f}" if "memory_fill" in rec else ""
        print(
            f"step {step:6d} | loss {rec['loss']:.4f} | ppl {rec['perplexity']:9.2f} | lr "
            f"{rec['lr']:.2e} | {rec['tokens_per_s']:8.0f} tok/s{fill} {gates}",
            flush=True,
        )

    def evaluate(self, step, params):
        """The learning curve: the held-out documents' first --curve-tokens,
        every --eval-every."""
        every = self.args.eval_every
        if not every or step % every or step >= self.config.steps:
            return
        docs, distances = self.curve_docs, self.curve_distances
        r = evaluation.full_evaluation(params, self.config, docs, distances, self.eval_step)
        print(evaluation.format_eval(step, r), flush=True)
        self.file.write(json.dumps(evaluation.eval_record(step, r)) + "\n")

    def save(self, step, trees, stopping):
        """A checkpoint every --save-every steps, at the last step and on
        Ctrl-C; the first one that cannot be written undoes the run."""
        if step % self.args.save_every and step != self.config.steps and not stopping:
            return
        whole = multihost.gather(trees)  # every process's rows
        if self.is_main:
            run = self.run
            save = (step, *whole, run.stream.position(), run.documents, self.tok_hash)
            runs.save_first_or_undo(run.out, run.step, self.ckpt_path, *save)

    def diverged(self, step):
        cli.say(
            f"error: the loss or the weights became non-finite at step {step}; stopped, the last "
            f"checkpoint ({self.ckpt_path}) is kept."
        )
        return 3

    def interrupted(self, step):
        out = self.run.out
        cli.say(
            f"interrupted at step {step}: checkpoint saved to {self.ckpt_path}; continue with "
            f"--out {out} --resume"
        )
        return 130

    def final_evaluation(self, step, params):
        """Every held-out document scored whole (or its first --eval-tokens):
        eval.json.
"""
        run, out = self.run, self.run.out
        try:
            result = evaluation.full_evaluation(
                params, self.config, run.valid_docs, run.distances, self.eval_step
            )
        except KeyboardInterrupt:
            cli.say(
                f"interrupted during the final evaluation; the checkpoint of step {step} is "
                f"saved: --out {out} --resume evaluates it."
            )
            return 130
        result = {"step": step, **result}
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(evaluation.eval_record(step, result)) + "\n")
            runs.atomic_write(os.path.join(out, "eval.json"), runs.json_text(result))
        seconds = time.time() - self.t_start
        line = evaluation.format_eval(step, result)
        print(f"{line} | {seconds:.0f} s total | {out}/eval.json", flush=True)
        return 0


def say_done(run):
    print(
        f"{run.out} finished at step {run.step} (eval.json): nothing to do; give --steps to "
        "train further."
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
        f"{c.memory_size} in layers {list(c.active_memory_layers)}, ops {c.ops} ("
        f"{'memorizing_transformer.py' if c.ops == 'plain' else 'kernels.py'})"
    )


def note_repeats(run):
    """Say so at the start when the run will read its training tokens more than
    once, and how many times: a regime of its own (the training loss is then of
    text seen before), where dropout helps (docs/results.md)."""
    c, tokens = run.config, sum(map(len, run.train_docs))
    times = c.steps * c.batch_size * c.segment_length / max(tokens, 1)
    hint = "; --dropout 0.1 or 0.2 makes the model learn it by heart less" if not c.dropout else ""
    if times > 1:
        print(
            f"note: {c.steps} steps of {c.batch_size} x {c.segment_length} tokens read the "
            f"{tokens / 1e6:.2f}M training tokens {times:.1f} times: from the second time on, the "
            f"training loss is of text seen before (the held-out loss tells how much it learned)"
            f"{hint}.",
            flush=True,
        )


def main(argv=None):
    # argv is parsed a second time to tell which flags it gives; having parsed once, it cannot fail
    run = lambda args: train(args, cli.given_flags(build_parser, argv))
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    cli.exit_with(main())

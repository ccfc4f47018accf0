"""Train a Memorizing Transformer (Sec. 4.2): Adafactor, the training loop, checkpoints.

  python train.py                                  # tiny preset on the stdlib, ~10 min on a CPU
  python train.py --preset small --data PATH       # one GPU
  python train.py --out runs/a --resume            # continue an interrupted run exactly
  python train.py --init-from runs/a --memory-size 2048 --steps 200   # fine-tune to a larger memory (Sec. 4.4)

Everything a run produces goes to --out: config.json, metrics.jsonl (one JSON object per
logged step and per evaluation), eval.json, tokenizer.model and checkpoint.npz.
"""
import os
import signal

if __name__ == "__main__":  # Ctrl-C or SIGTERM while JAX imports: nothing is written yet, leave in one line
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted before anything was written.\n"), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))  # (run_command takes both over)

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import math
import platform
import re
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import data
import memorizing_transformer as mt


class UsageError(Exception):
    """Bad input from the user: printed as one sentence, exit code 2."""


# ----------------------------------------------------------------------------- Adafactor
def adafactor(learning_rate, decay_rate=0.8, eps1=1e-30, eps2=1e-3, clip_threshold=1.0,
              beta1=None, multiply_by_parameter_scale=True, min_dim_size_to_factor=32, plain=None):
    """Adafactor (Shazeer & Stern, 2018) with optax's (init, update) convention.

    For a gradient G at step t (from 1), with beta2_t = 1 - t^(-decay_rate):
      factored (rank >= 2, the two largest axes r, c both >= min_dim_size_to_factor):
        R = beta2 R + (1 - beta2) mean_c(G^2 + eps1);  C = beta2 C + (1 - beta2) mean_r(G^2 + eps1)
        V = R C / mean_r(R)
      otherwise V = beta2 V + (1 - beta2) (G^2 + eps1)
      U = G / sqrt(V);  U = U / max(1, RMS(U) / clip_threshold)          (update clipping)
      with beta1: M = beta1 M + (1 - beta1) U, and U = M
      update = -lr_t * max(eps2, RMS(X)) * U    (relative to the parameter's scale, rank >= 2)
    Vectors (norm weights, biases, gates, q/k scales) take the plain step -lr_t * U: their
    scale says nothing about a good step (a gate bias starts at 0). So do the leaves that
    `plain` (a pytree of bools shaped like the params) marks, whatever their rank.
    learning_rate is a number or a function of the step t.
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
                v.append({"r": jnp.zeros_like(jnp.mean(x, axis=ax[1], keepdims=True)),
                          "c": jnp.zeros_like(jnp.mean(x, axis=ax[0], keepdims=True))})
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
                r = beta2 * state["v"][i]["r"] + (1 - beta2) * jnp.mean(g2, axis=ax[1], keepdims=True)
                c = beta2 * state["v"][i]["c"] + (1 - beta2) * jnp.mean(g2, axis=ax[0], keepdims=True)
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
        return jax.tree.unflatten(treedef, updates), {"count": t, "v": new_v, "m": new_m if beta1 is not None else None}

    return init, update


def learning_rate(step, base_lr, warmup_steps):
    """Sec. 4.2: linear warmup, then square-root decay: base * min(1, t/W) / sqrt(max(t, W))."""
    t = jnp.asarray(step, jnp.float32)
    w = max(warmup_steps, 1)
    return base_lr * jnp.minimum(1.0, t / w) * jax.lax.rsqrt(jnp.maximum(t, float(w)))


# ----------------------------------------------------------------------------- the step
def plain_step_leaves(params):
    """True for the T5 bias tables: bias tables, not weight matrices. They start at 0, where a
    step relative to their scale (1e-3 * lr_t) would leave them frozen, and with them the
    only position signal of the model."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) == "rel_bias" for k in path), params)


def make_optimizer(config):
    shapes = jax.eval_shape(lambda: mt.init_params(config, jax.random.PRNGKey(0)))
    return adafactor(lambda t: learning_rate(t, config.lr, config.warmup_steps),
                     plain=plain_step_leaves(shapes))


def step_config(config):
    """The fields a compiled step depends on: runs that differ only in steps or seed share it."""
    return config.replace(steps=1, seed=0)


@functools.lru_cache(maxsize=8)
def make_train_step(config):
    """One jitted step: forward over a segment of every row, carry the state, update params.

    With grad_accum > 1 the rows are split into micro-batches (each with its own memories),
    and gradients are summed over all tokens before one update. Buffers are donated, so
    the memory is updated in place.
    """
    _, opt_update = make_optimizer(config)

    def summed_loss(params, state, batch):
        logits, new_state = mt.forward(params, state, batch["tokens"], batch["reset"], config, mask=batch["mask"])
        m = batch["mask"].astype(jnp.float32)
        return jnp.sum(mt.cross_entropy(logits, batch["targets"]) * m), (new_state, jnp.sum(m))

    grad_fn = jax.value_and_grad(summed_loss, has_aux=True)

    def step(params, opt_state, state, batch):
        A = config.grad_accum
        if A == 1:
            (total, (state, n)), grads = grad_fn(params, state, batch)
        else:
            split = lambda x: x.reshape((A, x.shape[0] // A) + x.shape[1:])  # [B, ...] -> [A, B/A, ...]

            def micro(acc, xs):
                (l, (s, n)), g = grad_fn(params, xs[0], xs[1])
                return jax.tree.map(jnp.add, acc, (l, n, g)), s

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (total, n, grads), states = jax.lax.scan(micro, zeros, (jax.tree.map(split, state), jax.tree.map(split, batch)))
            state = jax.tree.map(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), states)  # [A, B/A, ...]
        n = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = opt_update(grads, opt_state, params)
        params = jax.tree.map(jnp.add, params, updates)
        finite = jnp.isfinite(total) & jnp.all(jnp.array([jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))
        metrics = {"loss": total / n, "tokens": n, "finite": finite}
        for i in config.active_memory_layers:
            metrics[f"gate_{i}"] = jnp.mean(jax.nn.sigmoid(params["layers"][i]["gate_bias"]))
        if config.active_memory_layers:
            metrics["memory_fill"] = jnp.mean(state.mem_valid)
        return params, opt_state, state, metrics

    return jax.jit(step, donate_argnums=(0, 1, 2))


@functools.lru_cache(maxsize=8)
def make_eval_step(config):
    def step(params, state, batch):
        logits, state = mt.forward(params, state, batch["tokens"], batch["reset"], config, mask=batch["mask"])
        return state, mt.cross_entropy(logits, batch["targets"]) * batch["mask"]  # [B, T]
    return jax.jit(step, donate_argnums=(1,))


# How far back a reference's value last appeared: within the local window, beyond it but
# within 2 segments, or more than 2 segments back (only the memory reaches it).
DISTANCE_BANDS = {"near": (0, 1), "mid": (1, 2), "far": (2, float("inf"))}  # (lo, hi] in segments


def evaluate(params, config, docs, batch_size, eval_step=None, distances=None):
    """Token-level validation loss: each document from its start with a fresh memory.

    distances (optional, per document, aligned with its tokens): how far back each reference
    token's value last appeared (data.reference_distances). The result then also has the
    loss on the references in each band of DISTANCE_BANDS, e.g. reference_loss_far.
    """
    eval_step = eval_step or make_eval_step(step_config(config))
    rows = max(1, min(batch_size, len(docs)))
    state = mt.init_state(config, rows)
    total, count = 0.0, 0
    ref_ce, ref_dist = [], []
    for i, batch in enumerate(data.SegmentBatches(docs, rows, config.segment_length, epochs=1)):
        state, ce = eval_step(params, state, {k: batch[k] for k in ("tokens", "targets", "mask", "reset")})
        ce = np.asarray(ce, np.float64)
        if i == 0:  # the step is compiled now (if it was not before): fill the compiler's holes
            fill_heap_holes()
        total, count = total + float(ce.sum()), count + int(batch["mask"].sum())
        for b in range(rows) if distances is not None else ():
            n = int(batch["mask"][b].sum())
            if n:  # target j of this segment is token offset + 1 + j of its document
                d, off = batch["doc"][b], batch["offset"][b]
                ref_ce.append(ce[b, :n])
                ref_dist.append(distances[d][off + 1:off + 1 + n])
    loss = total / max(count, 1)
    result = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
    if ref_ce:
        ce, dist = np.concatenate(ref_ce), np.concatenate(ref_dist)
        T = config.segment_length
        result.update(reference_loss=float(ce[dist != 0].mean()), reference_tokens=int((dist != 0).sum()))
        for band, (lo, hi) in DISTANCE_BANDS.items():
            sel = (dist > lo * T) & (dist <= hi * T)  # other tokens have distance 0 (or -1)
            if sel.any():
                result[f"reference_loss_{band}"] = float(ce[sel].mean())
                result[f"reference_tokens_{band}"] = int(sel.sum())
    return result


# ----------------------------------------------------------------------------- files
def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path, content):
    """Write `content` (bytes, str, or a function that writes to a binary file) to `path`
    whole or not at all: into a temporary file beside it, then a rename over the old one. A
    kill leaves the old file; a path read to make the content is read before it is replaced.
    The file gets the permissions of any new file (the umask), not a temporary file's 0600.
    The temporary file is hidden and named after path (.NAME.XXXXXXXX.partial), so that the
    one a kill leaves can be told apart: see drop_partial_files."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.",
                               suffix=".partial")
    try:
        with _naming(path), os.fdopen(fd, "wb") as f:
            _write_content(f, content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_files(folder, which):
    """Remove the plain files of `folder` (none if it is gone) whose os.DirEntry `which` takes."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False) and which(entry):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def drop_partial_files(out):
    """Remove from the run directory `out` the temporary files of its files' atomic writes that
    a kill (SIGKILL, a power cut) left: a checkpoint's is the checkpoint's size, and each kill
    during a save left one more (two in eight kills of a run that saved every step). Also those
    of the older name, tmpXXXXXXXX.tmp. Only for a directory whose lock this process holds."""
    ours = re.compile(r"\.(%s)\.[a-z0-9_]{8}\.partial|tmp[a-z0-9_]{8}\.tmp" % "|".join(map(re.escape, RUN_FILES)))
    remove_files(out, lambda entry: ours.fullmatch(entry.name))


def plural(n, word):
    """'1 step', '2 steps': a count and its noun, for printed lines."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def json_text(obj):
    """The text of a JSON file we write: indented, and ending in a newline like any text file
    (`--json /dev/stdout` then leaves the shell's prompt on a line of its own)."""
    return json.dumps(obj, indent=2) + "\n"


@contextlib.contextmanager
def _naming(path):
    """An OSError of a write names no file (a full disk: "No space left on device"); name path."""
    try:
        yield
    except OSError as e:
        e.filename = path if e.filename is None else e.filename
        raise


def _write_content(f, content):
    """atomic_write's and write_output's `content` into the binary file f."""
    if callable(content):
        content(f)
    else:
        f.write(content.encode() if isinstance(content, str) else content)


def is_stream(path):
    """Whether path exists and is not a regular file or a directory: a pipe, a terminal,
    /dev/stdout. An output named so is written to as it is (write_output), not replaced."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def write_output(path, content):
    """A file the user named (--json, --csv, --plot, --out): written whole or not at all
    (atomic_write), or, where it is a stream (`--json /dev/stdout`, a named pipe), written to
    it: a rename would replace the pipe, or /dev/stdout itself, with a file."""
    if not is_stream(path):
        return atomic_write(path, content)
    with _naming(path), open(path, "wb") as f:
        _write_content(f, content)


def writable_directory(folder):
    """Whether a file can be made in `folder`: an existing directory that os.access lets us
    write to and where a file, made and removed at once, can be made. (As root, os.access
    passes any directory, /proc included, where no file can be made.)"""
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".writable-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def check_writable_dir(path, flag):
    """Refuse, before anything is written, a directory that cannot be created or written to."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not writable_directory(probe):
        raise UsageError(f"cannot write to {flag} {path}: {probe} is not a writable directory.")


def check_output_file(path, flag):
    """Refuse an output file that cannot be written: no directory, or a directory in its place."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"cannot write --{flag} {path}: it is a directory.")
    if is_stream(path):
        return  # written to as it is (write_output)
    if not writable_directory(folder):
        raise UsageError(f"cannot write --{flag} {path}: {folder} is not a writable directory.")


def read_json(path):
    """A JSON file's object, or None if it is missing, unreadable, truncated or not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# ----------------------------------------------------------------------------- checkpoints
def _flat(tree):
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save_checkpoint(path, step, params, opt_state, state, data_position, documents=None):
    """Atomic (atomic_write): a kill during a save leaves the previous checkpoint loadable.
    documents: the fingerprints of the training documents, in which data_position is a position,
    and of the validation documents (prepare_data)."""
    arrays = {}
    for name, tree in (("params", params), ("opt", opt_state), ("state", state._asdict())):
        arrays.update({f"{name}{k}": v for k, v in _flat(tree).items()})
    meta = json.dumps({"step": step, "data_position": data_position, "documents": documents})
    atomic_write(path, lambda f: np.savez(f, __meta__=np.frombuffer(meta.encode(), np.uint8), **arrays))


def restore_tree(template, arrays, prefix, path, strict=True):
    """The arrays of a checkpoint (load_checkpoint) under `prefix` ("params", "opt", "state"),
    in the template's structure and dtypes; shapes must match. strict=False lets leaves the
    checkpoint lacks keep the template's values (a gate added to a run without memory)."""
    leaves = []
    for p, x in jax.tree_util.tree_flatten_with_path(template)[0]:
        key = prefix + jax.tree_util.keystr(p)
        if key not in arrays:
            if strict:
                raise UsageError(f"checkpoint {path} has no {key}: it was written for another config.")
            leaves.append(x)  # a new parameter (e.g. a gate when adding memory) starts fresh
            continue
        a = arrays[key]
        if a.shape != x.shape:
            raise UsageError(f"checkpoint {path} has {key} of shape {a.shape}, but this config needs {x.shape}.")
        leaves.append(jnp.asarray(a, x.dtype))
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


# The config fields that shape the parameters, memory aside: a fine-tuned run keeps its source's.
MODEL_SHAPE = ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "d_ff", "num_buckets")


def check_same_model(params, arrays, path):
    """Fine-tuning (--init-from) takes the source run's model as it is, and may add memory to it
    or drop it (so may evaluate.py): every parameter but a memory layer's gate must be in both
    the checkpoint and this config. (Another number of layers once loaded the layers both had and left the others
    fresh, or dropped them, without a word; other widths fail on the shapes.)"""
    gate = lambda key: key.endswith("['gate_bias']")
    ours = {"params" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    theirs = {k for k in arrays if k.startswith("params")}
    missing, extra = sorted(k for k in ours - theirs if not gate(k)), sorted(k for k in theirs - ours if not gate(k))
    if missing or extra:
        which = f"has no {missing[0]}" if missing else f"has {extra[0]}, which this config has no place for"
        raise UsageError(f"checkpoint {path} {which}: it holds another model (other layers or widths), and only "
                         f"memory may be added to a run's model or dropped from it.")


# The flags that choose a run's data and its validation: --resume takes the run's, and so does
# --init-from, for each one not given.
RUN_DATA_ARGS = ("data", "data_format", "eval_docs", "eval_tokens", "valid_fraction", "min_doc_tokens", "suffixes")

# What a run directory's config.json must hold under "args" (train.py's flags) to be resumed
# or evaluated, and the type of each.
RUN_ARGS = {"data": str, "data_format": str, "valid_fraction": float, "eval_docs": int, "eval_tokens": int}


def restore_optimizer(opt_state, params, arrays, source_config, path):
    """Adafactor's state from another run's checkpoint (fine-tuning): the step count, and each
    parameter's statistics matched by the parameter's name. (The statistics are lists in the
    order of the parameter leaves, which a new parameter, a gate, shifts.) A parameter the
    source lacks keeps fresh statistics."""
    names = lambda tree: [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    source = {n: i for i, n in enumerate(names(jax.eval_shape(
        lambda: mt.init_params(source_config, jax.random.PRNGKey(0)))))}
    index = [source.get(n) for n in names(params)]  # this run's leaf j -> the source's leaf, or None

    def statistics(key):
        return [x if i is None else restore_tree(x, arrays, f"opt['{key}'][{i}]", path)
                for x, i in zip(opt_state[key], index)]

    return {"count": restore_tree(opt_state["count"], arrays, "opt['count']", path),
            "v": statistics("v"), "m": None if opt_state["m"] is None else statistics("m")}


def read_run_config(run_dir):
    """A run's config.json as {"config": Config, "args": dict}; a broken file is a UsageError."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir} is not a run directory (no config.json).")
    saved = read_json(path)
    try:
        args, fields = saved["args"], saved["config"]
        if not all(isinstance(args.get(k), t) and not isinstance(args.get(k), bool) for k, t in RUN_ARGS.items()):
            raise TypeError
        if not (isinstance(args.get("suffixes"), (str, type(None))) and
                isinstance(args.get("min_doc_tokens", 0), (int, type(None)))):
            raise TypeError
        saved["config"] = mt.Config(**{**fields, "memory_layers": tuple(fields["memory_layers"])})
        return saved
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"{path} is not a valid run config.") from None


def load_checkpoint(path):
    """(meta, arrays) of a checkpoint; a missing, unreadable, truncated or corrupt file is a UsageError."""
    if not os.path.isfile(path):
        raise UsageError(f"no checkpoint at {path}.")
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop("__meta__")).decode())
        if not isinstance(meta.get("step"), int):
            raise ValueError
    except PermissionError:
        raise UsageError(f"cannot read the checkpoint {path}: permission denied.") from None
    except Exception:
        raise UsageError(f"checkpoint {path} is truncated or corrupt.") from None
    return meta, arrays


def check_fits(config, batch_size):
    """Refuse a config whose parameters, gradients, optimizer state, memory and one layer's
    attention scores and their gradient alone exceed the device's memory, before anything
    is allocated (the rest of the activations only add to that)."""
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    params = jax.eval_shape(lambda: mt.init_params(config, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda: mt.init_state(config, batch_size))
    scores = batch_size * config.num_heads * config.segment_length * (config.segment_length + config.cache_length) * 4
    need = 3 * nbytes(params) + nbytes(state) + 2 * scores  # Adafactor's statistics are at most the params' size
    stats = jax.devices()[0].memory_stats() or {}
    have = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise UsageError(f"this config (memory size {config.memory_size}, batch {batch_size}) needs at least "
                         f"{need / 2 ** 30:.1f} GiB for its parameters, optimizer and memory, more than the "
                         f"{have / 2 ** 30:.1f} GiB the device has.")


# ----------------------------------------------------------------------------- the command line
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except where the help already says it, or where there
    is none to show (None: the help says what an unset flag means)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad flag is one line on stderr (not the usage, then the error),
    and that a value written with an exponent, `--init-gate-bias -1e3`, is a negative number,
    not a flag (Python 3.11's argparse knows only -3 and -.5; later ones match this way)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")  # no flag of ours starts with "-" and a digit

    def error(self, message):
        self.exit(2, f"error: {message} (see --help).\n")


def int_at_least(low, high=None):
    """An argparse type: an integer in [low, high]."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            words = {0: "must not be negative", 1: "must be positive"}.get(low, f"must be at least {low}")
            raise argparse.ArgumentTypeError(f"{words}, got {value}" if value < low else f"must be at most {high}, got {value}")
        return value
    return parse


positive_int, count = int_at_least(1), int_at_least(0)


def finite_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def path_arg(text):
    """An argparse type for a path: any string but the empty one (an unset shell variable,
    `--out "$DIR"`, would otherwise pass as the flag's default or as the current directory)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a path, got an empty string")
    return text


def fraction(text):
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def _backend_failed(e):
    """Whether e was raised where JAX starts its backend (a JAX_PLATFORMS naming one that cannot
    start, e.g. cuda on a machine without it: a RuntimeError, or in jax 0.10 a bare assert)."""
    frames = traceback.extract_tb(e.__traceback__)
    return any(f.filename.endswith(os.path.join("jax", "_src", "xla_bridge.py")) for f in frames[-3:])


@contextlib.contextmanager
def dropped_interrupts_raised_again(delay=0.01):
    """Ctrl-C raises KeyboardInterrupt in whatever Python code runs at that moment. Where that
    is a garbage-collection callback (JAX runs one at every collection, and tracing and
    compiling collect often) or a __del__, Python drops the exception ("Exception ignored
    in: ...") and the program goes on: 1 of 30 Ctrl-Cs sent to train.py 1-3 s after it
    began to load JAX was lost, and the run trained on. Here such a KeyboardInterrupt is
    delivered again `delay` seconds later, by SIGALRM, to what SIGINT does then (raise, set
    the training loop's flag, or exit), in the code that runs then. Not from the hook
    itself: Python runs a signal's handler right after the call that raised the signal,
    inside the hook, and drops its exception there too. (Without setitimer, on Windows:
    these are not delivered again.)

    JAX drops one too: it starts its plugins (on a GPU, the CUDA plugin, which loads its
    libraries for a second or two) under a bare `except:`, logs what they raise, and goes on
    without them. A Ctrl-C there was lost, and the run trained on, on the CPU (1 of 24
    train.py runs sent Ctrl-C 2 s after loading JAX, on an H200 under load). So the log
    record of a KeyboardInterrupt from its xla_bridge module is not printed but raised again,
    from the logging call, out of JAX's `except:` (_raise_logged_interrupt)."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            signal.setitimer(signal.ITIMER_REAL, delay)
        else:
            previous_hook(unraisable)

    def again(_, frame):
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):
            raise KeyboardInterrupt
        handler(signal.SIGINT, frame)

    jax_log = logging.getLogger("jax._src.xla_bridge")
    jax_log.addFilter(_raise_logged_interrupt)
    alarm = hasattr(signal, "setitimer")
    if alarm:
        previous_hook, previous_alarm = sys.unraisablehook, signal.signal(signal.SIGALRM, again)
        sys.unraisablehook = hook
    try:
        yield
    finally:
        jax_log.removeFilter(_raise_logged_interrupt)
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)
            sys.unraisablehook = previous_hook


def _raise_logged_interrupt(record):
    """A logging filter: a record of a KeyboardInterrupt that the logging code caught is raised
    again, not printed (dropped_interrupts_raised_again)."""
    if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
        raise record.exc_info[1]
    return True


def run_command(command, args):
    """Run a subcommand the way every script here does: bad input (flags, files, data) is one
    sentence on stderr and exit code 2; Ctrl-C or SIGTERM is one line and exit code 130 (the
    command may have handled it first, e.g. by saving a checkpoint), even where Python would
    have dropped it (dropped_interrupts_raised_again)."""
    old = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}  # both: Ctrl-C
    try:
        with dropped_interrupts_raised_again():
            return command(args)
    except (UsageError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader stopped reading (`| head`): stop quietly, as shell tools do
        return _stdout_gone()
    except OSError as e:  # a file the checks did not foresee: say which (if the error knows), and why
        print(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename is not None else ""), file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError, AssertionError) as e:  # (jax.errors.JaxRuntimeError is a RuntimeError)
        if isinstance(e, MemoryError) or (isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)):
            print("error: the device ran out of memory; lower --batch-size, --segment-length or --memory-size.",
                  file=sys.stderr)
        elif _backend_failed(e):
            print(f"error: JAX could not start its backend (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}): "
                  f"{' '.join(str(e).split()) or 'no backend'}; unset JAX_PLATFORMS to let JAX choose one, or see "
                  f"the README's GPU install.", file=sys.stderr)
        else:
            raise
        return 2
    except KeyboardInterrupt:
        print("interrupted; no file was left half-written.", file=sys.stderr)
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def keep_freed_host_memory():
    """Let the process keep the host memory it frees (Linux with glibc; elsewhere nothing).

    XLA's CPU backend allocates a step's temporaries as one block (100 MB for the tiny preset's
    gradient). glibc maps any block over 32 MB fresh from the kernel and unmaps it when it is
    freed, so each step wrote its temporaries into new pages: 25,000 page faults a step, each
    page zeroed by the kernel. With one arena, no separate mappings and no trimming, the freed
    block stays in the heap and the next step reuses it. The cost: the process's resident
    memory stays at its peak. No trimming is -1, which glibc's mallopt documents as "disables
    trimming completely": the largest positive threshold, 2^31 - 1, still gave back any free
    top of the heap over 2 GiB, and the paper preset's step at batch 1 on a CPU faulted 1.6 GB
    back in now and then (422,326 pages in one of eight steps: 15.8 s against 13.3-14.0).
    Returns whether the setting took."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
    global _ONE_HEAP
    _ONE_HEAP = all(mallopt(option, value) == 1 for option, value in
                    ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
    return _ONE_HEAP


_ONE_HEAP = False  # keep_freed_host_memory took: every allocation is in the one brk heap
_HOLE_FILLERS = []  # fill_heap_holes's blocks, never freed


def fill_heap_holes(smallest=1024, largest=2 ** 26):
    """After a compile, with keep_freed_host_memory's one heap: take every free block of at least
    `smallest` bytes in the heap for good, so that later allocations come from the heap's top
    and from the blocks they free themselves. Returns how many blocks it took.

    Compiling leaves the heap full of freed holes of every size, and each later allocation of
    a step (Eigen's buffers for its plain matmuls, among others) searched through them: on the
    2-core EPYC, glibc's malloc took 7.7% of a step's time in a process that had compiled and
    0.55% in one that had not, and the tiny step ran 16% slower. Each hole is taken by
    allocating blocks of halving sizes while they fit in the holes, that is, while the heap's
    end (sbrk) does not move; malloc_trim first hands the holes' pages back to the kernel, so
    the blocks cost no resident memory. Call it between steps, not while one runs."""
    if not _ONE_HEAP:
        return 0
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
    libc.malloc_trim(0)
    taken, size = 0, largest
    while size >= smallest:
        end = libc.sbrk(0)
        block = libc.malloc(size)
        if not block:  # no memory for it at all
            size //= 2
        elif libc.sbrk(0) == end:  # it came from a hole (or the top's spare room, which trim emptied)
            _HOLE_FILLERS.append(block)
            taken += 1
        else:  # no hole of this size is left: give the new room back and try half the size
            libc.free(block)
            libc.malloc_trim(0)
            size //= 2
    return taken


def run_main(parser, command, argv):
    """A script's main(): parse argv (--help, or a bad flag printed in one line, end here with
    exit code 0 or 2), then run_command."""
    if sys.stdout is sys.__stdout__ and getattr(sys.stdout, "errors", None) == "strict":
        # A path that is not UTF-8 reaches Python as lone surrogates; under a UTF-8 locale other
        # than C, print() would fail on it midway through a run. Print it as the bytes it was.
        sys.stdout.reconfigure(errors="surrogateescape")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    keep_freed_host_memory()
    return run_command(command, args)


def _stdout_gone():
    """Point stdout at /dev/null, so that nothing more fails on it, and return the exit code of a
    process killed by SIGPIPE (128 + 13)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (a test's capture): nothing to redirect
        pass
    return 141


def exit_with(code):
    """Leave with `code` at once (os._exit), once stdout and stderr are flushed: without the
    interpreter's teardown, which can crash while JAX's threads still run a computation (after
    an interrupt), and which nothing needs once a command has returned (its files are closed).
    The teardown took 0.3 s, and a Ctrl-C or SIGTERM during it killed the process without a
    word (Python restores the default handlers there): one in the flush is one line and 130. A
    reader of stdout that stopped early (`| head`) ends it quietly with 141."""
    def interrupted(*_):
        os.write(2, b"interrupted; no file was left half-written.\n")
        os._exit(130)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, interrupted)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        gone = _stdout_gone()
        code = code or gone  # a failure keeps its own code
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os._exit(code or 0)  # (None is 0, as for sys.exit)


# ----------------------------------------------------------------------------- the run
def memory_layers(text):
    """--memory-layers "1,3" -> (1, 3)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--memory-layers takes comma-separated layer indices, got {text!r}.") from None


def config_from_args(args, base=None, base_name=None):
    """The config the flags give: `base` (default: the --preset; named `base_name` in messages)
    with every model or training flag that was set."""
    fields = {f.name for f in dataclasses.fields(mt.Config)}
    changes = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.memory_layers is not None:
        changes["memory_layers"] = memory_layers(args.memory_layers)
    base_name = base_name or f"the {args.preset} preset"
    base = base or mt.PRESETS[args.preset]
    n = changes.get("num_layers", base.num_layers)
    if "memory_layers" not in changes and any(layer >= n for layer in base.memory_layers):
        raise UsageError(f"{base_name}'s memory layer {max(base.memory_layers)} is out of range for "
                         f"--num-layers {n}; give --memory-layers too, a 0-based index below {n} (the paper's is "
                         f"near the top: 8 of 12).")
    try:
        return base.replace(**changes)
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_parser():
    p = Parser(description="Train a Memorizing Transformer (Wu et al., ICLR 2022). A model or training flag left "
               "unset takes the --preset's value (with --init-from, that run's, unless --preset is given).",
               formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=sorted(mt.PRESETS), default="tiny",
                   help="named config: tiny (2-core CPU), small (one GPU), paper (Sec. 4.2), synthetic (the "
                   "2-layer recipe that learns the synthetic task, README)")
    p.add_argument("--data", default="stdlib", type=path_arg, help="stdlib (the running Python's standard library), "
                   "synthetic (4000 generated documents with near and far references; synthetic:N for N), or a PATH")
    p.add_argument("--data-format", default="auto", choices=["auto", "repo", "repo-deps", "text", "jsonl"],
                   help="how to read PATH: repo = a directory per document, repo-deps = same in import "
                   "order, text = one .txt file per document, jsonl = one {'text': ...} per line")
    p.add_argument("--suffixes", help="for a repository PATH, read only files ending in these, comma-separated, "
                   "e.g. .py,.c,.h (Sec. 4.1 keeps a repository's source files); default: every file")
    p.add_argument("--min-doc-tokens", type=count, default=0, help="drop documents shorter than this "
                   "(4096 gives the paper's C4(4K+))")
    p.add_argument("--vocab-size", type=positive_int, help="SentencePiece vocabulary size V")
    p.add_argument("--d-model", type=positive_int, help="model width E (= num heads x head dim)")
    p.add_argument("--num-layers", type=positive_int, help="transformer layers L")
    p.add_argument("--num-heads", type=positive_int, help="attention heads H")
    p.add_argument("--head-dim", type=positive_int, help="dimension D of each head")
    p.add_argument("--d-ff", type=positive_int, help="hidden width F of the feed-forward blocks")
    p.add_argument("--steps", type=positive_int, help="training steps (preset's value if unset); with --resume, "
                   "the step to train to; with --init-from, the steps to add (unset: the run's config's count)")
    p.add_argument("--batch-size", type=positive_int, help="batch rows; each row streams documents in order")
    p.add_argument("--grad-accum", type=positive_int, help="micro-batches per step (rows are split between them)")
    p.add_argument("--segment-length", type=positive_int, help="tokens per segment T (also the XL cache length)")
    p.add_argument("--memory-size", type=count, help="memory slots M per row and head; 0 = no memory")
    p.add_argument("--memory-layers", help="comma-separated 0-based kNN layer indices, e.g. 8")
    p.add_argument("--num-neighbors", type=positive_int, help="k retrieved memories per query")
    p.add_argument("--xl-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="Transformer-XL cache of the previous segment")
    p.add_argument("--exact-topk", action=argparse.BooleanOptionalAction, default=None,
                   help="exact top-k instead of the binned approximate top-k")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="activation and matmul precision "
                   "(params, softmax statistics and the loss stay float32)")
    p.add_argument("--memory-dtype", choices=["float32", "bfloat16"], help="storage of the memory and XL cache "
                   "(default: the same as --dtype)")
    p.add_argument("--attention", choices=["explicit", "fused"], help="local attention: explicit einsums and "
                   "softmax, or fused (jax.nn.dot_product_attention: cuDNN's flash attention on a GPU with "
                   "--dtype bfloat16, JAX's own version of it elsewhere); the same math for the valid tokens (fused takes "
                   "padding only at a segment's end, which is all data.py makes)")
    p.add_argument("--lr", type=finite_float, help="base learning rate (1.0 in the paper)")
    p.add_argument("--init-prev-token-bias", type=finite_float, help="initial T5 bias at distance 1 in half of "
                   "the first layer's heads (0 = none, as in the paper; the synthetic preset uses 6)")
    p.add_argument("--init-gate-bias", type=finite_float, help="initial bias of every memory layer's gate: "
                   "g = sigmoid(bias) mixes memory and local attention (0 = g 0.5, as in the paper; -2 = g 0.12)")
    p.add_argument("--warmup-steps", type=count, help="linear warmup steps before square-root decay")
    p.add_argument("--seed", type=int_at_least(0, 2 ** 32 - 1), help="seed for the initialization and the order "
                   "in which batch rows take training documents; the train/validation split and the traversal of "
                   "repositories are fixed (seed 0), so runs with different seeds are scored on the same "
                   "validation documents")
    p.add_argument("--out", type=path_arg,
                   help="output directory (default runs/<timestamp>); train.py refuses one that already "
                   "holds a run unless --resume is given")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint, with its "
                   "config, data and intervals (--log-every, --eval-every and --save-every may be given anew); a "
                   "finished run with its eval.json: nothing to do, unless --steps goes further")
    p.add_argument("--init-from", type=path_arg,
                   metavar="RUN_DIR", help="fine-tune another run (Sec. 4.4): its weights, and its "
                   "step count, learning-rate schedule and Adafactor statistics continue, for --steps more steps "
                   "(a different memory size, or a run without memory: new parameters start fresh; the model's "
                   "layers and widths must stay the run's); the data stream starts anew. Its config and data flags "
                   "are the new run's, changed by each flag given (with --preset: that preset's config, as without "
                   "--init-from)")
    p.add_argument("--fresh-start", action="store_true", help="with --init-from: take only the weights; the step "
                   "count, the warmup and Adafactor's statistics start from 0")
    p.add_argument("--log-every", type=positive_int, default=10, help="steps between printed lines")
    p.add_argument("--eval-every", type=count, default=500, help="steps between evaluations (0 = only at the end)")
    p.add_argument("--save-every", type=positive_int, default=100, help="steps between checkpoints")
    p.add_argument("--eval-docs", type=positive_int, default=4, help="validation documents to evaluate")
    p.add_argument("--eval-tokens", type=positive_int, default=4096,
                   help="tokens evaluated from each validation document's start")
    p.add_argument("--valid-fraction", type=fraction, default=0.05, help="share of documents held out")
    p.add_argument("--tokenizer", type=path_arg,
                   help="an existing SentencePiece .model (default: train one and cache it)")
    p.add_argument("--cache-dir", type=path_arg,
                   default=os.environ.get("MT_CACHE") or ".cache", help="tokenizer and token cache "
                   "(keyed on the corpus, the vocabulary size and the validation split), and in its jax/ folder the "
                   "compiled programs, which a later run with the same config loads instead of compiling (--resume: "
                   "the run's, if it still exists)")
    return p


def parse_suffixes(text):
    """--suffixes ".py,.c,.h" -> (".py", ".c", ".h"); None -> None."""
    if text is None:
        return None
    suffixes = tuple(x.strip() for x in text.split(","))
    if not all(suffixes):
        raise UsageError(f"--suffixes takes comma-separated file name endings such as .py,.c,.h, got {text!r}.")
    return suffixes


def prepare_data(config, args, tokenizer_path=None):
    """Documents -> tokenizer -> (train tokens, validation tokens (cut to --eval-docs and
    --eval-tokens), their reference distances, tokenizer path, fingerprints of the training and
    the whole validation documents). Writes only to the cache, whose every file is named by a
    hash of all that determines its content: the corpus, the validation split, the vocabulary
    size, the tokenizer."""
    suffixes = parse_suffixes(args.suffixes)
    check_writable_dir(args.cache_dir, "--cache-dir")
    os.makedirs(args.cache_dir, exist_ok=True)
    docs = data.load_documents(args.data, args.data_format, seed=0, suffixes=suffixes)
    train_docs, valid_docs = data.split_documents(docs, args.valid_fraction, seed=0)
    key = data.corpus_key(docs)  # the documents as read, whatever the path, format or suffixes that gave them
    key = hashlib.sha256(f"{key}|valid_fraction {args.valid_fraction!r}".encode()).hexdigest()[:16]
    if tokenizer_path:
        sp, tok_path = data.load_tokenizer(tokenizer_path), tokenizer_path
    else:
        sp, tok_path = data.get_tokenizer(train_docs, config.vocab_size, args.cache_dir, key)
    if sp.get_piece_size() > config.vocab_size:
        raise UsageError(f"the tokenizer has {sp.get_piece_size()} pieces but vocab_size is {config.vocab_size}.")
    with open(tok_path, "rb") as f:
        tok_hash = hashlib.sha256(f.read()).hexdigest()[:16]
    cache = lambda part: os.path.join(args.cache_dir, f"tokens-{key}-{tok_hash}-{part}.npz")
    train, _ = data.tokenize(train_docs, sp, cache("train"))
    valid, refs = data.tokenize(valid_docs, sp, cache("valid"))
    if args.min_doc_tokens:
        train = [t for t in train if len(t) >= args.min_doc_tokens]
        keep = [i for i, t in enumerate(valid) if len(t) >= args.min_doc_tokens]
        valid, refs = [valid[i] for i in keep], [refs[i] for i in keep]
    if not train or not valid:
        raise UsageError(f"no document of at least {max(args.min_doc_tokens, 2)} tokens left after the split.")
    documents = {"train": data.fingerprint(train), "validation": data.fingerprint(valid)}
    valid = [t[:args.eval_tokens + 1] for t in valid[:args.eval_docs]]
    refs = [r[:len(t)] for t, r in zip(valid, refs)]
    # Synthetic data: how far back each reference's value last appeared (else None).
    distances = [data.reference_distances(t, r) for t, r in zip(valid, refs)] if any(r.any() for r in refs) else None
    return train, valid, distances, tok_path, documents


def shard(tree, mesh, spec):
    from jax.sharding import NamedSharding
    return jax.device_put(tree, NamedSharding(mesh, spec))


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.npz", "eval.json", "tokenizer.model")


# What --resume may change: how far the run goes, and how often it logs, evaluates and saves.
RESUME_MAY_CHANGE = ("steps", "out", "resume", "log_every", "eval_every", "save_every", "cache_dir")


def given_flags(argv):
    """The flags that argv gives, by their names in args: once parsed, a flag left out and one
    given at its default value look alike."""
    blank = build_parser()
    blank.set_defaults(**dict.fromkeys(vars(blank.parse_args([])), None))
    return {name for name, value in vars(blank.parse_args(argv)).items() if value is not None}


def check_run_data_here(source):
    """A run keeps its --data as typed: a relative path is relative to where the run started."""
    if not (source == "stdlib" or data.is_synthetic(source) or os.path.isabs(source) or os.path.exists(source)):
        raise UsageError(f"the run's --data {source!r} does not exist from {os.getcwd()}: a relative path is read "
                         f"from the directory the command runs in, so run it from the one the run was started in.")


def resume_conflict(args, saved, out, given):
    """The first flag of `given` (names in args) that would change the run saved in out (its
    model, training or data; not RESUME_MAY_CHANGE), as (the flag as typed, the run's value);
    None if there is none."""
    config = saved["config"]
    fields = {f.name for f in dataclasses.fields(mt.Config)}
    for name, value in vars(args).items():
        if name in RESUME_MAY_CHANGE or name not in given:
            continue
        if name == "memory_layers":
            value, was = sorted(memory_layers(value)), sorted(config.memory_layers)
        elif name == "memory_dtype":
            was = config.memory_dtype or config.dtype
        elif name in fields:
            was = getattr(config, name)
        elif name == "tokenizer":
            was = os.path.join(out, "tokenizer.model")
            value, was = os.path.realpath(value), os.path.realpath(was)
        elif name == "data":  # every run config has it (read_run_config checks)
            was = saved["args"][name]
            if data.same_source(value, was):  # ./corpus/ is corpus
                continue
        elif name in saved["args"]:
            was = saved["args"][name]
        else:
            continue
        if value != was:
            typed = getattr(args, name)
            flag = "--" + ("" if typed is not False else "no-") + name.replace("_", "-")
            return flag + ("" if isinstance(typed, bool) else f" {typed}"), was
    return None


def check_resume_flags(args, saved, out, given):
    """--resume continues a run as it was configured: a flag of `given` (the flags the command
    line gave) that would change it is refused rather than ignored."""
    conflict = resume_conflict(args, saved, out, given)
    if conflict:
        raise UsageError(f"--resume continues the run in {out} as it was configured, and {conflict[0]} would "
                         f"change it (the run's: {conflict[1]}); drop the flag, or fine-tune the run into a new "
                         f"--out with --init-from.")


def holds_run(out):
    """Whether the directory out holds (a part of) a run: any of its files."""
    return os.path.isdir(out) and any(os.path.lexists(os.path.join(out, f)) for f in RUN_FILES)


def run_config(args, given):
    """Check the flags and the run directory; return the run's output directory, config and
    tokenizer (None: train one). Reads, never writes. given: the flags the command line gave."""
    if args.resume and args.init_from:
        raise UsageError("--resume and --init-from cannot be combined.")
    if args.fresh_start and not args.init_from:
        raise UsageError("--fresh-start goes with --init-from.")
    if args.resume and not args.out:
        raise UsageError("--resume needs --out, the run to continue.")
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if args.resume:  # the run's own config, data flags and tokenizer; --steps may extend it
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise UsageError(f"there is no run to resume in {out} (no config.json).")
        saved = read_run_config(out)
        check_resume_flags(args, saved, out, given)
        config = saved["config"].replace(steps=args.steps) if args.steps else saved["config"]
        for k in RUN_DATA_ARGS:
            setattr(args, k, saved["args"].get(k))
        for k, least in (("log_every", 1), ("eval_every", 0), ("save_every", 1)):  # the run's, unless given
            v = saved["args"].get(k)
            if k not in given and isinstance(v, int) and not isinstance(v, bool) and v >= least:
                setattr(args, k, v)
        v = saved["args"].get("cache_dir")  # and its cache, unless given or gone (a run moved elsewhere)
        if "cache_dir" not in given and isinstance(v, str) and v and os.path.isdir(v):
            args.cache_dir = v
        args.min_doc_tokens = args.min_doc_tokens or 0
        check_run_data_here(args.data)
        tokenizer = os.path.join(out, "tokenizer.model")
    else:
        if holds_run(out):
            raise UsageError(f"{out} already holds a run: continue it with --resume, or choose another --out.")
        tokenizer, base = args.tokenizer, None
        if args.init_from:
            tokenizer = os.path.join(args.init_from, "tokenizer.model")
            if not os.path.isfile(tokenizer):
                raise UsageError(f"--init-from {args.init_from} is not a run directory (no tokenizer.model).")
            if args.tokenizer and os.path.realpath(args.tokenizer) != os.path.realpath(tokenizer):
                raise UsageError(f"--init-from {args.init_from} keeps its run's tokenizer, whose ids its weights "
                                 f"read; drop --tokenizer {args.tokenizer}.")
            saved = read_run_config(args.init_from)
            source = saved["config"]
            if "preset" not in given:  # the run's config, as --resume takes it, changed by the flags given
                base = source
            for k in RUN_DATA_ARGS:  # and its data, unless given
                if k not in given and k in saved["args"]:
                    setattr(args, k, saved["args"][k])
            args.min_doc_tokens = args.min_doc_tokens or 0
            if "data" not in given:
                check_run_data_here(args.data)
        config = config_from_args(args, base, f"--init-from {args.init_from}" if base else None)
        if args.init_from:
            other = [f"{f} {getattr(source, f)} (this run: {getattr(config, f)})" for f in MODEL_SHAPE
                     if getattr(source, f) != getattr(config, f)]
            if other:
                raise UsageError(f"--init-from {args.init_from} is another model: its {', '.join(other)}; only "
                                 f"memory may be added to a run's model or dropped from it, so drop or change those "
                                 f"flags.")
    for path, flag in ((out, "--out"), (args.cache_dir, "--cache-dir")):
        if data.inside_corpus(path, args.data):
            raise UsageError(f"{flag} {path} is inside the corpus --data {args.data}: what the run writes there "
                             f"would be read as part of its own corpus; choose a {flag} outside it, or a hidden one "
                             f"(a name starting with '.', which no corpus reads).")
    check_writable_dir(out, "--out")
    if config.batch_size % (jax.device_count() * config.grad_accum):
        raise UsageError(f"batch_size {config.batch_size} must be divisible by {jax.device_count()} devices x "
                         f"grad_accum {config.grad_accum}.")
    check_fits(config, config.batch_size)
    return out, config, tokenizer


def initial_state(config, args, out, stream, documents):
    """(params, optimizer state, model state, step): fresh, or resumed from the checkpoint in
    --out (the data stream is moved to where it stopped, in the same documents: `documents`,
    their fingerprints, must be the checkpoint's), or with --init-from's weights. Reads, never
    writes."""
    def fresh():
        params = mt.init_params(config, jax.random.PRNGKey(config.seed))
        return params, make_optimizer(config)[0](params)

    state = mt.init_state(config, config.batch_size)
    if args.resume:  # the checkpoint has every value: only the structure and dtypes are needed
        params, opt_state = jax.eval_shape(fresh)
        path = os.path.join(out, "checkpoint.npz")
        if not os.path.isfile(path):
            raise UsageError(f"{out} has no checkpoint to resume from (stopped before its first save); "
                             f"delete the directory to start the run again.")
        meta, arrays = load_checkpoint(path)
        params = restore_tree(params, arrays, "params", path)
        opt_state = restore_tree(opt_state, arrays, "opt", path)
        state = mt.State(**restore_tree(state._asdict(), arrays, "state", path))
        changed = (f"the corpus {args.data} is not the one the checkpoint in {out} was trained on (its documents "
                   f"were added to, removed or edited since, or the run's tokenizer.model was replaced; for stdlib, "
                   f"another Python's library): --resume would continue its rows in other documents. Restore the "
                   f"corpus, or fine-tune the run into a new --out with --init-from")
        if meta.get("documents") not in (None, documents):  # (a checkpoint from before fingerprints has none)
            raise UsageError(changed + ".")
        try:
            stream.restore(meta["data_position"])
        except (KeyError, TypeError, ValueError, IndexError):
            raise UsageError(f"checkpoint {path} has a data position that does not fit the training documents: "
                             f"it is truncated or corrupt, or {changed}.") from None
        if meta["step"] > config.steps:
            raise UsageError(f"the checkpoint in {out} is at step {meta['step']}, past --steps {config.steps}.")
        return params, opt_state, state, meta["step"]
    params, opt_state = fresh()
    if args.init_from:
        path = os.path.join(args.init_from, "checkpoint.npz")
        meta, arrays = load_checkpoint(path)
        check_same_model(params, arrays, path)
        params = restore_tree(params, arrays, "params", path, strict=False)
        if not args.fresh_start:  # fine-tuning continues the schedule and the optimizer (meliad does too)
            source = read_run_config(args.init_from)["config"]
            return params, restore_optimizer(opt_state, params, arrays, source, path), state, meta["step"]
    return params, opt_state, state, 0


def lock_run_dir(out, held):
    """Hold an exclusive lock on the run directory until `held` (an ExitStack) closes: flock on
    the directory itself, so no lock file. A second train.py on the same --out (a double start,
    two resumes) is refused rather than writing the same files. False where the directory does
    not exist yet, or the file system cannot lock."""
    try:
        import fcntl
        fd = os.open(out, os.O_RDONLY)
    except (ImportError, OSError):  # no flock (Windows), or no directory yet
        return False
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"{out} is in use: another train.py is writing this run; wait for it to end, or choose "
                         f"another --out.") from None
    except OSError:  # a file system without locks
        return False
    return True


def write_run_files(out, args, config, tok_path, step):
    """The first writes of a run, once every check has passed: the tokenizer beside the
    checkpoint, and config.json and an empty metrics.jsonl (or, on --resume, metrics.jsonl
    without the lines logged after the checkpoint)."""
    os.makedirs(out, exist_ok=True)
    own = os.path.join(out, "tokenizer.model")
    if not (os.path.exists(own) and os.path.samefile(tok_path, own)):
        with open(tok_path, "rb") as f:
            atomic_write(own, f.read())
    if args.resume:
        _truncate_metrics(os.path.join(out, "metrics.jsonl"), step, final=step >= config.steps)
        return
    atomic_write(os.path.join(out, "config.json"),
                 json_text({"config": dataclasses.asdict(config), "args": vars(args)}))
    atomic_write(os.path.join(out, "metrics.jsonl"), b"")


def distribute(params, opt_state, state):
    """With several devices, data parallelism: batch rows (and their memories) sharded,
    params replicated. Returns the three, and how to place a batch."""
    if jax.device_count() == 1:
        return params, opt_state, state, lambda batch: batch
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return (shard(params, mesh, P()), shard(opt_state, mesh, P()), shard(state, mesh, P("data")),
            lambda batch: shard(batch, mesh, P("data")))


@contextlib.contextmanager
def interrupt_flag():
    """Ctrl-C and SIGTERM set flag["signal"] instead of stopping: the loop saves and exits."""
    flag = {"signal": None}
    old = {s: signal.signal(s, lambda signum, _: flag.update(signal=signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def log_step(log, step, metrics, config, tokens_per_s):
    """One training line: to metrics.jsonl (JSON) and to stdout."""
    rec = {"step": step, "loss": float(metrics["loss"]), "perplexity": math.exp(min(float(metrics["loss"]), 50)),
           "lr": float(learning_rate(step, config.lr, config.warmup_steps)), "tokens_per_s": tokens_per_s}
    rec.update({k: float(v) for k, v in metrics.items() if k.startswith(("gate", "memory"))})
    log.write(json.dumps(rec) + "\n")
    log.flush()
    gates = " ".join(f"g{k[5:]} {v:.3f}" for k, v in rec.items() if k.startswith("gate_"))
    fill = f" fill {rec['memory_fill']:.2f}" if "memory_fill" in rec else ""
    print(f"step {step:6d} | loss {rec['loss']:.4f} | ppl {rec['perplexity']:9.2f} | lr {rec['lr']:.2e} | "
          f"{rec['tokens_per_s']:8.0f} tok/s{fill} {gates}", flush=True)


def finished(out, step):
    """Whether the run in `out` has its final evaluation at `step` (a valid eval.json)."""
    ev = read_json(os.path.join(out, "eval.json"))
    return bool(ev) and ev.get("step") == step and isinstance(ev.get("perplexity"), float)


def drop_empty_cache_entries(path):
    """Remove the empty entries of the compilation cache in path. JAX writes an entry in place,
    opening its file and then writing it: a run interrupted between the two (Ctrl-C while
    compiling) leaves an empty file, which every later run failed to read, warned about (two
    lines on stderr) and compiled anew, since JAX never rewrites an entry that exists."""
    remove_files(path, lambda entry: entry.name.endswith("-cache") and entry.stat().st_size == 0)


def use_compilation_cache(cache_dir):
    """Keep the compiled programs in cache_dir/jax (JAX's persistent compilation cache), unless
    JAX_COMPILATION_CACHE_DIR already names a cache. A later run with the same config loads its
    programs instead of compiling them: it starts sooner (and leaves fill_heap_holes less to
    do). A run with the cache warm gives the same numbers to the last digit."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return
    drop_empty_cache_entries(os.path.join(cache_dir, "jax"))
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # all of them: no compiling at all


def train(args, given):
    """Every check (flags, run directory, data, checkpoints, memory) comes before the first
    write: a refused command leaves every file as it was. given: the flags argv gave."""
    with contextlib.ExitStack() as held:  # the run directory's lock
        return _train(args, given, held)


def _train(args, given, held):
    t_start = time.time()
    out, config, tokenizer = run_config(args, given)
    locked = lock_run_dir(out, held)  # before the checkpoint is read: a resume elsewhere may be writing it
    ckpt_path = os.path.join(out, "checkpoint.npz")
    train_tokens, valid_tokens, valid_distances, tok_path, documents = prepare_data(config, args, tokenizer)
    use_compilation_cache(args.cache_dir)  # before the first compile
    stream = data.segment_batches(train_tokens, config.batch_size, config.segment_length, config.seed)
    params, opt_state, state, step = initial_state(config, args, out, stream, documents)
    if args.init_from and step:  # fine-tuning: --steps more steps after the checkpoint's
        config = config.replace(steps=step + config.steps)
    if args.resume and step == config.steps and finished(out, step):
        print(f"{out} finished at step {step} (eval.json): nothing to do; give --steps to train further.")
        return 0
    if not locked:  # a new directory: made and locked now, and still without a run in it
        os.makedirs(out, exist_ok=True)
        lock_run_dir(out, held)
    if not args.resume and holds_run(out):
        raise UsageError(f"{out} already holds a run, which another train.py started meanwhile; choose another --out.")
    drop_partial_files(out)
    write_run_files(out, args, config, tok_path, step)
    params, opt_state, state, place = distribute(params, opt_state, state)
    train_step, eval_step = make_train_step(step_config(config)), make_eval_step(step_config(config))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"run {out}: {n_params / 1e6:.2f}M params, {sum(map(len, train_tokens)) / 1e6:.2f}M train tokens, "
          f"{len(train_tokens)} train / {len(valid_tokens)} valid documents, device {jax.devices()[0].platform}"
          f" x{jax.device_count()}, memory {config.memory_size} in layers {list(config.active_memory_layers)}",
          flush=True)
    pieces = data.load_tokenizer(tok_path).get_piece_size()
    if pieces < config.vocab_size:  # SentencePiece stops early when the corpus has no more merges to learn
        print(f"note: the tokenizer has {pieces} pieces, fewer than the vocabulary size {config.vocab_size}: "
              f"{config.vocab_size - pieces} rows of the embedding and of the output layer will never be used "
              f"(--vocab-size {pieces} trains without them).", flush=True)

    with interrupt_flag() as stop, open(os.path.join(out, "metrics.jsonl"), "a") as log:
        t_log, tokens_since, first_step = time.time(), 0, step
        while step < config.steps:
            batch = next(stream)
            mt.check_tokens(batch["tokens"], config.vocab_size)
            new = train_step(params, opt_state, state, place({k: batch[k] for k in ("tokens", "targets", "mask", "reset")}))
            metrics = jax.device_get(new[3])
            if not metrics["finite"]:  # a non-finite loss, or weights that overflowed in the update
                print(f"error: the loss or the weights became non-finite at step {step + 1}; stopped, the last "
                      f"checkpoint ({ckpt_path}) is kept.", file=sys.stderr)
                return 3
            (params, opt_state, state), step = new[:3], step + 1
            if step == first_step + 1:  # the step is compiled now, and the heap full of the compiler's holes
                fill_heap_holes()
            tokens_since += int(metrics["tokens"])
            if step % args.log_every == 0 or step == config.steps:
                log_step(log, step, metrics, config, tokens_since / (time.time() - t_log))
                t_log, tokens_since = time.time(), 0
            if args.eval_every and step % args.eval_every == 0 and step < config.steps:
                log.write(json.dumps(eval_record(step, params, config, valid_tokens, valid_distances, eval_step)) + "\n")
            if step % args.save_every == 0 or step == config.steps or stop["signal"]:
                save_checkpoint(ckpt_path, step, params, opt_state, state, stream.position(), documents)
            if stop["signal"]:
                print(f"interrupted at step {step}: checkpoint saved to {ckpt_path}; continue with "
                      f"--out {out} --resume", file=sys.stderr)
                return 130

    try:
        result = {"step": step, **full_evaluation(params, config, valid_tokens, valid_distances, eval_step)}
    except KeyboardInterrupt:
        print(f"interrupted during the final evaluation; the checkpoint of step {step} is saved: "
              f"--out {out} --resume evaluates it.", file=sys.stderr)
        return 130
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "eval_loss": result["loss"], "eval_perplexity": result["perplexity"],
                            **{k: v for k, v in result.items() if k.startswith("reference_loss")}}) + "\n")
    atomic_write(os.path.join(out, "eval.json"), json_text(result))
    print(f"{format_eval(step, result)} | {result['tokens']} tokens | {time.time() - t_start:.0f} s total | "
          f"{out}/eval.json", flush=True)
    return 0


def full_evaluation(params, config, docs, distances, eval_step):
    """evaluate(), plus the memory-off ablation for a memory model: its loss and perplexity,
    and its reference losses, under the same names with a _memory_off suffix."""
    result = evaluate(params, config, docs, config.batch_size, eval_step, distances)
    if config.active_memory_layers:
        off = evaluate(mt.memory_off(params), config, docs, config.batch_size, eval_step, distances)
        result.update({f"{k}_memory_off": v for k, v in off.items() if k in ("loss", "perplexity") or
                       k.startswith("reference_loss")})
    return result


def format_eval(step, r):
    """The printed line of an evaluation: loss, perplexity, memory off, reference losses."""
    off = f" (memory off {r['perplexity_memory_off']:.2f})" if "perplexity_memory_off" in r else ""
    refs = "".join(f" | ref {b} {r[f'reference_loss_{b}']:.3f}" + (
        f" (off {r[f'reference_loss_{b}_memory_off']:.3f})" if f"reference_loss_{b}_memory_off" in r else "")
        for b in DISTANCE_BANDS if f"reference_loss_{b}" in r)
    return f"eval {step:6d} | loss {r['loss']:.4f} | ppl {r['perplexity']:9.2f}{off}{refs}"


def eval_record(step, params, config, docs, distances, eval_step):
    """A periodic evaluation: printed, and returned as one metrics.jsonl record."""
    r = full_evaluation(params, config, docs, distances, eval_step)
    print(format_eval(step, r), flush=True)
    return {"step": step, "eval_loss": r["loss"], "eval_perplexity": r["perplexity"],
            **{k: v for k, v in r.items() if k.startswith(("reference_loss", "perplexity_memory_off"))}}


def _truncate_metrics(path, step, final=False):
    """Keep the lines logged up to the checkpoint's step (a resumed run logs the later ones
    again). final: the run ends at this step, so its final evaluation is redone: drop the
    evaluation line of this step. A half-written line (a crash mid-write) is dropped."""
    keep = []
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                s = rec["step"]
            except (ValueError, TypeError, KeyError, RecursionError):
                continue
            if isinstance(s, int) and (s < step or (s == step and not (final and "eval_loss" in rec))):
                keep.append(line if line.endswith(b"\n") else line + b"\n")
    atomic_write(path, b"".join(keep))


def main(argv=None):
    # argv is parsed a second time to tell which flags it gives; having parsed once, it cannot fail
    return run_main(build_parser(), lambda args: train(args, given_flags(argv)), argv)


if __name__ == "__main__":
    exit_with(main())

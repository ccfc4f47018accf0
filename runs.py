"""Files and processes, for every script: run directories, atomic writes, checkpoints, resume
checks, typed flags, locking, signals, and the one-line error exit. Nothing here is about attention.

A run directory holds config.json, metrics.jsonl, eval.json, tokenizer.model and checkpoint.npz.
Every check comes before the first write: a refused command leaves every file as it was.
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import signal
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import data
import memorizing_transformer as mt

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.npz", "eval.json", "tokenizer.model")
# The flags that choose a run's data and its validation: --resume takes the run's, and so does
# --init-from for each one not given.
RUN_DATA_ARGS = (
    "data",
    "data_format",
    "eval_docs",
    "eval_tokens",
    "valid_fraction",
    "min_doc_tokens",
    "suffixes",
)
# What config.json must hold under "args" to be resumed or evaluated, and the type of each.
RUN_ARGS = {
    "data": str,
    "data_format": str,
    "valid_fraction": float,
    "eval_docs": int,
    "eval_tokens": int,
}
# What --resume may change: how far the run goes, and how often it logs, evaluates and saves.
RESUME_MAY_CHANGE = (
    "steps",
    "out",
    "resume",
    "log_every",
    "eval_every",
    "curve_tokens",
    "save_every",
    "cache_dir",
    "coordinator",
    "num_processes",
    "process_id",
    "coordinator_timeout",
)
# The config fields that shape the parameters, memory aside: a fine-tuned run keeps its source's.
MODEL_SHAPE = (
    "vocab_size",
    "d_model",
    "num_layers",
    "num_heads",
    "head_dim",
    "d_ff",
    "num_buckets",
)


class UsageError(Exception):
    """Bad input from the user: printed as one sentence, exit code 2."""


plural = data.plural  # the project's one plural


# ----------------------------------------------------------------------------- writing files
def json_text(obj):
    """The text of a JSON file we write, ending in a newline like any text file."""
    return json.dumps(obj, indent=2) + "\n"


@contextlib.contextmanager
def _naming(path):
    """An OSError of a write names no file (a full disk); name path."""
    try:
        yield
    except OSError as e:
        e.filename = path if e.filename is None else e.filename
        raise


def _write_content(f, content):
    if callable(content):
        content(f)
    else:
        f.write(content.encode() if isinstance(content, str) else content)


def atomic_write(path, content):
    """Write `content` (bytes, str, or a function that writes to a binary file) to `path` whole or
    not at all: a hidden temporary file beside it (.NAME.XXXXXXXX.partial), then a rename. The
    file gets the permissions of any new file (the umask)."""
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)),
        prefix=f".{os.path.basename(path)}.",
        suffix=".partial",
    )
    try:
        with _naming(path), os.fdopen(fd, "wb") as f:
            _write_content(f, content)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def is_stream(path):
    """Whether path exists and is neither a regular file nor a directory: a pipe, /dev/stdout."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


def write_output(path, content):
    """A file the user named (--json, --csv, --out ...): written atomically, or, where it is a
    stream, written to as it is (a rename would replace the pipe with a file)."""
    if not is_stream(path):
        return atomic_write(path, content)
    with _naming(path), open(path, "wb") as f:
        _write_content(f, content)


def remove_files(folder, which):
    """Remove the plain files of `folder` (if it exists) that `which(os.DirEntry)` takes."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False) and which(entry):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def drop_partial_files(out):
    """Remove the temporary files that a kill during an atomic write left in the run directory
    `out` (and those of the older name, tmpXXXXXXXX.tmp). Only where this process holds its lock."""
    ours = re.compile(
        r"\.(%s)\.[a-z0-9_]{8}\.partial|tmp[a-z0-9_]{8}\.tmp" % "|".join(map(re.escape, RUN_FILES))
    )
    remove_files(out, lambda entry: ours.fullmatch(entry.name))


def writable_directory(folder):
    """Whether a file can be made in `folder` (as root, os.access passes /proc, where none can)."""
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


def inside(path, directory):
    """Whether path (existing or not, links resolved) is directory or lies below it."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(directory))
    return rel == os.curdir or rel.split(os.sep)[0] != os.pardir


def check_output_file(path, flag, sources=(), caches=()):
    """Refuse, before any work, an output file that cannot be written (no directory, or a directory
    in its place), or that would replace a file of a run directory (RUN_FILES), or lie in one of the
    corpora `sources` or the caches `caches`. Any other existing file is replaced atomically."""
    real = os.path.realpath(path)
    if os.path.basename(real) in RUN_FILES and os.path.isfile(
        os.path.join(os.path.dirname(real), "config.json")
    ):
        raise UsageError(
            f"--{flag} {path} is the {os.path.basename(real)} of the run in "
            f"{os.path.dirname(real)}: an "
            f"output never replaces a run's files; name another file."
        )
    for source in sources:
        if data.inside_corpus(path, source):
            raise UsageError(
                f"--{flag} {path} is inside the corpus {source}: an output never replaces or adds "
                "to a "
                f"corpus's files; name a file outside it."
            )
    for cache in caches:
        if cache and os.path.isdir(cache) and inside(path, cache):
            raise UsageError(
                f"--{flag} {path} is inside the cache {cache}: an output never replaces a cache's "
                "files; "
                f"name a file outside it."
            )
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"cannot write --{flag} {path}: it is a directory.")
    if not is_stream(path) and not writable_directory(folder):
        raise UsageError(f"cannot write --{flag} {path}: {folder} is not a writable directory.")


# What an output flag's --help says of the file it names.
REPLACED = (
    " (an existing file is replaced atomically; a run's own files, and files in a corpus or a "
    "cache, are "
    "refused)"
)


def default_cache():
    return os.environ.get("MT_CACHE") or ".cache"


def read_json(path):
    """A JSON file's object, or None if it is missing, unreadable, truncated or not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# ----------------------------------------------------------------------------- run directories
# Config fields that runs written by the first versions lack: read with the default, which is what
# those versions did.
ADDED_SINCE = ("attention", "init_prev_token_bias", "init_gate_bias")


def json_type(field, value):
    """Whether a config.json value has its Config field's type: a bool is true or false, an int
    not a bool, a float any number, memory_layers a list of ints, a str (or None if the default
    is)."""
    number = lambda x, t: isinstance(x, t) and not isinstance(x, bool)
    return {
        int: number(value, int),
        float: number(value, (int, float)),
        bool: isinstance(value, bool),
        str: isinstance(value, str) or (value is None and field.default is None),
        tuple: isinstance(value, list) and all(number(x, int) for x in value),
    }[field.type]


def read_run_config(run_dir):
    """A run's config.json as {"config": Config, "args": dict}, read strictly: every Config field,
    with its JSON type (ADDED_SINCE's may be missing: their defaults, with a note). A broken file
    is a UsageError naming what is wrong."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir} is not a run directory (no config.json).")
    saved = read_json(path)
    args, fields = (saved.get("args"), saved.get("config")) if saved else (None, None)
    if (
        not isinstance(args, dict)
        or not isinstance(fields, dict)
        or not all(
            isinstance(args.get(k), t) and not isinstance(args.get(k), bool)
            for k, t in RUN_ARGS.items()
        )
        or not (
            isinstance(args.get("suffixes"), (str, type(None)))
            and isinstance(args.get("min_doc_tokens", 0), (int, type(None)))
        )
    ):
        raise UsageError(f"{path} is not a valid run config.")
    # The values as their flags take them: the file's copy of a flag has the flag's range.
    for name, flag_type in (
        ("valid_fraction", fraction),
        ("eval_docs", positive_int),
        ("eval_tokens", count),
    ):
        try:
            flag_type(str(args[name]))
        except argparse.ArgumentTypeError as e:
            raise UsageError(
                f"{path}: its args.{name} {e}, as --{name.replace('_', '-')} must be."
            ) from None
    known = {f.name: f for f in dataclasses.fields(mt.Config)}
    for name in fields:
        if name not in known:
            raise UsageError(
                f"{path} has a field {name!r} that this project's Config does not have."
            )
    missing = [name for name in known if name not in fields]
    for name in missing:
        if name not in ADDED_SINCE:
            raise UsageError(
                f"{path} has no field {name}: every field of the run's Config must be there."
            )
    for name, value in fields.items():
        if not json_type(known[name], value):
            kind = {
                bool: "true or false",
                int: "an integer",
                float: "a number",
                str: "a string",
                tuple: "a list of integers",
            }[known[name].type]
            raise UsageError(f"{path}: the field {name} must be {kind}, got {json.dumps(value)}.")
    if missing:
        say(
            f"note: {path} was written before the field{'s' * (len(missing) > 1)} "
            f"{', '.join(missing)}: read with "
            f"the default{'s' * (len(missing) > 1)}, "
            + ", ".join(f"{n} {known[n].default!r}" for n in missing)
            + "."
        )
    try:
        saved["config"] = mt.Config(**fields)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None
    return saved


def holds_run(out):
    """Whether the directory out holds (a part of) a run: any of its files."""
    return os.path.isdir(out) and any(os.path.lexists(os.path.join(out, f)) for f in RUN_FILES)


def finished(out, step):
    """Whether the run in `out` has its final evaluation at `step` (a valid eval.json)."""
    ev = read_json(os.path.join(out, "eval.json"))
    return bool(ev) and ev.get("step") == step and isinstance(ev.get("perplexity"), float)


def lock_run_dir(out, held):
    """Hold an exclusive lock (flock on the directory itself) until `held`, an ExitStack, closes: a
    second train.py on the same --out is refused. False where the directory does not exist yet,
    or the file system cannot lock."""
    try:
        import fcntl

        fd = os.open(out, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(
            f"{out} is in use: another train.py is writing this run; wait for it to end, or choose "
            f"another --out."
        ) from None
    except OSError:
        return False
    return True


def write_run_files(out, args, config, tok_path, step):
    """A run's first writes, once every check has passed: the tokenizer, config.json and an empty
    metrics.jsonl (on --resume, metrics.jsonl without the lines logged after the checkpoint)."""
    os.makedirs(out, exist_ok=True)
    own = os.path.join(out, "tokenizer.model")
    if not (os.path.exists(own) and os.path.samefile(tok_path, own)):
        with open(tok_path, "rb") as f:
            atomic_write(own, f.read())
    if args.resume:
        return truncate_metrics(
            os.path.join(out, "metrics.jsonl"), step, final=step >= config.steps
        )
    atomic_write(
        os.path.join(out, "config.json"),
        json_text({"config": dataclasses.asdict(config), "args": vars(args)}),
    )
    atomic_write(os.path.join(out, "metrics.jsonl"), b"")


def truncate_metrics(path, step, final=False):
    """Keep the lines logged up to the checkpoint's step (a resumed run logs the later ones again);
    final: the run ends at this step, so its final evaluation's line goes too. A half-written
    line is dropped."""
    keep = []
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                s = rec["step"]
            except (ValueError, TypeError, KeyError, RecursionError):
                continue
            if isinstance(s, int) and (
                s < step or (s == step and not (final and "eval_loss" in rec))
            ):
                keep.append(line if line.endswith(b"\n") else line + b"\n")
    atomic_write(path, b"".join(keep))


def use_compilation_cache(cache_dir):
    """Keep the compiled programs in cache_dir/jax (unless JAX_COMPILATION_CACHE_DIR names a cache):
    a later run of the same config loads them instead of compiling, and gives the same numbers.
    An entry that an interrupted compile left empty is removed first (JAX never rewrites one)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return
    remove_files(
        os.path.join(cache_dir, "jax"),
        lambda e: e.name.endswith("-cache") and e.stat().st_size == 0,
    )
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def check_fits(config, batch_size):
    """Refuse a config whose parameters, optimizer, memory and one layer's attention scores alone
    exceed the device's memory, before anything is allocated."""
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    params = jax.eval_shape(lambda: mt.init_params(config, jax.random.PRNGKey(0)))
    state = jax.eval_shape(lambda: mt.init_state(config, batch_size))
    scores = (
        batch_size
        * config.num_heads
        * config.segment_length
        * (config.segment_length + config.cache_length)
        * 4
    )
    need = (
        3 * nbytes(params) + nbytes(state) + 2 * scores
    )  # Adafactor's statistics are at most the params' size
    stats = jax.local_devices()[0].memory_stats() or {}
    have = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise UsageError(
            f"this config (memory size {config.memory_size}, batch {batch_size}) needs at least "
            f"{need / 2**30:.1f} GiB for its parameters, optimizer and memory, more than the "
            f"{have / 2**30:.1f} GiB the device has."
        )


# ----------------------------------------------------------------------------- checkpoints
def _flat(tree):
    return {
        jax.tree_util.keystr(path): np.asarray(x)
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def save_checkpoint(
    path, step, params, opt_state, state, data_position, documents=None, tokenizer=None
):
    """Atomic: a kill during a save leaves the previous checkpoint loadable. documents: the
    fingerprints of the training documents (in which data_position is a position) and of the
    validation documents; tokenizer: the hash of the run's tokenizer.model."""
    arrays = {}
    for name, tree in (("params", params), ("opt", opt_state), ("state", state._asdict())):
        arrays.update({f"{name}{k}": v for k, v in _flat(tree).items()})
    meta = json.dumps(
        {
            "step": step,
            "data_position": data_position,
            "documents": documents,
            "tokenizer": tokenizer,
        }
    )
    atomic_write(
        path, lambda f: np.savez(f, __meta__=np.frombuffer(meta.encode(), np.uint8), **arrays)
    )


def load_checkpoint(path):
    """(meta, arrays) of a checkpoint; a missing, unreadable, truncated or corrupt file is a
    UsageError."""
    if not os.path.isfile(path):
        raise UsageError(f"no checkpoint at {path}.")
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop("__meta__")).decode())
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError
    except PermissionError:
        raise UsageError(f"cannot read the checkpoint {path}: permission denied.") from None
    except Exception:
        raise UsageError(f"checkpoint {path} is truncated or corrupt.") from None
    return meta, arrays


def restore_tree(template, arrays, prefix, path, strict=True):
    """The arrays of a checkpoint under `prefix` ("params", "opt", "state"), in the template's
    structure and dtypes; shapes must match. strict=False: a leaf the checkpoint lacks (a gate
    added to a run without memory) keeps the template's value."""
    leaves = []
    for p, x in jax.tree_util.tree_flatten_with_path(template)[0]:
        key = prefix + jax.tree_util.keystr(p)
        if key not in arrays:
            if strict:
                raise UsageError(
                    f"checkpoint {path} has no {key}: it was written for another config."
                )
            leaves.append(x)
            continue
        if arrays[key].shape != x.shape:
            raise UsageError(
                f"checkpoint {path} has {key} of shape {arrays[key].shape}, but this config needs "
                f"{x.shape}."
            )
        if not same_kind(arrays[key].dtype, np.dtype(x.dtype)):
            raise UsageError(
                f"checkpoint {path} has {key} of dtype {arrays[key].dtype}, but this config needs "
                f"{np.dtype(x.dtype)}: it is corrupt or was not written by train.py."
            )
        if prefix == "params" and not np.all(np.isfinite(arrays[key])):
            raise UsageError(
                f"checkpoint {path} has non-finite values in {key}: its weights cannot be used."
            )
        leaves.append(jnp.asarray(arrays[key], x.dtype))
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def same_kind(stored, wanted):
    """Whether a stored array can be read as `wanted`: a float as any float (bfloat16 is stored
    as 2-byte raw values), an integer as an integer, a bool as a bool; never a string, an
    object or a complex number."""
    if wanted.kind == "f" or wanted == jnp.bfloat16:
        return (
            stored.kind == "f"
            or stored == jnp.bfloat16
            or (stored.kind == "V" and stored.itemsize == 2)
        )
    if wanted.kind in "iu":
        return stored.kind in "iu"
    return stored.kind == wanted.kind


def check_same_model(params, arrays, path):
    """Fine-tuning (and evaluate.py) may add memory to a run's model or drop it, nothing else: every
    parameter but a memory layer's gate must be in both the checkpoint and this config."""
    gate = lambda key: key.endswith("['gate_bias']")
    ours = {
        "params" + jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    theirs = {k for k in arrays if k.startswith("params")}
    missing, extra = (
        sorted(k for k in ours - theirs if not gate(k)),
        sorted(k for k in theirs - ours if not gate(k)),
    )
    if missing or extra:
        which = (
            f"has no {missing[0]}"
            if missing
            else f"has {extra[0]}, which this config has no place for"
        )
        raise UsageError(
            f"checkpoint {path} {which}: it holds another model (other layers or widths), and only "
            f"memory may be added to a run's model or dropped from it."
        )


def restore_optimizer(opt_state, params, arrays, source_config, path):
    """Adafactor's state from another run's checkpoint (fine-tuning): the step count, and each
    parameter's statistics matched by the parameter's name (a new gate shifts the leaves' order).
    A parameter the source lacks keeps fresh statistics."""
    names = lambda tree: [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    source = {
        n: i
        for i, n in enumerate(
            names(jax.eval_shape(lambda: mt.init_params(source_config, jax.random.PRNGKey(0))))
        )
    }
    index = [
        source.get(n) for n in names(params)
    ]  # this run's leaf j -> the source's leaf, or None

    def statistics(key):
        return [
            x if i is None else restore_tree(x, arrays, f"opt['{key}'][{i}]", path)
            for x, i in zip(opt_state[key], index)
        ]

    return {
        "count": restore_tree(opt_state["count"], arrays, "opt['count']", path),
        "v": statistics("v"),
        "m": None if opt_state["m"] is None else statistics("m"),
    }


def resume(out, params, opt_state, state, stream, documents, source, steps):
    """(params, optimizer state, model state, step) from the checkpoint in `out`, the templates
    given as shapes; the data stream moved to where it stopped, in the same documents (their
    fingerprints, `documents`, must be the checkpoint's)."""
    path = os.path.join(out, "checkpoint.npz")
    if not os.path.isfile(path):
        raise UsageError(
            f"{out} has no checkpoint to resume from (stopped before its first save); delete the "
            f"directory to start the run again."
        )
    meta, arrays = load_checkpoint(path)
    params, opt_state = (
        restore_tree(params, arrays, "params", path),
        restore_tree(opt_state, arrays, "opt", path),
    )
    state = mt.State(**restore_tree(state._asdict(), arrays, "state", path))
    changed = (
        f"the corpus {source} is not the one the checkpoint in {out} was trained on (its documents "
        "were "
        "added to, removed or edited since, or the run's tokenizer.model was replaced; for "
        "stdlib, another "
        "Python's library): --resume would continue its rows in other documents. Restore the "
        "corpus, or "
        f"fine-tune the run into a new --out with --init-from"
    )
    if meta.get("documents") not in (
        None,
        documents,
    ):  # (a checkpoint from before fingerprints has none)
        raise UsageError(changed + ".")
    try:
        stream.restore(meta["data_position"])
    except (KeyError, TypeError, ValueError, IndexError):
        raise UsageError(
            f"checkpoint {path} has a data position that does not fit the training documents: it "
            "is "
            f"truncated or corrupt, or {changed}."
        ) from None
    if meta["step"] > steps:
        raise UsageError(
            f"the checkpoint in {out} is at step {meta['step']}, past --steps {steps}."
        )
    return params, opt_state, state, meta["step"]


def init_from(run_dir, params, opt_state, fresh_start):
    """Fine-tuning (Sec. 4.4): another run's weights (a parameter it lacks starts fresh) and, unless
    fresh_start, its step count and Adafactor's statistics. Returns (params, opt_state, step)."""
    path = os.path.join(run_dir, "checkpoint.npz")
    meta, arrays = load_checkpoint(path)
    check_same_model(params, arrays, path)
    params = restore_tree(params, arrays, "params", path, strict=False)
    if fresh_start:
        return params, opt_state, 0
    source = read_run_config(run_dir)["config"]
    return params, restore_optimizer(opt_state, params, arrays, source, path), meta["step"]


# ----------------------------------------------------------------------------- typed flags
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except where the help says it or there is none (None)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag in one line on stderr, and `-1e3` read as a number, not a flag
    (Python 3.11's argparse knows only -3 and -.5; no flag of ours starts with "-" and a digit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")

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
            words = {0: "must not be negative", 1: "must be positive"}.get(
                low, f"must be at least {low}"
            )
            raise argparse.ArgumentTypeError(
                f"{words}, got {value}" if value < low else f"must be at most {high}, got {value}"
            )
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


def fraction(text):
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def path_arg(text):
    """A path, but not the empty string (an unset shell variable would pass as the default)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a path, got an empty string")
    return text


def host_port(text):
    """HOST:PORT, the port a number from 1 to 65535 (an IPv6 host in brackets: [::1]:8476)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(
            f"takes HOST:PORT with a port from 1 to 65535, got {text!r}"
        )
    return text


def positive_seconds(text):
    value = finite_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text}")
    return value


def memory_layers(text):
    """--memory-layers "1,3" -> (1, 3)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(
            f"--memory-layers takes comma-separated layer indices, got {text!r}."
        ) from None


def train_parser():
    """train.py's flags. A model or training flag left unset is None: the preset's (or the run's)
    value."""
    p = Parser(
        description="Train a Memorizing Transformer (Wu et al., ICLR 2022). A model or "
        "training flag left unset takes the --preset's value (with --init-from, that run's, "
        "unless --preset is given).",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--preset",
        choices=sorted(mt.PRESETS),
        default="tiny",
        help="named config: tiny (2-core CPU), small (one GPU), paper (Sec. 4.2), synthetic (the "
        "2-layer recipe that learns the synthetic task, README)",
    )
    p.add_argument(
        "--data",
        default="stdlib",
        type=path_arg,
        help="stdlib (the running Python's standard library), "
        "synthetic (4000 generated documents with near and far references; synthetic:N for N), or "
        "a PATH",
    )
    p.add_argument(
        "--data-format",
        default="auto",
        choices=["auto", "repo", "repo-deps", "text", "jsonl"],
        help="how to read PATH: repo = a directory per document, repo-deps = same in import "
        "order, text = one .txt file per document, jsonl = one {'text': ...} per line",
    )
    p.add_argument(
        "--suffixes",
        help="for a repository PATH, read only files ending in these, comma-separated, "
        "e.g. .py,.c,.h (Sec. 4.1 keeps a repository's source files); default: every file",
    )
    p.add_argument(
        "--min-doc-tokens",
        type=count,
        default=0,
        help="drop documents shorter than this (4096 gives the paper's C4(4K+))",
    )
    for flag, kind, text in (
        ("--vocab-size", positive_int, "SentencePiece vocabulary size V"),
        ("--d-model", positive_int, "model width E (= num heads x head dim)"),
        ("--num-layers", positive_int, "transformer layers L"),
        ("--num-heads", positive_int, "attention heads H"),
        ("--head-dim", positive_int, "dimension D of each head"),
        ("--d-ff", positive_int, "hidden width F of the feed-forward blocks"),
        (
            "--steps",
            positive_int,
            "training steps (preset's value if unset); with --resume, the step to train "
            "to; with --init-from, the steps to add (unset: the run's config's count)",
        ),
        ("--batch-size", positive_int, "batch rows; each row streams documents in order"),
        ("--grad-accum", positive_int, "micro-batches per step (rows are split between them)"),
        ("--segment-length", positive_int, "tokens per segment T (also the XL cache length)"),
        ("--memory-size", count, "memory slots M per row and head; 0 = no memory"),
        ("--num-neighbors", positive_int, "k retrieved memories per query"),
        ("--lr", finite_float, "base learning rate (1.0 in the paper)"),
        (
            "--init-prev-token-bias",
            finite_float,
            "initial T5 bias at distance 1 in half of the first layer's "
            "heads (0 = none, as in the paper; the synthetic preset uses 6)",
        ),
        (
            "--init-gate-bias",
            finite_float,
            "initial bias of every memory layer's gate: g = sigmoid(bias) mixes "
            "memory and local attention (0 = g 0.5, as in the paper; -2 = g 0.12)",
        ),
        ("--warmup-steps", count, "linear warmup steps before square-root decay"),
    ):
        p.add_argument(flag, type=kind, help=text)
    p.add_argument("--memory-layers", help="comma-separated 0-based kNN layer indices, e.g. 8")
    p.add_argument(
        "--xl-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Transformer-XL cache of the previous segment",
    )
    p.add_argument(
        "--exact-topk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="exact top-k instead of the binned approximate top-k",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="activation and matmul precision "
        "(params, softmax statistics and the loss stay float32)",
    )
    p.add_argument(
        "--memory-dtype",
        choices=["float32", "bfloat16"],
        help="storage of the memory and XL cache (default: the same as --dtype)",
    )
    p.add_argument(
        "--memory-combine",
        choices=["gate", "add", "joint"],
        help="how the kNN and the local results mix: gate (Eqs. 1-2, the paper's), add (their "
        "sum, the gateless form of Sec. 4.6's study), joint (one softmax over the retrieved and "
        "the local pairs)",
    )
    p.add_argument(
        "--attention",
        choices=["explicit", "fused"],
        help="local attention: explicit einsums and "
        "softmax, or fused (jax.nn.dot_product_attention: cuDNN's flash attention on a GPU with "
        "--dtype bfloat16, JAX's own version of it elsewhere); the same math for the valid tokens "
        "(fused "
        "takes padding only at a segment's end, which is all data.py makes)",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0, 2**32 - 1),
        help="seed for the initialization and the order "
        "in which batch rows take training documents; the train/validation split and the traversal "
        "of "
        "repositories are fixed (seed 0), so runs with different seeds are scored on the same "
        "validation documents",
    )
    p.add_argument(
        "--out",
        type=path_arg,
        help="output directory (default runs/<timestamp>); train.py refuses one "
        "that already holds a run unless --resume is given",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its checkpoint, with its "
        "config, data and intervals (--log-every, --eval-every and --save-every may be given "
        "anew); a "
        "finished run with its eval.json: nothing to do, unless --steps goes further",
    )
    p.add_argument(
        "--init-from",
        type=path_arg,
        metavar="RUN_DIR",
        help="fine-tune another run (Sec. 4.4): its "
        "weights, and its step count, learning-rate schedule and Adafactor statistics continue, "
        "for "
        "--steps more steps (a different memory size, or a run without memory: new parameters "
        "start "
        "fresh; the model's layers and widths must stay the run's); the data stream starts anew. "
        "Its "
        "config and data flags are the new run's, changed by each flag given (with --preset: that "
        "preset's config, as without --init-from)",
    )
    p.add_argument(
        "--fresh-start",
        action="store_true",
        help="with --init-from: take only the weights; the step "
        "count, the warmup and Adafactor's statistics start from 0",
    )
    p.add_argument("--log-every", type=positive_int, default=10, help="steps between printed lines")
    p.add_argument(
        "--eval-every",
        type=count,
        default=500,
        help="steps between evaluations (0 = only at the end)",
    )
    p.add_argument("--save-every", type=positive_int, default=100, help="steps between checkpoints")
    p.add_argument(
        "--eval-docs", type=positive_int, default=4, help="validation documents to evaluate"
    )
    p.add_argument(
        "--eval-tokens",
        type=count,
        default=0,
        help="tokens scored from each validation document's start by the final evaluation "
        "(eval.json) and evaluate.py; 0 = the whole document",
    )
    p.add_argument(
        "--curve-tokens",
        type=count,
        default=4096,
        help="the same for the evaluations every --eval-every steps, at most --eval-tokens "
        "(0 = as many)",
    )
    p.add_argument(
        "--valid-fraction", type=fraction, default=0.05, help="share of documents held out"
    )
    p.add_argument(
        "--tokenizer",
        type=path_arg,
        help="an existing SentencePiece .model (default: train one and cache it)",
    )
    p.add_argument(
        "--cache-dir",
        type=path_arg,
        default=default_cache(),
        help="tokenizer and "
        "token cache (keyed on the corpus, the vocabulary size and the validation split), and in "
        "its jax/ "
        "folder the compiled programs, which a later run with the same config loads instead of "
        "compiling "
        "(--resume: the run's, if it still exists)",
    )
    several = p.add_argument_group(
        "several processes (one per host; README)",
        "each process runs the same command "
        "but its --process-id; started by SLURM's srun, its variables stand in for these "
        "flags, and JAX_COORDINATOR_ADDRESS for --coordinator. --out and "
        "--cache-dir must be on a file system that every process sees",
    )
    several.add_argument(
        "--coordinator",
        type=host_port,
        metavar="HOST:PORT",
        help="process 0's host and a free port, the same for every process",
    )
    several.add_argument("--num-processes", type=positive_int, help="processes in the run")
    several.add_argument(
        "--process-id",
        type=count,
        help="this process's id, 0 to --num-processes - 1; process 0 "
        "serves the coordinator and writes the run's files",
    )
    several.add_argument(
        "--coordinator-timeout",
        type=positive_seconds,
        default=60.0,
        help="seconds to wait for "
        "the coordinator and the other processes; a process that stops answering ends the others "
        "after as long",
    )
    return p


def given_flags(argv):
    """The flags that argv gives, by their names in args: parsed, a flag left out and one given at
    its default value look alike."""
    blank = train_parser()
    blank.set_defaults(**dict.fromkeys(vars(blank.parse_args([])), None))
    return {name for name, value in vars(blank.parse_args(argv)).items() if value is not None}


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
        raise UsageError(
            f"{base_name}'s memory layer {max(base.memory_layers)} is out of range for "
            "--num-layers "
            f"{n}; give --memory-layers too, a 0-based index below {n} (the paper's is near the "
            "top: 8 "
            f"of 12)."
        )
    try:
        return base.replace(**changes)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------------- resume and fine-tune checks
def check_run_data_here(source):
    """A run keeps its --data as typed: a relative path is relative to where the run started."""
    if not (
        source == "stdlib"
        or data.is_synthetic(source)
        or os.path.isabs(source)
        or os.path.exists(source)
    ):
        raise UsageError(
            f"the run's --data {source!r} does not exist from {os.getcwd()}: a relative path is "
            "read "
            "from the directory the command runs in, so run it from the one the run was started "
            "in."
        )


def resume_conflict(args, saved, out, given):
    """The first flag of `given` that would change the run saved in out (its model, training or
    data; not RESUME_MAY_CHANGE), as (the flag as typed, the run's value); None if there is none."""
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
            value, was = (
                os.path.realpath(value),
                os.path.realpath(os.path.join(out, "tokenizer.model")),
            )
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
        conflict = resume_conflict(args, saved, out, given)
        if conflict:
            raise UsageError(
                f"--resume continues the run in {out} as it was configured, and {conflict[0]} "
                "would "
                f"change it (the run's: {conflict[1]}); drop the flag, or fine-tune the run into a "
                "new "
                f"--out with --init-from."
            )
        config = saved["config"].replace(steps=args.steps) if args.steps else saved["config"]
        for k in RUN_DATA_ARGS:
            setattr(args, k, saved["args"].get(k))
        for k, least in (
            ("log_every", 1),
            ("eval_every", 0),
            ("save_every", 1),
        ):  # the run's, unless given
            v = saved["args"].get(k)
            if k not in given and isinstance(v, int) and not isinstance(v, bool) and v >= least:
                setattr(args, k, v)
        v = saved["args"].get(
            "cache_dir"
        )  # and its cache, unless given or gone (a run moved elsewhere)
        if "cache_dir" not in given and isinstance(v, str) and v and os.path.isdir(v):
            args.cache_dir = v
        args.min_doc_tokens = args.min_doc_tokens or 0
        check_run_data_here(args.data)
        tokenizer = os.path.join(out, "tokenizer.model")
    else:
        if holds_run(out):
            raise UsageError(
                f"{out} already holds a run: continue it with --resume, or choose another --out."
            )
        tokenizer, base = args.tokenizer, None
        if args.init_from:
            tokenizer = os.path.join(args.init_from, "tokenizer.model")
            if not os.path.isfile(tokenizer):
                raise UsageError(
                    f"--init-from {args.init_from} is not a run directory (no tokenizer.model)."
                )
            if args.tokenizer and os.path.realpath(args.tokenizer) != os.path.realpath(tokenizer):
                raise UsageError(
                    f"--init-from {args.init_from} keeps its run's tokenizer, whose ids its "
                    "weights "
                    f"read; drop --tokenizer {args.tokenizer}."
                )
            saved = read_run_config(args.init_from)
            source = saved["config"]
            if (
                "preset" not in given
            ):  # the run's config, as --resume takes it, changed by the flags given
                base = source
            for k in RUN_DATA_ARGS:  # and its data, unless given
                if k not in given and k in saved["args"]:
                    setattr(args, k, saved["args"][k])
            args.min_doc_tokens = args.min_doc_tokens or 0
            if "data" not in given:
                check_run_data_here(args.data)
        config = config_from_args(args, base, f"--init-from {args.init_from}" if base else None)
        if args.init_from:
            other = [
                f"{f} {getattr(source, f)} (this run: {getattr(config, f)})"
                for f in MODEL_SHAPE
                if getattr(source, f) != getattr(config, f)
            ]
            if other:
                raise UsageError(
                    f"--init-from {args.init_from} is another model: its {', '.join(other)}; only "
                    "memory may be added to a run's model or dropped from it, so drop or change "
                    "those "
                    f"flags."
                )
    for path, flag in ((out, "--out"), (args.cache_dir, "--cache-dir")):
        if data.inside_corpus(path, args.data):
            raise UsageError(
                f"{flag} {path} is inside the corpus --data {args.data}: what the run writes there "
                f"would be read as part of its own corpus; choose a {flag} outside it, or a hidden "
                "one "
                f"(a name starting with '.', which no corpus reads)."
            )
    check_writable_dir(out, "--out")
    check_writable_dir(args.cache_dir, "--cache-dir")
    if config.batch_size % (jax.device_count() * config.grad_accum):
        devices = f"{jax.device_count()} devices" + (
            f" ({jax.process_count()} processes x {jax.local_device_count()})"
            if jax.process_count() > 1
            else ""
        )
        raise UsageError(
            f"batch_size {config.batch_size} must be divisible by {devices} x "
            f"grad_accum {config.grad_accum}."
        )
    check_fits(config, config.batch_size)
    return out, config, tokenizer


# ----------------------------------------------------------------------------- signals and leaving
@contextlib.contextmanager
def interrupt_flag():
    """Ctrl-C and SIGTERM set flag["signal"] instead of stopping: the training loop saves and
    exits."""
    flag = {"signal": None}
    old = {
        s: signal.signal(s, lambda signum, _: flag.update(signal=signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def dropped_interrupts_raised_again(delay=0.01):
    """Deliver again the Ctrl-Cs that Python and JAX drop. A KeyboardInterrupt raised in a garbage
    collection callback or a __del__ (JAX runs one at every collection) is printed and dropped by
    Python: here SIGALRM delivers it again `delay` seconds later, to what SIGINT does then. JAX
    starts its plugins under a bare `except:` and logs what they raise: such a record is raised
    again from the logging call (_raise_logged_interrupt). Without setitimer (Windows): neither."""

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
    """A logging filter: a KeyboardInterrupt that logging caught is raised again, not printed."""
    if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
        raise record.exc_info[1]
    return True


def _backend_failed(e):
    """Whether e was raised where JAX starts its backend (a JAX_PLATFORMS that cannot start)."""
    frames = traceback.extract_tb(e.__traceback__)
    return any(
        f.filename.endswith(os.path.join("jax", "_src", "xla_bridge.py")) for f in frames[-3:]
    )


def run_command(command, args):
    """Run a command the way every script here does: bad input (flags, files, data) is one sentence
    on stderr and exit code 2; Ctrl-C or SIGTERM is one line and exit code 130."""
    old = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with dropped_interrupts_raised_again():
            return command(args)
    except (UsageError, data.DataError) as e:
        say(f"error: {e}")
        return 2
    except (
        BrokenPipeError
    ):  # stdout's reader stopped reading (`| head`): stop quietly, as shell tools do
        return _stdout_gone()
    except OSError as e:  # a file the checks did not foresee: say which, and why
        say(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename is not None else ""))
        return 2
    except (
        MemoryError,
        RuntimeError,
        AssertionError,
    ) as e:  # (jax.errors.JaxRuntimeError is a RuntimeError)
        if isinstance(e, MemoryError) or (
            isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)
        ):
            say(
                "error: the device ran out of memory; lower --batch-size, --segment-length or "
                "--memory-size."
            )
        elif _backend_failed(e):
            say(
                "error: JAX could not start its backend "
                f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}): "
                f"{' '.join(str(e).split()) or 'no backend'}; unset JAX_PLATFORMS to let JAX "
                "choose one, or see the "
                f"README's GPU install."
            )
        else:
            raise
        return 2
    except KeyboardInterrupt:
        say("interrupted; no file was left half-written.")
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def say(line):
    """One line on stderr (an error or a note), where nothing fails if stderr is closed or
    broken."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(line, file=sys.stderr, flush=True)


def run_main(parser, command, argv):
    """A script's main(): parse argv (--help, or a bad flag in one line, end here with 0 or 2), then
    run_command."""
    for name in ("stdout", "stderr"):  # started with a stream closed (`>&-`): Python has None there
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    if sys.stdout is sys.__stdout__ and getattr(sys.stdout, "errors", None) == "strict":
        sys.stdout.reconfigure(
            errors="surrogateescape"
        )  # print a path that is not UTF-8 as its bytes
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    # XLA reads XLA_FLAGS when it starts, and a word that is no flag ends the process there.
    words = os.environ.get("XLA_FLAGS", "").split()
    bad = [w for w in words if not re.fullmatch(r"--[A-Za-z0-9_]+(=\S*)?", w)]
    if bad:
        say(
            f"error: XLA_FLAGS holds {bad[0]!r}, which is not an XLA flag (--name or --name=value)."
        )
        return 2
    return run_command(command, args)


def _stdout_gone():
    """Point stdout at /dev/null, so that nothing more fails on it; the exit code of SIGPIPE."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (
        OSError,
        ValueError,
        AttributeError,
    ):  # stdout is not a file (a test's capture), or closed
        pass
    return 141


def exit_with(code):
    """Leave with `code` at once, once stdout and stderr are flushed: without the interpreter's
    teardown, which can crash while JAX's threads still run (after an interrupt), and during which
    a signal would kill the process without a word."""

    def interrupted(*_):
        os.write(2, b"interrupted; no file was left half-written.\n")
        os._exit(130)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, interrupted)
    try:
        if sys.stdout is not None:  # (None: started with stdout closed)
            sys.stdout.flush()
    except BrokenPipeError:
        gone = _stdout_gone()
        code = code or gone  # a failure keeps its own code
    except (OSError, ValueError):  # a stdout that cannot take what is left: the code stands
        pass
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.flush()
    os._exit(code or 0)


# ----------------------------------------------------------------------------- a run's start
class Run(NamedTuple):
    """What train.py's loop needs, checked and prepared before its first write."""

    out: str
    config: mt.Config
    train_docs: list
    valid_docs: list
    distances: object  # synthetic data: per validation document, how far back each reference is
    tok_path: str
    documents: dict  # the fingerprints of the train and validation documents
    held_out: tuple  # (validation documents, their share of the corpus's tokens)
    stream: data.SegmentBatches
    params: dict
    opt_state: dict
    state: mt.State
    step: int
    done: bool  # --resume of a run that finished at its --steps: nothing to do


def open_run(args, given, held, fresh):
    """Check everything (flags, run directory, data, checkpoints, memory), lock the directory
    in `held`, prepare the data, restore or start the weights (fresh(config) -> params, optimizer
    state) and claim the directory with the run's files. With several processes each check is
    agreed (one refusal stops them all), and only process 0 writes."""
    import multihost  # (multihost imports this module)

    agree, is_main = multihost.agree, multihost.is_main()
    out, config, tokenizer = agree(lambda: run_config(args, given))
    locked = agree(lambda: is_main and lock_run_dir(out, held))  # before the checkpoint is read

    def prepare():
        use_compilation_cache(args.cache_dir)  # before the first compile
        return data.prepare(data_options(args), config.vocab_size, tokenizer)

    prepared = agree(lambda: prepare() if is_main else None)  # process 0 fills the caches
    ready = agree(lambda: prepared or prepare())
    train_docs, valid_docs, distances, tok_path, documents, held_out = ready
    stream = data.segment_batches(train_docs, config.batch_size, config.segment_length, config.seed)
    start = agree(lambda: initial_state(config, args, out, stream, documents, fresh))
    params, opt_state, state, step = start
    flags = {k: v for k, v in vars(args).items() if k not in RESUME_MAY_CHANGE}
    shared = [out, dataclasses.asdict(config), documents, data.file_hash(tok_path), step, flags]
    multihost.check_same(json.dumps(shared))
    if args.init_from and step:  # fine-tuning: --steps more steps after the checkpoint's
        config = config.replace(steps=step + config.steps)
    done = bool(args.resume and step == config.steps and finished(out, step))

    def claim():  # a new directory: made and locked now, and still without a run in it
        if not locked:
            os.makedirs(out, exist_ok=True)
            lock_run_dir(out, held)
        if not args.resume and holds_run(out):
            raise UsageError(
                f"{out} already holds a run, which another train.py started "
                "meanwhile; choose another --out."
            )
        drop_partial_files(out)
        write_run_files(out, args, config, tok_path, step)

    if not done:
        agree(lambda: claim() if is_main else None)
    return Run(
        out,
        config,
        train_docs,
        valid_docs,
        distances,
        tok_path,
        documents,
        held_out,
        stream,
        params,
        opt_state,
        state,
        step,
        done,
    )


def data_options(args):
    """The data flags of a parsed command line as data.prepare takes them."""
    return data.DataOptions(**{name: getattr(args, name) for name in data.DataOptions._fields})


def save_first_or_undo(out, start_step, path, *checkpoint):
    """save_checkpoint; where a new run's first checkpoint cannot be written (a full disk), the
    files the run wrote go too, so that the directory is as it was, and the error says why."""
    had = os.path.isfile(path)
    try:
        save_checkpoint(path, *checkpoint)
    except OSError as e:
        undo = not had and start_step == 0
        for name in RUN_FILES if undo else ():
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name))
        end = "; the run's files are removed." if undo else "; the last checkpoint is kept."
        raise UsageError(f"cannot write the checkpoint {path}: {e.strerror or e}{end}") from None


def initial_state(config, args, out, stream, documents, fresh):
    """(params, optimizer state, model state, step): fresh, resumed from the checkpoint in --out,
    or with --init-from's weights. Reads, never writes."""
    state = mt.init_state(config, config.batch_size)
    if args.resume:  # the checkpoint has every value: the structure and dtypes are enough
        shapes = jax.eval_shape(lambda: fresh(config))
        return resume(out, *shapes, state, stream, documents, args.data, config.steps)
    params, opt_state = fresh(config)
    if args.init_from:  # fine-tuning continues the schedule and the optimizer, unless --fresh-start
        params, opt_state, step = init_from(args.init_from, params, opt_state, args.fresh_start)
        return params, opt_state, state, step
    return params, opt_state, state, 0


def note_unused_pieces(tok_path, vocab_size):
    """SentencePiece stops early when the corpus has no more merges to learn: say so."""
    pieces = data.load_tokenizer(tok_path).get_piece_size()
    if pieces < vocab_size:
        print(
            f"note: the tokenizer has {pieces} pieces, fewer than the vocabulary size "
            f"{vocab_size}: {vocab_size - pieces} rows of the embedding and of the output layer "
            f"will never be used (--vocab-size {pieces} trains without them).",
            flush=True,
        )

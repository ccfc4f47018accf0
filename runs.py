"""Run directories, for every script: config.json, checkpoints, metrics,
resume and fine-tune checks, atomic writes, locks, and a run's start. Nothing
here is about attention or flags.

A run directory holds config.json, metrics.jsonl, eval.json, tokenizer.model
and checkpoint.npz. Every check comes before the first write: a refused
command leaves every file as it was.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import re
import secrets
import stat
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import cli
import corpora
import data
import memorizing_transformer as mt
import multihost
import presets

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoint.npz", "eval.json", "tokenizer.model")
# The flags that choose a run's data and its validation: --resume takes the run's, and so
# does --init-from for each one not given.
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


# ----------------------------------------------------------------------------- writing files
def json_text(obj):
    """The text of a JSON file we write, ending in a newline like any text file.
    JSON has no NaN or infinity: a number that is not finite is written null (a
    loss over no token)."""
    return json.dumps(finite_or_null(obj), indent=2, allow_nan=False) + "\n"


def finite_or_null(obj):
    """obj with every float that is not finite replaced by None, in dicts, lists
    and tuples."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


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


def _temp_name(path):
    """A hidden name beside path for its temporary file: .NAME.XXXXXXXX.partial
    (NAME cut to 200 characters, so that the name fits wherever path's does)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name[:200]}.{secrets.token_hex(4)}.partial")


def _name(fd, name):
    """Give the unnamed file fd (O_TMPFILE) a name: through /proc, or
    linkat(AT_EMPTY_PATH) where /proc's link crosses a mount. False where
    neither can.
"""
    with contextlib.suppress(OSError):
        os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)
        return True
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.linkat(fd, b"", -100, os.fsencode(name), 0x1000) == 0  # AT_FDCWD, EMPTY_PATH
    return False


def _unnamed_file(folder):
    """An O_TMPFILE in folder that can be named once whole, or None where the
    system has none: a probe file is named and removed first."""
    if not hasattr(os, "O_TMPFILE"):
        return None
    try:
        probe = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except OSError:
        return None
    name = _temp_name(os.path.join(folder, "probe"))
    named = _name(probe, name)
    os.close(probe)
    if not named:
        return None
    os.remove(name)
    return os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600)


def atomic_write(path, content):
    """Write `content` (bytes, str, or a function that writes to a binary file)
    to `path` whole or not at all: a temporary file beside it, then a rename.
    Where the file system has O_TMPFILE (Linux), the temporary file has no name
    until it is whole, so a killed command leaves nothing behind; elsewhere it
    is a hidden .NAME.XXXXXXXX.partial, which a kill may leave. A file that is
    replaced keeps its mode; a new one gets the umask's."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = _unnamed_file(folder), None
    if fd is None:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)[:200]}.",
                                   suffix=".partial")
    try:
        with _naming(path), os.fdopen(fd, "wb") as f:
            _write_content(f, content)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
            if tmp is None:  # whole: now it gets a name, for the rename
                tmp = _temp_name(path)
                if not _name(f.fileno(), tmp):
                    raise OSError(f"cannot name the file written for {path}")
        os.replace(tmp, path)
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.remove(tmp)


def is_stream(path):
    """Whether path is a pipe or a character device (/dev/stdout, /dev/null): an
    output is written to it in place, never replaced."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


def write_output(path, content):
    """A file the user named (--json, --csv, a memory file ...), checked by
    check_output: written atomically (through a link, to its target), or, where
    it is a stream, written to as it is (a rename would replace the pipe or the
    device with a file)."""
    real = os.path.realpath(path)
    if not is_stream(real):
        return atomic_write(real, content)
    with _naming(path), open(real, "wb") as f:
        _write_content(f, content)


def remove_files(folder, which):
    """Remove the plain files of `folder` (if it exists) that
    `which(os.DirEntry)` takes."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False) and which(entry):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def drop_partial_files(out):
    """Remove the temporary files that a kill during an atomic write left in the
    run directory `out` (and those of the older name, tmpXXXXXXXX.tmp). Only
    where this process holds its lock."""
    ours = re.compile(
        r"\.(%s)\.[a-z0-9_]{8}\.partial|tmp[a-z0-9_]{8}\.tmp" % "|".join(map(re.escape, RUN_FILES))
    )
    remove_files(out, lambda entry: ours.fullmatch(entry.name))


def writable_directory(folder):
    """Whether a file can be made in `folder` (as root, os.access passes /proc,
    where none can)."""
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
    """Refuse, before anything is written, a directory that cannot be created or
    written to."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not writable_directory(probe):
        raise cli.UsageError(f"cannot write to {flag} {path}: {probe} is not a writable directory.")


def inside(path, directory):
    """Whether path (existing or not, links resolved) is directory or lies below
    it."""
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(directory))
    return rel == os.curdir or rel.split(os.sep)[0] != os.pardir


def check_output(path, flag, inputs=(), sources=(), caches=()):
    """The one rule of where a command may write, checked before it works. An
    output never replaces or enters an input of its command (`inputs`: the files
    and directories it reads: the run's files, a memory file, a memorized or
    scored PATH), a corpus (`sources`) or a cache (`caches`), and never replaces
    a run's files. It never replaces what is not a regular file: a pipe or a
    character device is written in place, and anything else (a directory, a
    socket, a block device) is refused. Its name must fit the file system."""
    real = os.path.realpath(path)
    said = f"{flag} {path}"
    if os.path.basename(real) in RUN_FILES and os.path.isfile(
        os.path.join(os.path.dirname(real), "config.json")
    ):
        raise cli.UsageError(
            f"{said} is the {os.path.basename(real)} of the run in {os.path.dirname(real)}: an "
            "output never replaces a run's files; name another file."
        )
    for source in inputs:
        same = os.path.exists(real) and os.path.exists(source) and os.path.samefile(real, source)
        if same or inside(real, source):
            where = "is" if same or os.path.isfile(source) else "is inside"
            raise cli.UsageError(
                f"{said} {where} {source}, which this command reads: an output never replaces "
                "or enters its own input; name a file outside it."
            )
    for source in sources:
        if corpora.inside_corpus(path, source):
            raise cli.UsageError(
                f"{said} is inside the corpus {source}: an output never replaces or adds to a "
                "corpus's files; name a file outside it."
            )
    for cache in caches:
        # The cache's own path counts even before the cache exists, which the output would block.
        if cache and inside(path, cache):
            where = "is" if os.path.realpath(cache) == real else "is inside"
            raise cli.UsageError(
                f"{said} {where} the cache {cache}: an output never replaces a cache's files; "
                "name a file outside it."
            )
    if os.path.isdir(real):
        raise cli.UsageError(f"cannot write {said}: it is a directory.")
    if os.path.exists(real) and not (os.path.isfile(real) or is_stream(real)):
        raise cli.UsageError(
            f"cannot write {said}: it is neither a regular file nor a pipe or terminal, and an "
            "output never replaces one."
        )
    folder = os.path.dirname(real)
    if is_stream(real):
        return
    if not writable_directory(folder):
        raise cli.UsageError(f"cannot write {said}: {folder} is not a writable directory.")
    longest = os.pathconf(folder, "PC_NAME_MAX")
    if len(os.fsencode(os.path.basename(real))) > longest:
        raise cli.UsageError(
            f"cannot write {said}: its name is longer than the {longest} bytes a file name may "
            f"have in {folder}."
        )


def read_json(path):
    """A JSON file's object, or None if it is missing, unreadable, truncated or
    not an object."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# ----------------------------------------------------------------------------- run directories
def json_type(field, value):
    """Whether a config.json value has its Config field's type: a bool is true
    or false, an int not a bool, a float any number, memory_layers a list of
    ints, a str (or None if the default is)."""
    number = lambda x, t: isinstance(x, t) and not isinstance(x, bool)
    return {
        int: number(value, int),
        float: number(value, (int, float)),
        bool: isinstance(value, bool),
        str: isinstance(value, str) or (value is None and field.default is None),
        tuple: isinstance(value, list) and all(number(x, int) for x in value),
    }[field.type]


def read_run_config(run_dir):
    """A run's config.json as {"config": RunConfig, "args": dict}, read
    strictly: every field present with its JSON type; a field missing, added to
    Config after the run was written, reads its default (what the code did
    before it), with a note. A broken file is a cli.UsageError naming what is
    wrong."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        raise cli.UsageError(f"{run_dir} is not a run directory (no config.json).")
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
        raise cli.UsageError(f"{path} is not a valid run config.")
    # The values as their flags take them: the file's copy of a flag has the flag's range.
    for name, flag_type in (
        ("valid_fraction", cli.fraction),
        ("eval_docs", cli.positive_int),
        ("eval_tokens", cli.count),
    ):
        try:
            flag_type(str(args[name]))
        except argparse.ArgumentTypeError as e:
            raise cli.UsageError(
                f"{path}: its args.{name} {e}, as --{name.replace('_', '-')} must be."
            ) from None
    known = {f.name: f for f in dataclasses.fields(presets.RunConfig)}
    for name in fields:
        if name not in known:
            raise cli.UsageError(
                f"{path} has a field {name!r} that this project's Config does not have."
            )
    missing = sorted(name for name in known if name not in fields)
    for name, value in fields.items():
        if not json_type(known[name], value):
            kind = {
                bool: "true or false",
                int: "an integer",
                float: "a number",
                str: "a string",
                tuple: "a list of integers",
            }[known[name].type]
            raise cli.UsageError(
                f"{path}: the field {name} must be {kind}, got {json.dumps(value)}."
            )
    if missing:
        cli.say(
            f"note: {path} was written before the field{'s' * (len(missing) > 1)} "
            f"{', '.join(missing)}: read with "
            f"the default{'s' * (len(missing) > 1)}, "
            + ", ".join(f"{n} {known[n].default!r}" for n in missing)
            + "."
        )
    try:
        saved["config"] = presets.RunConfig(**fields)
    except ValueError as e:
        raise cli.UsageError(f"{path}: {e}") from None
    return saved


def holds_run(out):
    """Whether the directory out holds (a part of) a run: any of its files."""
    return os.path.isdir(out) and any(os.path.lexists(os.path.join(out, f)) for f in RUN_FILES)


def finished(out, step):
    """Whether the run in `out` has its final evaluation at `step` (a valid
    eval.json).
"""
    ev = read_json(os.path.join(out, "eval.json"))
    return bool(ev) and ev.get("step") == step and isinstance(ev.get("perplexity"), float)


def lock_run_dir(out, held):
    """Hold an exclusive lock (flock on the directory itself) until `held`, an
    ExitStack, closes: a second train.py on the same --out is refused. False
    where the directory does not exist yet, or the file system cannot lock."""
    try:
        import fcntl

        fd = os.open(out, os.O_RDONLY)
    except (ImportError, OSError):
        return False
    held.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise cli.UsageError(
            f"{out} is in use: another train.py is writing this run; wait for it to end, or choose "
            f"another --out."
        ) from None
    except OSError:
        return False
    return True


def write_run_files(out, args, config, tok_path, step):
    """A run's first writes, once every check has passed: the tokenizer,
    config.json and an empty metrics.jsonl (on --resume, metrics.jsonl without
    the lines logged after the checkpoint)."""
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
    """Keep the lines logged up to the checkpoint's step (a resumed run logs the
    later ones again); final: the run ends at this step, so its final
    evaluation's line goes too. A half-written line is dropped."""
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
    """Keep the compiled programs in cache_dir/jax (unless
    JAX_COMPILATION_CACHE_DIR names a cache): a later run of the same config
    loads them instead of compiling, and gives the same numbers. An entry that
    an interrupted compile left empty is removed first (JAX never rewrites one).
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return
    remove_files(
        os.path.join(cache_dir, "jax"),
        lambda e: e.name.endswith("-cache") and e.stat().st_size == 0,
    )
    jax.config.update("jax_compilation_cache_dir", os.path.join(cache_dir, "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def check_fits(config, batch_size):
    """Refuse a config whose parameters, optimizer, memory and one layer's
    attention scores alone exceed the device's memory, before anything is
    allocated."""
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
        raise cli.UsageError(
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
    """Atomic: a kill during a save leaves the previous checkpoint loadable.
    documents: the fingerprints of the training documents (in which
    data_position is a position) and of the validation documents; tokenizer: the
    hash of the run's tokenizer.model.
"""
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
    """(meta, arrays) of a checkpoint; a missing, unreadable, truncated or
    corrupt file is a cli.UsageError."""
    if not os.path.isfile(path):
        raise cli.UsageError(f"no checkpoint at {path}.")
    try:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        meta = json.loads(bytes(arrays.pop("__meta__")).decode())
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError
    except PermissionError:
        raise cli.UsageError(f"cannot read the checkpoint {path}: permission denied.") from None
    except Exception:
        raise cli.UsageError(f"checkpoint {path} is truncated or corrupt.") from None
    return meta, arrays


def restore_tree(template, arrays, prefix, path, strict=True):
    """The arrays of a checkpoint under `prefix` ("params", "opt", "state"), in
    the template's structure and dtypes; shapes must match. strict=False: a leaf
    the checkpoint lacks (a gate added to a run without memory) keeps the
    template's value.
"""
    leaves = []
    for p, x in jax.tree_util.tree_flatten_with_path(template)[0]:
        key = prefix + jax.tree_util.keystr(p)
        if key not in arrays:
            if strict:
                raise cli.UsageError(
                    f"checkpoint {path} has no {key}: it was written for another config."
                )
            leaves.append(x)
            continue
        if arrays[key].shape != x.shape:
            raise cli.UsageError(
                f"checkpoint {path} has {key} of shape {arrays[key].shape}, but this config needs "
                f"{x.shape}."
            )
        if not same_kind(arrays[key].dtype, np.dtype(x.dtype)):
            raise cli.UsageError(
                f"checkpoint {path} has {key} of dtype {arrays[key].dtype}, but this config needs "
                f"{np.dtype(x.dtype)}: it is corrupt or was not written by train.py."
            )
        wanted = np.dtype(x.dtype)
        if wanted.kind in "iu" and arrays[key].size:  # checked before the cast, which would wrap
            low, high = np.iinfo(wanted).min, np.iinfo(wanted).max
            if arrays[key].min() < low or arrays[key].max() > high:
                raise cli.UsageError(
                    f"checkpoint {path} has {key} with values outside {wanted}'s range: it is "
                    "corrupt."
                )
        if prefix == "params" and not np.all(np.isfinite(arrays[key])):
            raise cli.UsageError(
                f"checkpoint {path} has non-finite values in {key}: its weights cannot be used."
            )
        leaves.append(jnp.asarray(arrays[key], x.dtype))
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def same_kind(stored, wanted):
    """Whether a stored array can be read as `wanted`: a float as any float
    (bfloat16 is stored as 2-byte raw values), an integer as an integer, a bool
    as a bool; never a string, an object or a complex number."""
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
    """Fine-tuning (and evaluate.py) may add memory to a run's model or drop it,
    nothing else: every parameter but a memory layer's gate must be in both the
    checkpoint and this config."""
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
        raise cli.UsageError(
            f"checkpoint {path} {which}: it holds another model (other layers or widths), and only "
            f"memory may be added to a run's model or dropped from it."
        )


def restore_optimizer(opt_state, params, arrays, source_config, path):
    """Adafactor's state from another run's checkpoint (fine-tuning): the step
    count, and each parameter's statistics matched by the parameter's name (a
    new gate shifts the leaves' order). A parameter the source lacks keeps fresh
    statistics."""
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


def resume(out, params, opt_state, state, stream, documents, source, config):
    """(params, optimizer state, model state, step) from the checkpoint in
    `out`, the templates given as shapes; the data stream moved to where it
    stopped, in the same documents (their fingerprints, `documents`, must be the
    checkpoint's), up to config.steps."""
    path = os.path.join(out, "checkpoint.npz")
    if not os.path.isfile(path):
        raise cli.UsageError(
            f"{out} has no checkpoint to resume from (stopped before its first save); delete the "
            f"directory to start the run again."
        )
    meta, arrays = load_checkpoint(path)
    params, opt_state = (
        restore_tree(params, arrays, "params", path),
        restore_tree(opt_state, arrays, "opt", path),
    )
    arrays = upgrade_state(arrays, config.active_memory_layers)
    state = mt.State(**restore_tree(state._asdict(), arrays, "state", path))
    check_memory_position(state, config, path)
    changed = (
        f"the corpus {source} is not the one the checkpoint in {out} was trained on (its documents "
        "were added to, removed or edited since, or the run's tokenizer.model was replaced; for "
        "stdlib, another Python's library): --resume would continue its rows in other documents. "
        "Restore the corpus, or fine-tune the run into a new --out with --init-from"
    )
    if meta.get("documents") not in (
        None,
        documents,
    ):  # (a checkpoint from before fingerprints has none)
        raise cli.UsageError(changed + ".")
    try:
        stream.restore(meta["data_position"])
    except (KeyError, TypeError, ValueError, IndexError):
        raise cli.UsageError(
            f"checkpoint {path} has a data position that does not fit the training documents: it "
            f"is truncated or corrupt, or {changed}."
        ) from None
    if meta["step"] > config.steps:
        raise cli.UsageError(
            f"the checkpoint in {out} is at step {meta['step']}, past --steps {config.steps}."
        )
    return params, opt_state, state, meta["step"]


def upgrade_state(arrays, memory_layers):
    """A checkpoint's model state in today's names: one written before the XL
    cache and the memory's pending segment became one (State.prev_*) has cache_*
    and pending_*, whose keys and values are the last segment's in both (the
    cache's where it has length, else the pending memory layers' in their
    layers)."""
    if "state['pending_k']" not in arrays:
        return arrays
    arrays = dict(arrays)
    cache = [arrays.pop(f"state['cache_{x}']") for x in ("k", "v", "valid")]
    pending = [arrays.pop(f"state['pending_{x}']") for x in ("k", "v", "valid")]
    if cache[0].shape[3] or not memory_layers:
        new = cache
    else:  # a memory without an XL cache: the other layers' slots are never read
        k, v = (np.zeros(cache[0].shape[:3] + p.shape[3:], p.dtype) for p in pending[:2])
        k[:, list(memory_layers)], v[:, list(memory_layers)] = pending[0], pending[1]
        new = [k, v, pending[2]]
    for name, array in zip(("prev_k", "prev_v", "prev_valid"), new):
        arrays[f"state['{name}']"] = array
    return arrays


def check_memory_position(state, config, path):
    """Refuse a state whose memory write position is outside [0, M) or not a
    multiple of T: the ring buffer's writes would land on the wrong slots."""
    M, T = state.mem_valid.shape[1], config.segment_length
    pos = np.asarray(state.mem_pos)
    bad = pos[(pos < 0) | (pos >= max(M, 1)) | (pos % T != 0)]
    if bad.size:
        raise cli.UsageError(
            f"{path} has a memory write position of {int(bad[0])}, where the memory of {M} slots "
            f"is written at multiples of {T} below {M}: it is corrupt."
        )


def init_from(run_dir, params, opt_state, fresh_start):
    """Fine-tuning (Sec. 4.4): another run's weights (a parameter it lacks
    starts fresh) and, unless fresh_start, its step count and Adafactor's
    statistics. Returns (params, opt_state, step)."""
    path = os.path.join(run_dir, "checkpoint.npz")
    meta, arrays = load_checkpoint(path)
    check_same_model(params, arrays, path)
    params = restore_tree(params, arrays, "params", path, strict=False)
    if fresh_start:
        return params, opt_state, 0
    source = read_run_config(run_dir)["config"]
    return params, restore_optimizer(opt_state, params, arrays, source, path), meta["step"]


# ---------------------------------------------------------------------- resume and fine-tune checks
def check_run_data_here(source):
    """A run keeps its --data as typed: a relative path is relative to where the
    run started."""
    if not (
        source == "stdlib"
        or corpora.is_synthetic(source)
        or os.path.isabs(source)
        or os.path.exists(source)
    ):
        raise cli.UsageError(
            f"the run's --data {source!r} does not exist from {os.getcwd()}: a relative path is "
            "read from the directory the command runs in, so run it from the one the run was "
            "started in."
        )


def resume_conflict(args, saved, out, given):
    """The first flag of `given` that would change the run saved in out (its
    model, training or data; not RESUME_MAY_CHANGE), as (the flag as typed, the
    run's value); None if there is none."""
    config = saved["config"]
    fields = {f.name for f in dataclasses.fields(presets.RunConfig)}
    for name, value in vars(args).items():
        if name in RESUME_MAY_CHANGE or name not in given:
            continue
        if name == "memory_layers":
            value, was = sorted(value), sorted(config.memory_layers)
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
            if corpora.same_source(value, was):  # ./corpus/ is corpus
                continue
        elif name in saved["args"]:
            was = saved["args"][name]
        else:
            continue
        if value != was:
            typed = getattr(args, name)
            flag = "--" + ("" if typed is not False else "no-") + name.replace("_", "-")
            if isinstance(typed, tuple):  # --memory-layers as typed
                typed = ",".join(map(str, typed))
            return flag + ("" if isinstance(typed, bool) else f" {typed}"), was
    return None


def run_config(args, given):
    """Check the flags and the run directory; return the run's output directory,
    config and tokenizer (None: train one). Reads, never writes. given: the
    flags the command line gave."""
    if args.resume and args.init_from:
        raise cli.UsageError("--resume and --init-from cannot be combined.")
    if args.fresh_start and not args.init_from:
        raise cli.UsageError("--fresh-start goes with --init-from.")
    if args.resume and not args.out:
        raise cli.UsageError("--resume needs --out, the run to continue.")
    out = args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    if args.resume:  # the run's own config, data flags and tokenizer; --steps may extend it
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise cli.UsageError(f"there is no run to resume in {out} (no config.json).")
        saved = read_run_config(out)
        conflict = resume_conflict(args, saved, out, given)
        if conflict:
            raise cli.UsageError(
                f"--resume continues the run in {out} as it was configured, and {conflict[0]} "
                f"would change it (the run's: {conflict[1]}); drop the flag, or fine-tune the run "
                "into a new --out with --init-from."
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
            raise cli.UsageError(
                f"{out} already holds a run: continue it with --resume, or choose another --out."
            )
        tokenizer, base = args.tokenizer, None
        if args.init_from:
            tokenizer = os.path.join(args.init_from, "tokenizer.model")
            if not os.path.isfile(tokenizer):
                raise cli.UsageError(
                    f"--init-from {args.init_from} is not a run directory (no tokenizer.model)."
                )
            if args.tokenizer and os.path.realpath(args.tokenizer) != os.path.realpath(tokenizer):
                raise cli.UsageError(
                    f"--init-from {args.init_from} keeps its run's tokenizer, whose ids its "
                    f"weights read; drop --tokenizer {args.tokenizer}."
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
        if base is None:
            base, base_name = presets.PRESETS[args.preset], f"the {args.preset} preset"
        else:
            base_name = f"--init-from {args.init_from}"
        config = cli.config_from_args(args, base, base_name)
        if args.init_from:
            other = [
                f"{f} {getattr(source, f)} (this run: {getattr(config, f)})"
                for f in MODEL_SHAPE
                if getattr(source, f) != getattr(config, f)
            ]
            if other:
                raise cli.UsageError(
                    f"--init-from {args.init_from} is another model: its {', '.join(other)}; only "
                    "memory may be added to a run's model or dropped from it, so drop or change "
                    "those flags."
                )
    for path, flag in ((out, "--out"), (args.cache_dir, "--cache-dir")):
        if corpora.inside_corpus(path, args.data):
            raise cli.UsageError(
                f"{flag} {path} is inside the corpus --data {args.data}: what the run writes there "
                f"would be read as part of its own corpus; choose a {flag} outside it, or a hidden "
                "one (a name starting with '.', which no corpus reads)."
            )
    check_writable_dir(out, "--out")
    check_writable_dir(args.cache_dir, "--cache-dir")
    if config.batch_size % (jax.device_count() * config.grad_accum):
        devices = f"{jax.device_count()} devices" + (
            f" ({jax.process_count()} processes x {jax.local_device_count()})"
            if jax.process_count() > 1
            else ""
        )
        raise cli.UsageError(
            f"batch_size {config.batch_size} must be divisible by {devices} x "
            f"grad_accum {config.grad_accum}."
        )
    check_fits(config, config.batch_size)
    return out, config, tokenizer


# ----------------------------------------------------------------------------- a run's start
class Run(NamedTuple):
    """What train.py's loop needs, checked and prepared before its first write.
    """

    out: str
    config: presets.RunConfig
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
    """Check everything (flags, run directory, data, checkpoints, memory), lock
    the directory in `held`, prepare the data, restore or start the weights
    (fresh(config) -> params, optimizer state) and claim the directory with the
    run's files. With several processes each check is agreed (one refusal stops
    them all), and only process 0 writes."""
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
            raise cli.UsageError(
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
    """save_checkpoint; where a new run's first checkpoint cannot be written (a
    full disk), the files the run wrote go too, so that the directory is as it
    was, and the error says why."""
    had = os.path.isfile(path)
    try:
        save_checkpoint(path, *checkpoint)
    except OSError as e:
        undo = not had and start_step == 0
        for name in RUN_FILES if undo else ():
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name))
        end = "; the run's files are removed." if undo else "; the last checkpoint is kept."
        raise cli.UsageError(
            f"cannot write the checkpoint {path}: {e.strerror or e}{end}"
        ) from None


def initial_state(config, args, out, stream, documents, fresh):
    """(params, optimizer state, model state, step): fresh, resumed from the
    checkpoint in --out, or with --init-from's weights. Reads, never writes."""
    state = mt.init_state(config, config.batch_size)
    if args.resume:  # the checkpoint has every value: the structure and dtypes are enough
        shapes = jax.eval_shape(lambda: fresh(config))
        return resume(out, *shapes, state, stream, documents, args.data, config)
    params, opt_state = fresh(config)
    if args.init_from:  # fine-tuning continues the schedule and the optimizer, unless --fresh-start
        params, opt_state, step = init_from(args.init_from, params, opt_state, args.fresh_start)
        return params, opt_state, state, step
    return params, opt_state, state, 0


def note_unused_pieces(tok_path, vocab_size):
    """SentencePiece stops early when the corpus has no more merges to learn:
    say so."""
    pieces = data.load_tokenizer(tok_path).get_piece_size()
    if pieces < vocab_size:
        print(
            f"note: the tokenizer has {pieces} pieces, fewer than the vocabulary size "
            f"{vocab_size}: {vocab_size - pieces} rows of the embedding and of the output layer "
            f"will never be used (--vocab-size {pieces} trains without them).",
            flush=True,
        )

"""Memorize a code base (Sec. 1: "a model can simply memorize facts (e.g. function
definitions) by storing them as (key, value) pairs in long-term memory"): stream its files
through a trained run as one document and keep the memory layers' pairs in a checked file,
which sample.py and evaluate.py take with --load-memory.

  python memorize.py RUN_DIR PATH FILE [--suffixes .py] [--order deps] [--memory-size M]
  python memorize.py RUN_DIR PATH FILE --memory-dtype bfloat16      # a file of half the size

The files are read as the repository reader reads them (each after a `# file: NAME` line),
in sorted order, and streamed as one document: the memory is never cleared, and the XL cache
runs across files. A memory layer's keys depend only on the layers below it, so nothing above
the top memory layer is computed, and its memory is never searched: with one memory layer (the
tiny preset) memorizing is a forward pass without memory. The file holds every token by
default, and as many free slots as the run's own memory, so that a scored document's first
segments evict nothing memorized; a smaller --memory-size keeps the last slots (FIFO).
"""

import startup  # first: before JAX loads (malloc on a CPU; an early Ctrl-C leaves in one line)

if __name__ == "__main__":
    startup.leave_on_early_signals()

import dataclasses
import functools
import os
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import cli
import corpora
import data
import evaluate
import evaluation
import kernels
import memorizing_transformer as mt
import memory_file
import runs

RAM_SHARE = 0.5  # a memory may take at most this share of the machine's RAM


def build_parser():
    p = cli.parser(__doc__)
    cli.add(p, ["run_dir", "path", "file"])
    cli.add(p, ["--suffixes", "--order"])
    cli.add(p, ["--memory-size"], unset="every memorized token, and the run's M free",
            helps={"--memory-size": "slots of the memory file, a positive multiple of T; fewer "
                   "than the tokens keeps the last ones (FIFO)"})
    cli.add(p, ["--memory-dtype", "--memory-age-bias", "--ops"], unset="the run's")
    return p


# ----------------------------------------------------------------------------- the text
class Source(NamedTuple):
    """The memorized text as one stream of N tokens, and where each token came
    from."""

    files: list  # names relative to PATH, in the order streamed
    tokens: np.ndarray  # int32 [N]
    file: np.ndarray  # int32 [N]: index into files
    offset: np.ndarray  # int64 [N]: the token's position in its file's tokens
    line: np.ndarray  # int32 [N]: its line in its file (0: the header line naming the file)
    skipped: dict  # cause -> files or directories skipped


def read_source(path, sp, suffixes=None, dependency_order=False):
    """PATH's files (corpora.read_tree), each as the repository reader joins it,
    tokenized by the run's tokenizer as one stream."""
    stats = {}
    files = corpora.read_tree(path, suffixes, dependency_order, stats)
    skipped = {k: v for k, v in stats.items() if v}
    if not files:
        why = f" (skipped {describe(skipped)})" if skipped else ""
        raise cli.UsageError(f"{path} holds no readable text to memorize{why}.")
    ids = data.encode_texts(sp, [corpora.tree_text(name, text) for name, text in files])
    newline = sp.piece_to_id("\n")
    parts = {"file": [], "offset": [], "line": []}
    for i, t in enumerate(ids):
        parts["file"].append(np.full(len(t), i, np.int32))
        parts["offset"].append(np.arange(len(t), dtype=np.int64))
        ends = np.cumsum(t == newline)  # [n]: newlines up to and including each token
        parts["line"].append((ends - (t == newline)).astype(np.int32))
    joined = {k: np.concatenate(v) for k, v in parts.items()}
    return Source([n for n, _ in files], np.concatenate(ids), skipped=skipped, **joined)


def describe(counts):
    """{"hidden": 2, "not_utf8": 1} -> "2 hidden, 1 not utf8"."""
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if v)


# ----------------------------------------------------------------------------- the keys
def prefix_model(params, config, slots):
    """The model up to the top memory layer, which is all its keys need, with a
    memory of `slots`; with one memory layer, that model without memory (the top
    memory layer's keys never read the memory)."""
    top = max(config.active_memory_layers)
    lower = config.active_memory_layers[:-1]
    cut = config.replace(num_layers=top + 1, memory_size=slots)
    if not lower and config.xl_cache:
        cut = cut.replace(memory_layers=(), memory_size=0)
    return dict(params, layers=params["layers"][: top + 1]), cut


@functools.lru_cache(maxsize=4)
def key_step(config, layers, dtype):
    """(params, state, tokens [1, T], mask [1, T], reset [1]) -> (the new state,
    the segment's keys and values in `layers`, [2, Lm, H, T, D] in `dtype`); the
    logits are never computed (nothing reads them, so XLA leaves them out)."""
    ops = kernels.of(config)

    def step(params, state, tokens, mask, reset):
        _, state = mt.forward(params, state, tokens, reset, config, mask=mask, ops=ops)
        pairs = jnp.stack([state.prev_k[0, list(layers)], state.prev_v[0, list(layers)]])
        return state, pairs.astype(dtype)

    return jax.jit(step, donate_argnums=(1,))


def memorize(params, config, source, slots, dtype, progress=None):
    """The memory layers' keys and values of the stream, in a ring of `slots` (a
    multiple of T) that holds the last segments, oldest first from slot 0.
    Returns (arrays as memory_file.ARRAYS names them, write position, tokens
    dropped)."""
    T, N = config.segment_length, len(source.tokens)
    layers = list(config.active_memory_layers)
    H, D, Lm = config.num_heads, config.head_dim, len(layers)
    segments = -(-N // T)
    kept = min(segments, slots // T)  # the last `kept` segments stay, the others are evicted
    first = segments - kept
    keys = np.zeros((Lm, H, slots, D), memory_file.DTYPES[dtype])  # [Lm, H, M, D]
    values = np.zeros((Lm, H, slots, D), memory_file.DTYPES[dtype])  # [Lm, H, M, D]
    slot = {n: np.full(slots, -1, memory_file.SLOT_DTYPES[n]) for n in ("token", "file",
                                                                        "offset", "line")}
    valid = np.zeros(slots, bool)  # [M]
    cut_params, cut = prefix_model(params, config, slots)
    step = key_step(evaluation.step_config(cut), tuple(layers), keys.dtype)
    state = mt.init_state(cut, 1)
    origin = {"token": source.tokens, "file": source.file, "offset": source.offset,
              "line": source.line}  # [N] each

    def keep(s, pairs):  # segment s's pairs into its slots (s >= first)
        n, at = min(T, N - s * T), (s - first) * T
        pairs = np.asarray(pairs)  # [2, Lm, H, T, D]
        keys[:, :, at : at + n] = pairs[0, :, :, :n]  # [Lm, H, n, D]
        values[:, :, at : at + n] = pairs[1, :, :, :n]  # [Lm, H, n, D]
        valid[at : at + n] = True
        for name, column in slot.items():
            column[at : at + n] = origin[name][s * T : s * T + n]

    waiting = None  # the last segment's pairs, copied out while the next segment runs
    for s in range(segments):
        n = min(T, N - s * T)
        tokens = np.zeros((1, T), np.int32)  # its own: a step may still read the last one
        tokens[0, :n] = source.tokens[s * T : s * T + n]
        mask = np.arange(T)[None] < n  # [1, T]
        state, pairs = step(cut_params, state, tokens, mask, np.array([s == 0]))
        if waiting:
            keep(*waiting)
        waiting = (s, pairs) if s >= first else None
        if progress:
            progress(s + 1, segments)
    if waiting:
        keep(*waiting)
    arrays = {"keys": keys, "values": values, "valid": valid, **slot}
    return arrays, kept * T % slots, first * T


# ----------------------------------------------------------------------------- the command
def check_slots(args, config, source):
    """The file's slot count: --memory-size, checked, or every token and the
    run's M free."""
    T, N = config.segment_length, len(source.tokens)
    slots = args.memory_size
    if slots is None:
        slots = -(-N // T) * T + config.memory_size
    elif slots <= 0 or slots % T:
        raise cli.UsageError(f"--memory-size must be a positive multiple of the run's "
                             f"segment length {T}, got {slots}.")
    dtype = args.memory_dtype or config.storage_dtype
    width = 2 * len(config.active_memory_layers) * config.num_heads * config.head_dim
    need = slots * (width * memory_file.DTYPES[dtype].itemsize + 21)  # + the slots' sources
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > RAM_SHARE * ram:
        raise cli.UsageError(f"a memory of {slots} slots takes {need / 2**30:.1f} GiB, more "
                             f"than half of this machine's {ram / 2**30:.1f} GiB; give a "
                             "smaller --memory-size.")
    return slots, dtype


def check_paths(args):
    """PATH exists, and FILE lands on none of the command's inputs
    (runs.check_output): not on PATH, nor inside it, nor on the run's files, its
    corpus or its cache."""
    if not os.path.exists(args.path):
        raise cli.UsageError(f"{args.path} does not exist: name a directory or a file of code.")
    run_args = (runs.read_json(os.path.join(args.run_dir, "config.json")) or {}).get("args") or {}
    sources = [d for d in (run_args.get("data"),) if isinstance(d, str)]
    caches = [d for d in (run_args.get("cache_dir"), cli.cache_dir()) if isinstance(d, str)]
    inputs = [args.path] + [os.path.join(args.run_dir, name) for name in runs.RUN_FILES]
    runs.check_output(args.file, "FILE", inputs, sources, caches)


def progress_line(started, T, source):
    """A function that shows, on a terminal, the files, tokens, tokens/s and
    time left.
"""
    if not sys.stderr.isatty():
        return None
    N, files = len(source.tokens), len(source.files)

    def show(done, total):  # segments
        spent = time.perf_counter() - started
        tokens = min(N, done * T)
        left = (total - done) * spent / done
        sys.stderr.write(f"\rmemorizing: file {source.file[tokens - 1] + 1}/{files}, "
                         f"{tokens} tokens, {tokens / max(spent, 1e-9):,.0f} tokens/s, "
                         f"{left:.0f} s left ")
        if done == total:
            sys.stderr.write("\n")

    return show


def run(args):
    check_paths(args)
    config, params, sp, _ = evaluate.load_run(args.run_dir, None, evaluate.eval_changes(args))
    if not config.active_memory_layers:
        raise cli.UsageError(f"the run in {args.run_dir} has no memory layer: there is "
                             "nothing to memorize with.")
    suffixes = corpora.parse_suffixes(args.suffixes)
    source = read_source(args.path, sp, suffixes, args.order == "deps")
    data.check_tokens(source.tokens, config.vocab_size)
    slots, dtype = check_slots(args, config, source)
    started = time.perf_counter()
    show = progress_line(started, config.segment_length, source)
    arrays, position, dropped = memorize(params, config, source, slots, dtype, show)
    header = {
        "format": memory_file.FORMAT,
        "config": dataclasses.asdict(config),
        "params_hash": memory_file.params_hash(params),
        "tokenizer_hash": data.file_hash(os.path.join(args.run_dir, "tokenizer.model")),
        "memory_layers": list(config.active_memory_layers),
        "heads": config.num_heads,
        "head_dim": config.head_dim,
        "segment_length": config.segment_length,
        "dtype": dtype,
        "slots": slots,
        "position": position,
        "files": source.files,
    }
    memory_file.write(args.file, header, arrays)
    seconds = time.perf_counter() - started
    held = int(arrays["valid"].sum())
    skipped = f", skipped {describe(source.skipped)}" if source.skipped else ""
    print(f"memorized {corpora.plural(len(source.files), 'file')}, "
          f"{corpora.plural(len(source.tokens), 'token')} into {slots} slots ({held} held, "
          f"{dropped} dropped){skipped}, in {seconds:.1f} s "
          f"({len(source.tokens) / seconds:,.0f} tokens/s); {args.file}: "
          f"{os.path.getsize(args.file) / 2**20:.1f} MiB")
    return 0


def main(argv=None):
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    cli.exit_with(main())

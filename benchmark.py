"""What the memory costs: step time against memory size, next to the arithmetic floor.

  python benchmark.py                          # tiny preset, M = 0, 8192, 65536
  python benchmark.py --rounds 21 --timed-steps 15   # also: ratios from steps called in turn
  python benchmark.py --ops plain              # the model's plain pieces, not kernels.FAST
  python benchmark.py --preset paper --batch-size 32 --dtype bfloat16 --attention fused
  python benchmark.py --search --memory-sizes 8192,65536   # the memory search alone
  python benchmark.py --memorize --memory-sizes 65536,1048576   # memorize.py's and scoring's
  python benchmark.py --peer /tmp/peer/bin/python --repeats 3   # against lucidrains' peer

Each memory size runs in its own process (so that peak memory is that row's own), compiles the
jitted train step, warms up, and reports the median of --timed-steps steps. A second table times
the forward pass, and in the no-memory row the loss's gradient against its forward pass.

The floor: training FLOPs with the memory over those without, counting what the memory must add and
nothing else: one forward-only [T, M] score product per head in each memory layer, and attention
over the K retrieved pairs (forward and backward).
"""

import startup  # first: before JAX loads (malloc on a CPU; an early Ctrl-C leaves in one line)

if __name__ == "__main__":
    startup.leave_on_early_signals()

import collections
import functools
import glob
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import cli
import corpora
import evaluation
import kernels
import memorizing_transformer as mt
import optimizer
import presets
import runs
import train

# Dense bf16 peak of the cards this was meant for (vendor figures, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
OPS = ("fast", "plain")  # --ops: kernels.fast with the config's knobs, or the model file's pieces


def ops_of(c, name):
    return kernels.of(c.replace(ops=name))


def train_flops(c, batch, memory_size):
    """Matmul FLOPs of one training step (forward + backward = 3 x forward), and
    of the forward."""
    B, T, E, H, D, F, V, L = (
        batch,
        c.segment_length,
        c.d_model,
        c.num_heads,
        c.head_dim,
        c.d_ff,
        c.vocab_size,
        c.num_layers,
    )
    S = c.cache_length + T
    dense = 2 * B * T * (L * (4 * E * H * D + 2 * E * F) + E * V)  # projections, FFN, logits
    attention = 2 * B * H * T * S * D * 2 * L  # q.k and weights.v
    n_mem = len(c.memory_layers) if memory_size else 0
    search = (
        2 * B * H * T * memory_size * D * n_mem
    )  # forward only: retrieval is not differentiated
    retrieved = 2 * B * H * T * c.num_neighbors * D * 2 * n_mem  # q.k and weights.v over K pairs
    return 3 * (dense + attention + retrieved) + search, dense + attention + retrieved + search


def peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def recall(found, exact):
    """Share of each query's exact top-k slots that `found` also holds: [..., K]
    each.
"""
    K = exact.shape[-1]
    return float(
        np.mean(
            [
                len(set(x) & set(y)) / K
                for x, y in zip(
                    np.asarray(found).reshape(-1, K).tolist(),
                    np.asarray(exact).reshape(-1, K).tolist(),
                )
            ]
        )
    )


def measure_recall(c, memory_size, search, queries=64):
    """The approximate top-k, in the model's dtypes, against exact float32 top-k
    on random unit vectors."""
    if not memory_size or c.exact_topk:
        return 1.0 if memory_size else None
    rng = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    cfg = c.replace(
        memory_size=memory_size, segment_length=queries, num_heads=1, d_model=c.head_dim
    )
    q = unit(rng.standard_normal((1, 1, queries, c.head_dim))).astype(np.float32)  # [B, H, T, D]
    k = unit(rng.standard_normal((1, 1, memory_size, c.head_dim))).astype(np.float32)
    valid = np.ones((1, memory_size), bool)
    _, approx = search(
        jnp.asarray(q, c.dtype), jnp.asarray(k, c.storage_dtype), valid, jnp.ones(1), cfg
    )
    _, exact = mt.memory_search(
        q, k, valid, jnp.ones(1), cfg.replace(exact_topk=True, dtype="float32")
    )
    return recall(approx, exact)


def device_name():
    d = jax.devices()[0]
    if d.platform != "cpu":
        return d.device_kind
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"CPU {model}, {os.cpu_count()} cores"


# ----------------------------------------------------------------------------- --profile
HLO_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
NOT_WRITTEN = (
    "parameter",
    "constant",
    "bitcast",
    "get-tuple-element",
    "tuple",
    "while",
    "call",
    "conditional",
)


def largest_buffers(hlo_text, n=10):
    """The n largest arrays a compiled program's operations write, largest
    first: [{"op", "opcode", "shape", "bytes"}]. The outputs of the entry
    computation's and loop bodies' operations (a tuple's elements one by one; an
    update in place counts its whole array), not the values inside a fused
    computation (any computation named with calls=), which never reach memory.
    """
    buffers, fused = [], False
    called = set(
        re.findall(r"%([\w.\-]+)", " ".join(re.findall(r"calls=(\{[^}]*\}|%[\w.\-]+)", hlo_text)))
    )
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:  # a computation starts
            fused = not head.group(1) and head.group(2) in called
            continue
        inst = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\w+\[[\d,]*\]\S*) ([\w\-]+)\(", line)
        if fused or not inst or inst.group(3) in NOT_WRITTEN:
            continue
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", inst.group(2)):
            shape = [int(d) for d in dims.split(",") if d]
            buffers.append(
                {
                    "op": inst.group(1),
                    "opcode": inst.group(3),
                    "shape": f"{dtype}[{dims}]",
                    "bytes": HLO_BYTES.get(dtype, 4) * int(np.prod(shape, dtype=np.int64)),
                }
            )
    return sorted(buffers, key=lambda b: -b["bytes"])[:n]


def profile_steps(run_step, steps, hlo_text, out_dir, tag):
    """Time per XLA operation over `steps` steps, from a jax.profiler trace:
    kernels on a GPU, thunks on a CPU (where threads add up to more than the
    wall time, and a plain `dot`'s work runs on threads the trace does not tie
    to it). Each operation is named after the JAX operation it came from (HLO
    metadata). Writes the trace, the HLO and the tables to out_dir; returns the
    table by JAX operation, longest first, and the largest arrays."""
    from jax.profiler import ProfileData

    normal = lambda name: re.sub(r"[.\-]", "_", name)
    source = {
        normal(name): op
        for name, op in re.findall(
            r'^\s*(?:ROOT )?%([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M
        )
    }
    module = re.search(r"^HloModule (\S+?),", hlo_text, re.M)
    module = module.group(1) if module else ""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            run_step()
        jax.profiler.stop_trace()
        trace = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
        shutil.copy(trace, os.path.join(out_dir, f"trace_{tag}.xplane.pb"))
        profile = ProfileData.from_file(trace)
    per_op = collections.Counter()
    for plane in profile.planes:
        if not plane.name.startswith(("/device:", "/host:CPU")):
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats and stats.get("hlo_module", module) == module:
                    op = (
                        event.name
                        if stats["hlo_op"].startswith("command_buffer")
                        else stats["hlo_op"]
                    )
                    per_op[op] += event.duration_ns / steps / 1e6
    total = sum(per_op.values()) or 1.0
    label = lambda op: (
        re.sub(r"^jit\(\w+\)/", "", source.get(normal(op), ""))
        or (
            "library matmul"
            if op.startswith(("nvjet", "sm90", "sm80", "cutlass", "gemm"))
            else f"({op})"
        )
    )
    by_source = collections.Counter()
    for op, ms in per_op.items():
        by_source[label(op)] += ms
    ops = [
        {"op": op, "ms_per_step": ms, "share": ms / total, "source": label(op)}
        for op, ms in per_op.most_common()
    ]
    table = [
        {"source": src, "ms_per_step": ms, "share": ms / total}
        for src, ms in by_source.most_common()
    ]
    with open(os.path.join(out_dir, f"step_{tag}.hlo.txt"), "w") as f:
        f.write(hlo_text)
    buffers = largest_buffers(hlo_text)
    for b in buffers:
        b["source"] = label(b["op"])
    with open(os.path.join(out_dir, f"profile_{tag}.json"), "w") as f:
        json.dump(
            {
                "module": module,
                "steps": steps,
                "ms_per_step": total,
                "by_source": table,
                "ops": ops,
                "largest_buffers": buffers,
            },
            f,
            indent=1,
        )
    return table, buffers


# ----------------------------------------------------------------------------- a row
def row_step(
    preset, batch, memory_size, dtype, memory_dtype=None, attention="explicit", ops="fast"
):
    """One memory size's config, jitted train step and its arguments (params,
    optimizer state, model state, a batch of random tokens; the same seeds in
    every row)."""
    c = presets.PRESETS[preset].replace(
        memory_size=memory_size,
        batch_size=batch,
        grad_accum=1,
        dtype=dtype,
        memory_dtype=memory_dtype,
        attention=attention,
    )
    params = mt.init_params(c, jax.random.PRNGKey(0))
    tokens = (
        np.random.default_rng(0)
        .integers(1, c.vocab_size, (batch, c.segment_length))
        .astype(np.int32)
    )
    batch_arrays = {
        "tokens": tokens,
        "targets": np.roll(tokens, -1, 1),
        "mask": np.ones(tokens.shape, bool),
        "reset": np.zeros(batch, bool),
    }
    return (
        c,
        train.make_train_step(evaluation.step_config(c), ops_of(c, ops)),
        [params, optimizer.make_optimizer(c)[0](params), mt.init_state(c, batch), batch_arrays],
    )


def alternate_rows(
    preset, batch, sizes, rounds, dtype, memory_dtype=None, attention="explicit", ops="fast"
):
    """Every memory size's train step in this process, called in turn for
    `rounds` rounds (after two warm-up rounds). For each size, the median, min
    and max over the rounds of its step time over the base row's (size 0, else
    the first) in the same round: on a shared machine whose speed drifts,
    steadier than a ratio of medians taken minutes apart."""
    rows = {m: row_step(preset, batch, m, dtype, memory_dtype, attention, ops)[1:] for m in sizes}
    times = {m: [] for m in sizes}
    for r in range(rounds + 2):
        for m, (step, a) in rows.items():
            t0 = time.perf_counter()
            a[0], a[1], a[2], metrics = step(*a)
            jax.block_until_ready(metrics)
            times[m].append(time.perf_counter() - t0)
        if r == 0:  # every row's step is compiled
            startup.fill_heap_holes()
    base = 0 if 0 in sizes else sizes[0]
    out = {}
    for m in sizes:
        ratios = [t / b for t, b in zip(times[m][2:], times[base][2:])]
        out[m] = {
            "paired_ratio": statistics.median(ratios),
            "paired_min": min(ratios),
            "paired_max": max(ratios),
        }
    return out


def compile_row(
    preset, batch, memory_size, dtype, memory_dtype=None, attention="explicit", ops="fast"
):
    """One row's train step compiled, not run (--compile-jobs): into JAX's
    persistent compilation cache, from which the row's timed process then loads
    it."""
    _, step, args = row_step(preset, batch, memory_size, dtype, memory_dtype, attention, ops)
    t0 = time.perf_counter()
    step.lower(*args).compile()
    return {"memory_size": memory_size, "compile_s": time.perf_counter() - t0}


def run_row(
    preset,
    batch,
    memory_size,
    steps,
    dtype,
    memory_dtype=None,
    profile_dir=None,
    attention="explicit",
    train_only=False,
    ops="fast",
):
    """One memory size, in this process: the row's measurements (with
    train_only, the train step's alone: three programs fewer to compile)."""
    c, step, (params, opt_state, state, batch_arrays) = row_step(
        preset, batch, memory_size, dtype, memory_dtype, attention, ops
    )
    tokens = jnp.asarray(batch_arrays["tokens"])
    t0 = time.perf_counter()
    params, opt_state, state, m = step(
        params, opt_state, state, batch_arrays
    )  # compile + first step
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    startup.fill_heap_holes()  # as train.py does after its first step
    times = []
    for _ in range(steps + 1):  # one more warm-up step, then the timed ones
        t0 = time.perf_counter()
        params, opt_state, state, m = step(params, opt_state, state, batch_arrays)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s, peak = statistics.median(times[1:]), peak_bytes()
    profile = None
    if profile_dir:

        def run_step():
            nonlocal params, opt_state, state
            params, opt_state, state, m = step(params, opt_state, state, batch_arrays)
            jax.block_until_ready(m)

        hlo = step.lower(params, opt_state, state, batch_arrays).compile().as_text()
        table, buffers = profile_steps(run_step, steps, hlo, profile_dir, f"M{memory_size}")
        profile = {"ops": table[:15], "largest_buffers": buffers}
    forward = functools.partial(mt.forward, config=c, ops=ops_of(c, ops))
    fwd = jax.jit(
        lambda p, s: forward(p, s, tokens, jnp.zeros(batch, bool)), donate_argnums=1
    )  # memory in place
    fwd_times = []
    for _ in range(0 if train_only else steps + 2):
        t0 = time.perf_counter()
        logits, state = fwd(params, state)
        jax.block_until_ready(logits)
        fwd_times.append(time.perf_counter() - t0)
    # The gradient against the forward pass it differentiates (forward + loss, the same state), in
    # the no-memory row only, where the memory's search (not differentiated) is absent.
    loss_s = grad_s = None
    if memory_size == 0 and not train_only:

        def loss(p, s):
            logits, _ = forward(p, s, tokens, jnp.zeros(batch, bool))
            return jnp.mean(mt.cross_entropy(logits, jnp.asarray(batch_arrays["targets"])))

        timed = {"loss": jax.jit(loss), "grad": jax.jit(jax.grad(loss))}
        times = {name: [] for name in timed}
        for _ in range(steps + 2):
            for name, f in timed.items():  # interleaved, so that both see the same machine
                t0 = time.perf_counter()
                jax.block_until_ready(f(params, state))
                times[name].append(time.perf_counter() - t0)
        loss_s, grad_s = (statistics.median(times[name][2:]) for name in timed)
    train_f, fwd_f = train_flops(c, batch, memory_size)
    return {
        "memory_size": memory_size,
        "step_s": step_s,
        "forward_s": statistics.median(fwd_times[2:]) if fwd_times else None,
        "loss_forward_s": loss_s,
        "grad_s": grad_s,
        "grad_over_forward": grad_s and grad_s / loss_s,
        "tokens_per_s": batch * c.segment_length / step_s,
        "peak_bytes": peak,
        "recall": measure_recall(c, memory_size, ops_of(c, ops).memory_search),
        "train_flops": train_f,
        "forward_flops": fwd_f,
        "compile_s": compile_s,
        "device": device_name(),
        "memory_dtype": c.storage_dtype,
        "profile": profile,
        "attention": c.attention,
        "ops": ops,
        "memory_bytes": 2
        * len(c.active_memory_layers)
        * batch
        * c.num_heads
        * memory_size
        * c.head_dim
        * jnp.dtype(c.storage_dtype).itemsize,
    }


# ----------------------------------------------------------------------------- --search
def time_search(c, batch, memory_size, steps):
    """The search alone, at the preset's shapes on random unit keys: the median
    seconds of each form over `steps` calls in turn (kernels.memory_search, the
    plain mt.memory_search, and the exact top-k), the binned answer's recall,
    and the share of slots on which the two binned forms agree. Also the
    search's last stage alone, the top-k of each query's G bins' winners, by
    lax.top_k and in passes (kernels.top_k_in_passes, a CPU's way), which must
    agree."""
    H, T, D, K = c.num_heads, c.segment_length, c.head_dim, c.num_neighbors
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    kq, kk, kw = jax.random.split(
        jax.random.PRNGKey(0), 3
    )  # drawn on the device: no host copy of the memory
    q = unit(jax.random.normal(kq, (batch, H, T, D))).astype(c.dtype)  # [B, H, T, D]
    keys = unit(jax.random.normal(kk, (batch, H, memory_size, D))).astype(
        c.storage_dtype
    )  # [B, H, M, D]
    valid, scale = jnp.ones((batch, memory_size), bool), jnp.ones((H,), jnp.float32)
    forms = {
        "kernel": (kernels.fast(c.memory_chunk).memory_search, c),
        "plain": (mt.memory_search, c),
        "exact": (kernels.fast(c.memory_chunk).memory_search, c.replace(exact_topk=True)),
    }
    fns = {
        name: jax.jit(lambda q, k, f=f, cfg=cfg: f(q, k, valid, scale, cfg)[1])
        for name, (f, cfg) in forms.items()
    }
    G = mt.bin_layout(K, memory_size, c.topk_recall_target)[0]
    winners = kernels._bin_keys(
        kernels._pack(jax.random.normal(kw, (batch, H, T, G), jnp.float32), 0, 0)
    )
    topks = {
        "lax": jax.jit(lambda x: jax.lax.top_k(x, K)[0]),
        "passes": jax.jit(lambda x: kernels.top_k_in_passes(x, K)),
    }
    calls = {
        **{name: (f, (q, keys)) for name, f in fns.items()},
        **{"top_k_" + name: (f, (winners,)) for name, f in topks.items()},
    }
    out = {name: np.asarray(f(*a)) for name, (f, a) in calls.items()}  # compile + warm-up
    times = {name: [] for name in calls}
    for _ in range(steps):
        for name, (f, a) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "memory_size": memory_size,
        "search_s": {name: median[name] for name in fns},
        "top_k_s": {name: median["top_k_" + name] for name in topks},
        "bins": G,
        "recall": recall(out["kernel"], out["exact"]),
        "same_slots": float(np.mean(out["kernel"] == out["plain"])),
        "top_k_same": float(np.mean(out["top_k_lax"] == out["top_k_passes"])),
        "device": device_name(),
    }


def search_table(args, base, batch, sizes):
    """--search: the search's forms at each nonzero memory size, in this
    process."""
    c = base.replace(
        batch_size=batch, grad_accum=1, dtype=args.dtype, memory_dtype=args.memory_dtype
    )
    rows = [time_search(c.replace(memory_size=m), batch, m, args.timed_steps) for m in sizes if m]
    print(
        f"device: {rows[0]['device']} | preset {args.preset}: the memory search alone, one memory "
        f"layer: B {batch}, "
        f"H {c.num_heads}, T {c.segment_length}, D {c.head_dim}, k {c.num_neighbors}, queries "
        f"{args.dtype}, memory "
        f"in {c.storage_dtype}, median of {args.timed_steps} calls of each form in turn"
    )
    print(
        f"\n{'memory':>8} {'bins':>6} {'kernel ms':>10} {'plain ms':>9} {'exact ms':>9} "
        f"{'recall':>7} "
        f"{'same slots':>11} {'top-k ms':>9} {'in passes ms':>13} {'same':>7}"
    )
    for r in rows:
        t, k = r["search_s"], r["top_k_s"]
        print(
            f"{r['memory_size']:>8} {r['bins']:>6} {t['kernel'] * 1e3:>10.2f} "
            f"{t['plain'] * 1e3:>9.2f} "
            f"{t['exact'] * 1e3:>9.2f} {r['recall']:>7.3f} {r['same_slots']:>11.4f} "
            f"{k['lax'] * 1e3:>9.2f} "
            f"{k['passes'] * 1e3:>13.2f} {r['top_k_same']:>7.4f}"
        )
    print(
        "kernel: kernels.memory_search; plain: mt.memory_search (all scores at once); recall: the "
        "binned slots "
        "found among the exact top-k; same slots: the share on which kernel and plain agree (ties "
        "of float32 "
        "scores within the kernel's rounding may differ); top-k, in passes: the top-k of the bins' "
        "winners alone, "
        "by lax.top_k and by kernels.top_k_in_passes, and the share on which they agree (must be 1)"
    )
    if args.json:
        runs.write_output(args.json, runs.json_text(rows))
    return 0


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def unit_vectors(shape, dtype, seed):
    """Pseudo-random unit vectors along the last axis, from a hash of each
    element's index (murmur3's finalizer): one fused program, nothing of the
    whole size beside the answer (jax.random's bits and normals would be two
    more such arrays)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    h = (index + jnp.uint32(seed * 0x9E3779B9 % 2**32)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    x = (h ^ (h >> 16)).astype(jnp.float32) / 2.0**31 - 1.0  # uniform in [-1, 1)
    return (x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True))).astype(dtype)


def full_memory(config, rows=1, key=0):
    """A state whose memory holds M random unit keys and values, every slot
    valid (drawn on the device: no host copy, and no empty memory allocated
    first)."""
    shapes = jax.eval_shape(lambda: mt.init_state(config, rows))
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes._replace(
        mem_k=None, mem_v=None, mem_valid=None))
    mem = shapes.mem_k  # [B, Lm, H, M, D]
    return state._replace(mem_k=unit_vectors(mem.shape, mem.dtype, 2 * key),
                          mem_v=unit_vectors(mem.shape, mem.dtype, 2 * key + 1),
                          mem_valid=jnp.ones(shapes.mem_valid.shape, bool))


def time_memorize(c, memory_size, steps):
    """memorize.py's step and scoring's (evaluate.py --load-memory), batch 1, at
    one memory size, on the preset's fresh weights: the median seconds of each
    over `steps` calls in turn, with a batch-1 forward without memory beside
    them. memorize: the model up to the top memory layer, with the preset's
    memory layers and with layers 0 and 1 (whose lower layer searches the
    memory); score: the whole model's forward over a full memory."""
    import memorize  # (memorize.py imports nothing of the benchmark's)

    configs = {
        "score": c.replace(memory_size=memory_size),
        "no_memory": c.replace(memory_size=0),
    }
    params = mt.init_params(configs["score"], jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, c.segment_length), 0, c.vocab_size)
    batch = {"tokens": tokens, "targets": tokens, "reset": np.array([False]),
             "mask": np.ones((1, c.segment_length), bool)}
    calls = {}
    for name, cfg in configs.items():
        step = evaluation.make_forward_step(evaluation.step_config(cfg))
        calls[name] = (lambda p, s, b, f=step: f(p, s, b).state, params, full_memory(cfg))
    for name, layers in (("memorize", c.memory_layers), ("memorize_0_1", (0, 1))):
        own = configs["score"].replace(memory_layers=layers)
        own_params = mt.init_params(own, jax.random.PRNGKey(0))  # with layers' gates
        cut_params, cut = memorize.prefix_model(own_params, own, memory_size)
        step = memorize.key_step(evaluation.step_config(cut), tuple(layers), c.storage_dtype)
        calls[name] = (lambda p, s, b, f=step: f(p, s, b["tokens"], b["mask"], b["reset"])[0],
                       cut_params, full_memory(cut))
    states = {}  # each step compiled, and run once
    for name, (f, p, st) in calls.items():
        states[name] = jax.block_until_ready(f(p, st, batch))
    times = {name: [] for name in calls}
    for _ in range(steps):
        for name, (f, p, _) in calls.items():
            t0 = time.perf_counter()
            states[name] = jax.block_until_ready(f(p, states[name], batch))
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    flops = {m: train_flops(c, 1, m)[1] for m in (0, memory_size)}
    return {
        "memory_size": memory_size,
        "step_s": median,
        "tokens_per_s": {name: c.segment_length / t for name, t in median.items()},
        "score_ratio": median["score"] / median["no_memory"],
        "score_floor_ratio": flops[memory_size] / flops[0],
        "peak_bytes": peak_bytes(),
        "device": device_name(),
    }


def memorize_table(args, base, sizes):
    """--memorize: memorize's and scoring's steps at each nonzero memory size,
    in this process."""
    c = base.replace(batch_size=1, grad_accum=1, dtype=args.dtype, memory_dtype=args.memory_dtype)
    rows = [time_memorize(c, m, args.timed_steps) for m in sizes if m]
    print(
        f"device: {rows[0]['device']} | preset {args.preset}: batch 1, T {c.segment_length}, "
        f"memory layers {list(c.memory_layers)}, memory in {c.storage_dtype}, fresh weights, "
        f"median of {args.timed_steps} calls of each step in turn"
    )
    print(f"\n{'memory':>8} {'score ms':>9} {'no memory ms':>13} {'ratio':>7} {'floor':>7} "
          f"{'/floor':>7} {'memorize tok/s':>15} {'layers 0,1 tok/s':>17} {'peak MiB':>9}")
    for r in rows:
        t, n = r["step_s"], r["tokens_per_s"]
        print(
            f"{r['memory_size']:>8} {t['score'] * 1e3:>9.2f} {t['no_memory'] * 1e3:>13.2f} "
            f"{r['score_ratio']:>7.3f} {r['score_floor_ratio']:>7.3f} "
            f"{r['score_ratio'] / r['score_floor_ratio']:>7.3f} {n['memorize']:>15.0f} "
            f"{n['memorize_0_1']:>17.0f} {r['peak_bytes'] / 2**20:>9.0f}"
        )
    print(
        "score: a segment's forward over a full memory of that size, against the same forward "
        "without memory (ratio), and the arithmetic floor of that ratio (the search's and the "
        "retrieved attention's FLOPs added); memorize: tokens/s of memorize.py's step with the "
        "preset's memory layers (its top layer needs no search) and with layers 0 and 1 (layer "
        "0 searches a memory of that size); peak: this process's so far"
    )
    if args.json:
        runs.write_output(args.json, runs.json_text(rows))
    return 0


# ----------------------------------------------------------------------------- the rows' processes
def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_children(cmds, env=None):
    """Run these processes at once and wait for all; on Ctrl-C or SIGTERM
    (KeyboardInterrupt here), stop them first, so that no child outlives the
    benchmark. Returns (exit code, stdout, stderr)s."""
    procs = []
    try:
        for cmd in cmds:
            procs.append(
                subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
                )
            )
        outs = [proc.communicate() for proc in procs]
    except BaseException:
        for proc in procs:
            stop(proc)
        raise
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outs)]


def run_child(cmd, env=None):
    return run_children([cmd], env)[0]


def json_or_error(result, what):
    """A child's last line as JSON, and 0; if it failed, one line with its own
    last line, and the exit code to leave with."""
    code, stdout, stderr = result
    if code:
        last = (stderr.strip().splitlines() or ["no message"])[-1]
        cli.say(f"error: {what} failed (exit code {code}): {last}")
        return None, 130 if code == 130 else 1
    return json.loads(stdout.strip().splitlines()[-1]), 0


def compile_ahead(common, sizes, jobs, env):
    """--compile-jobs: every row's train step compiled in processes `jobs` at a
    time, into the compilation cache that `env` names. Returns ({memory size:
    compile seconds}, 0), or (None, code)."""
    ahead = {}
    env = dict(
        env, XLA_PYTHON_CLIENT_PREALLOCATE="false"
    )  # not 75% of a GPU's memory each: they share it
    for i in range(0, len(sizes), jobs):
        group = sizes[i : i + jobs]
        results = run_children([common + ["--row", str(m), "--compile-only"] for m in group], env)
        for m, result in zip(group, results):
            row, code = json_or_error(result, f"compiling the row with memory size {m}")
            if code:
                return None, code
            ahead[m] = row["compile_s"]
    return ahead, 0


def time_rows(args, common, sizes, rows, env):
    """Each row timed in its own process, one after another (after
    --compile-jobs), then the --rounds; the rows are appended to `rows`. Returns
    0, or the exit code to leave with."""
    ahead = {}
    if args.compile_jobs > 1:
        t0 = time.perf_counter()
        ahead, code = compile_ahead(common, sizes, args.compile_jobs, env)
        if code:
            return code
        cli.say(
            f"compiled ahead: {len(sizes)} rows' train steps in {time.perf_counter() - t0:.0f} s, "
            f"{min(args.compile_jobs, len(sizes))} at a time"
        )
    for m in sizes:
        cmd = common + ["--row", str(m)] + (["--profile", args.profile] if args.profile else [])
        row, code = json_or_error(
            run_child(cmd + (["--train-only"] if args.train_only else []), env),
            f"the row with memory size {m}",
        )
        if code:
            return code
        row["compiled_ahead_s"] = ahead.get(m)
        rows.append(row)
        cli.say(
            f"row {m}: step {row['step_s']:.4f} s, peak {row['peak_bytes'] / 2**20:.0f} MiB, "
            "compiled in "
            f"{row['compile_s']:.0f} s" + (f" (ahead: {ahead[m]:.0f} s)" if m in ahead else "")
        )
    if args.rounds:
        paired, code = json_or_error(
            run_child(
                common
                + [
                    "--memory-sizes",
                    ",".join(map(str, sizes)),
                    "--rounds",
                    str(args.rounds),
                    "--alternate",
                ],
                env,
            ),
            "the alternated rounds",
        )
        if code:
            return code
        for r in rows:
            r.update(paired[str(r["memory_size"])])
        cli.say(f"alternated: {corpora.plural(args.rounds, 'round')}")
    return 0


# ----------------------------------------------------------------------------- --peer
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_benchmark.py")


def side_by_side(ours_runs, theirs_runs, sizes):
    """--peer's rows from the repeats ({size: row} each; theirs {} where the
    peer was skipped): each ratio taken within a repeat, then the median over
    the repeats, with the range of ours over theirs."""
    med = lambda xs: statistics.median(xs) if xs else None
    rows = []
    for m in sizes:
        ours, theirs = [run[m] for run in ours_runs], [run[m] for run in theirs_runs if run]
        over = [o["step_s"] / t["step_s"] for o, t in zip(ours, theirs)]
        ratio = lambda repeats: med(
            [run[m]["step_s"] / run[sizes[0]]["step_s"] for run in repeats if run]
        )
        rows.append(
            {
                "memory_size": m,
                "ours_step_s": med([o["step_s"] for o in ours]),
                "ours_ratio": ratio(ours_runs),
                "ours_recall": ours[0]["recall"],
                "theirs_step_s": med([t["step_s"] for t in theirs]),
                "theirs_ratio": ratio(theirs_runs),
                "theirs_recall": theirs[0]["recall"] if theirs else None,
                "ours_over_theirs": med(over),
                "ours_over_theirs_min": min(over, default=None),
                "ours_over_theirs_max": max(over, default=None),
                "ours_over_theirs_by_repeat": over,
            }
        )
    return rows


def peer_table(args, common, sizes):
    """--peer: ours (the rows, as always) and theirs (peer_benchmark.py in the
    peer's Python), --repeats times in turn, then the side-by-side table."""
    env = dict(
        os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    )  # no spinning threads
    skip, _, err = run_child([args.peer, PEER, "--check"], env=env)
    if skip:
        why = (err.strip().splitlines() or [f"{args.peer} exited with code {skip}"])[-1]
        print(
            f"peer: skipped: {why}"
            + (
                ""
                if "performance.md" in why
                else "; docs/performance.md's 'Against the PyTorch peer' shows what to install."
            )
        )
    ours_runs, theirs_runs = [], []
    for _ in range(args.repeats):
        ours_runs.append([])
        code = time_rows(args, common, sizes, ours_runs[-1], None)
        if code:
            return code
        ours_runs[-1], theirs_runs = (
            {r["memory_size"]: r for r in ours_runs[-1]},
            theirs_runs + [{}],
        )
        for m in sizes if not skip else ():
            row, code = json_or_error(
                run_child([args.peer, PEER, str(m), str(args.timed_steps)], env),
                f"the peer's row {m}",
            )
            if code:
                return code
            theirs_runs[-1][m] = row
    rows, f = (
        side_by_side(ours_runs, theirs_runs, sizes),
        lambda x, spec: "-" if x is None else format(x, spec),
    )
    print(
        f"{ours_runs[0][sizes[0]]['device']}, medians of "
        f"{corpora.plural(args.timed_steps, 'step')} and of "
        f"{corpora.plural(args.repeats, 'repeat')}"
        + (
            ""
            if skip
            else f"; peer: torch {theirs_runs[0][sizes[0]]['torch']}"
            f", {theirs_runs[0][sizes[0]]['threads']} threads"
        )
    )
    columns = (
        ("memory_size", "memory", "d"),
        ("ours_step_s", "ours s", ".4f"),
        ("ours_ratio", "ratio", ".3f"),
        ("ours_recall", "recall", ".3f"),
        ("theirs_step_s", "theirs s", ".4f"),
        ("theirs_ratio", "ratio", ".3f"),
        ("theirs_recall", "recall", ".3f"),
        ("ours_over_theirs", "ours/theirs", ".3f"),
        ("ours_over_theirs_min", "min", ".3f"),
        ("ours_over_theirs_max", "max", ".3f"),
    )
    print(" ".join(f"{title:>11}" for _, title, _ in columns))
    for r in rows:
        print(" ".join(f"{f(r[key], spec):>11}" for key, _, spec in columns))
    if args.json:
        tag = lambda repeats: [
            dict(row, repeat=i) for i, run in enumerate(repeats) for row in run.values()
        ]
        runs.write_output(
            args.json,
            runs.json_text(
                {
                    "repeats": args.repeats,
                    "rows": rows,
                    "ours": tag(ours_runs),
                    "theirs": tag(theirs_runs),
                }
            ),
        )
    return 0


# ----------------------------------------------------------------------------- the command
def build_parser():
    p = cli.parser(__doc__)
    cli.add(p, ["--preset"])
    cli.add(p, ["--batch-size"], unset="the preset's")
    cli.add(p, ["--memory-sizes", "--timed-steps", "--dtype"], DEFAULTS)
    cli.add(p, ["--memory-dtype"])
    cli.add(
        p, ["--attention", "--ops", "--json", "--profile", "--train-only", "--search"], DEFAULTS
    )
    cli.add(p, ["--memorize"])
    cli.add(p, ["--rounds", "--compile-jobs", "--peer", "--repeats"])
    cli.add(p, ["--row", "--compile-only", "--alternate"])  # internal: a row in this process
    return p


DEFAULTS = {"--memory-sizes": "0,8192,65536", "--dtype": "float32", "--attention": "explicit",
            "--ops": "fast"}


def main(argv=None):
    return cli.run_main(build_parser(), benchmark, argv)


def memory_sizes(sizes, base, batch, dtype):
    """--memory-sizes, each a size this preset, batch and dtype can run (a
    UsageError otherwise): every size is checked before any row runs."""
    if len(set(sizes)) < len(sizes):  # rows are named by their size
        raise cli.UsageError(f"--memory-sizes names a size twice: {','.join(map(str, sizes))}.")
    for m in sizes:
        try:
            config = base.replace(memory_size=m, batch_size=batch, grad_accum=1, dtype=dtype)
        except ValueError as e:
            raise cli.UsageError(f"--memory-sizes {m}: {e}") from None
        runs.check_fits(config, batch)
    return sizes


def check_flags(args, sizes):
    """Refuse flags that cannot go together, before anything runs."""
    alone = {
        "search": "--search times the search alone, in one process",
        "memorize": "--memorize times memorize's and scoring's steps, in one process",
        "peer": "--peer times the tiny preset's step beside the peer's",
    }
    defaults = {
        "train_only": False,
        "profile": None,
        "rounds": 0,
        "compile_jobs": 1,
        "search": False,
        "memorize": False,
    }
    for flag, what in alone.items():
        others = [
            f"--{o.replace('_', '-')}"
            for o, default in defaults.items()
            if o != flag and getattr(args, o) != default
        ]
        if getattr(args, flag) and others:
            raise cli.UsageError(f"{what}: it cannot be combined with {others[0]}.")
    if args.rounds < 0:
        raise cli.UsageError(f"--rounds must be 0 or more, got {args.rounds}.")
    for flag in ("search", "memorize"):
        if getattr(args, flag) and not any(sizes):
            raise cli.UsageError(f"--{flag} needs a memory size above 0 in --memory-sizes.")
    if args.peer and (args.preset, args.batch_size or 8, args.dtype) != ("tiny", 8, "float32"):
        raise cli.UsageError(
            "--peer times the tiny preset's step (batch 8, float32) beside the peer's."
        )
    if args.peer and shutil.which(args.peer) is None:
        raise cli.UsageError(f"--peer {args.peer} is not a program that can be run.")
    if args.repeats > 1 and not args.peer:
        raise cli.UsageError("--repeats goes with --peer.")


def benchmark(args):
    base = presets.PRESETS[args.preset]
    batch = args.batch_size or base.batch_size
    sizes = memory_sizes(args.memory_sizes, base, batch, args.dtype)
    check_flags(args, sizes)
    setting = (args.dtype, args.memory_dtype)
    if args.alternate:
        if not args.rounds:
            raise cli.UsageError("--alternate (internal) needs --rounds above 0.")
        rows = alternate_rows(
            args.preset, batch, sizes, args.rounds, *setting, args.attention, args.ops
        )
        return print(json.dumps(rows)) or 0
    if args.row is not None and args.compile_only:
        return (
            print(
                json.dumps(
                    compile_row(args.preset, batch, args.row, *setting, args.attention, args.ops)
                )
            )
            or 0
        )
    if args.row is not None:
        return (
            print(
                json.dumps(
                    run_row(
                        args.preset,
                        batch,
                        args.row,
                        args.timed_steps,
                        *setting,
                        args.profile,
                        args.attention,
                        args.train_only,
                        args.ops,
                    )
                )
            )
            or 0
        )
    if args.json:
        runs.check_output(args.json, "--json", caches=[cli.cache_dir()])
    if args.profile:
        runs.check_writable_dir(args.profile, "--profile")
        os.makedirs(args.profile, exist_ok=True)
    if args.search:
        return search_table(args, base, batch, sizes)
    if args.memorize:
        return memorize_table(args, base, sizes)
    common = [
        sys.executable,
        os.path.abspath(__file__),
        "--preset",
        args.preset,
        "--batch-size",
        str(batch),
        "--timed-steps",
        str(args.timed_steps),
        "--dtype",
        args.dtype,
        "--attention",
        args.attention,
        "--ops",
        args.ops,
    ]
    common += ["--memory-dtype", args.memory_dtype] if args.memory_dtype else []
    if args.peer:
        return peer_table(args, common, sizes)
    rows, env, own_cache = [], None, None
    if args.compile_jobs > 1:
        cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        if not cache:  # one of this run's, removed at the end
            cache = own_cache = tempfile.mkdtemp(prefix="benchmark-jax-cache-")
        env = dict(
            os.environ,
            JAX_COMPILATION_CACHE_DIR=cache,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    try:
        code = time_rows(args, common, sizes, rows, env)
    finally:
        if own_cache:
            shutil.rmtree(own_cache, ignore_errors=True)
    if code:
        return code
    print_rows(args, base, batch, rows)
    if args.json:
        runs.write_output(args.json, runs.json_text(rows))
    return 0


def print_rows(args, c, batch, rows):
    """The train-step table (and the forward-pass table, and --profile's)."""
    base_row = next((r for r in rows if r["memory_size"] == 0), rows[0])
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in rows[0]["device"]), None)
    for r in rows:
        r["mfu"] = r["train_flops"] / r["step_s"] / peak if peak else None
        r["ratio"] = r["step_s"] / base_row["step_s"]
        r["floor_ratio"] = r["train_flops"] / base_row["train_flops"]
        r["forward_ratio"] = (
            r["forward_s"] / base_row["forward_s"]
            if r["forward_s"] and base_row["forward_s"]
            else None
        )
        r["forward_floor_ratio"] = r["forward_flops"] / base_row["forward_flops"]
        # Peak memory added by the memory, over the memory's own storage (keys and values).
        r["peak_growth"] = (
            (r["peak_bytes"] - base_row["peak_bytes"]) / r["memory_bytes"]
            if r["memory_bytes"] and base_row["memory_size"] == 0
            else None
        )
    print(
        f"device: {rows[0]['device']} | preset {args.preset}: {c.num_layers} layers, d_model "
        f"{c.d_model}, "
        f"T {c.segment_length}, batch {batch}, k {c.num_neighbors}, {args.dtype}, memory in "
        f"{rows[-1]['memory_dtype']}, {args.attention} attention, {args.ops} ops, median of "
        f"{corpora.plural(args.timed_steps, 'step')}"
    )
    fmt = lambda x, spec=".3f": "-" if x is None else format(x, spec)
    print("\ntrain step")
    print(
        f"{'memory':>8} {'step s':>9} {'ratio':>7} {'floor':>7} {'tokens/s':>10} {'peak MiB':>9} "
        f"{'growth':>7} "
        f"{'recall':>7}"
        + (f" {'MFU':>6}" if rows[0]["mfu"] is not None else "")
        + (f" {'paired':>7} {'min':>6} {'max':>6} {'/floor':>7}" if args.rounds else "")
    )
    for r in rows:
        print(
            f"{r['memory_size']:>8} {r['step_s']:>9.4f} {r['ratio']:>7.3f} "
            f"{r['floor_ratio']:>7.3f} "
            f"{r['tokens_per_s']:>10.0f} {r['peak_bytes'] / 2**20:>9.0f} "
            f"{fmt(r['peak_growth']):>7} "
            f"{fmt(r['recall']):>7}"
            + (f" {r['mfu']:>6.1%}" if r["mfu"] is not None else "")
            + (
                f" {r['paired_ratio']:>7.3f} {r['paired_min']:>6.3f} {r['paired_max']:>6.3f} "
                f"{r['paired_ratio'] / r['floor_ratio']:>7.3f}"
                if args.rounds
                else ""
            )
        )
    if base_row["memory_size"]:
        print(
            f"ratios (and the paired ones): over the first row (memory {base_row['memory_size']}), "
            "as "
            f"--memory-sizes has no 0 (no memory, the baseline)"
        )
    print(
        "growth: peak memory added over the no-memory row, divided by the memory's own keys and "
        "values"
    )
    if args.rounds:
        print(
            f"paired: median over {corpora.plural(args.rounds, 'round')}, the rows' steps called "
            "in "
            "turn in one process, "
            "of each step's time over the no-memory step's in the same round (min, max); /floor: "
            "paired over floor"
        )
    if not args.train_only:
        print(
            "\nforward pass; and (no-memory row) the loss's gradient against the forward + loss it "
            "differentiates"
        )
        print(
            f"{'memory':>8} {'fwd s':>9} {'ratio':>7} {'floor':>7} {'fwd+loss s':>11} "
            f"{'grad s':>9} {'grad/fwd':>9}"
        )
        for r in rows:
            print(
                f"{r['memory_size']:>8} {r['forward_s']:>9.4f} {r['forward_ratio']:>7.3f} "
                f"{r['forward_floor_ratio']:>7.3f} {fmt(r['loss_forward_s'], '.4f'):>11} "
                f"{fmt(r['grad_s'], '.4f'):>9} "
                f"{fmt(r['grad_over_forward']):>9}"
            )
    for r in rows if args.profile else ():
        print(
            f"\nwhere the step's time goes, memory {r['memory_size']}: ms per step by the JAX "
            "operation it came "
            f"from ({args.profile}/profile_M{r['memory_size']}.json has every XLA operation)"
        )
        for op in r["profile"]["ops"]:
            print(f"{op['ms_per_step']:>9.2f} {op['share']:>6.1%}  {op['source'][-100:]}")
        print(
            f"the largest arrays the step's operations produce, memory {r['memory_size']} (MiB, "
            "shape, operation; "
            f"an update in place counts its whole array):"
        )
        for b in r["profile"]["largest_buffers"]:
            print(f"{b['bytes'] / 2**20:>9.1f}  {b['shape']:<28} {b['opcode']} {b['source'][-80:]}")


if __name__ == "__main__":
    cli.exit_with(main())

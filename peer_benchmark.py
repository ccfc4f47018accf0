"""Side by side: this model's train step against lucidrains' memorizing-transformers-pytorch.

  python peer_benchmark.py                                # tiny preset, M = 0, 8192, 65536
  python peer_benchmark.py --peer-python /tmp/peer/bin/python --json side_by_side.json
  python peer_benchmark.py --peer-python /tmp/peer/bin/python --repeats 3   # ours, theirs, ours, ...

Not part of the project's dependencies, nor of its tests. The peer runs in its own Python
(--peer-python, default this one), which needs `torch` (CPU), `faiss-cpu`, `einops`,
`einops-exts`, `filelock`, `joblib` and `memorizing-transformers-pytorch` installed with
`--no-deps` (its metadata pins faiss-gpu). Without them its rows are skipped, with one line
saying so, and the exit code is 0.

Ours: `benchmark.py` on the same preset (one process per memory size). Theirs: its closest
configuration to the `tiny` preset, 4 layers, d_model 128, 4 heads of 32, FFN x4, T 128,
batch 8, k 32, an XL memory of one segment in every layer and the kNN memory in the 3rd
layer (its layers count from 1; ours is layer 2 of 0..3); memory size 0 = no kNN layer.
Its step: forward with the loss, backward, one Adam update, on consecutive segments with the
XL memories passed on. Before timing, its kNN memories are filled to the capacity the timed
steps will reach (it wipes a row's whole index when an add would overflow it), and
OMP_WAIT_POLICY=PASSIVE keeps its idle threads from spinning. Recall: the share of the exact
top-k (inner product, float32) that its HNSW index returns, for 64 random unit queries among M
random unit keys, as benchmark.py measures ours.

--repeats N runs the whole side by side N times in turn (ours, then theirs, then ours
again...). Each repeat gives every row its ours/theirs ratio from two measurements minutes
apart; the table gives the median over the repeats of each step time and of each ratio, and
the ratios' range. A shared machine's slow minute moves one repeat, not the median.
"""
import os
import signal

if __name__ == "__main__":  # Ctrl-C or SIGTERM while importing: nothing is written yet, leave in one line
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted before anything was written.\n"), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmark import run_child  # (benchmark.py imports JAX only inside its functions)

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_PACKAGES = ("torch", "faiss", "einops", "memorizing_transformers_pytorch")


def peer_recall(memory_size, dim=32, k=32, queries=64):
    """Its HNSW index (its own KNN wrapper, default settings) against exact inner-product top-k."""
    from memorizing_transformers_pytorch.knn_memory import KNN
    rng = np.random.default_rng(0)
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    q, keys = unit(rng.standard_normal((queries, dim))), unit(rng.standard_normal((memory_size, dim)))
    knn = KNN(dim=dim, max_num_entries=memory_size, cap_num_entries=True)
    knn.add(keys, ids=np.arange(memory_size))
    found = knn.search(q, k)
    exact = np.argsort(-(q @ keys.T), axis=1)[:, :k]
    return float(np.mean([len(set(a) & set(e)) / k for a, e in zip(found.tolist(), exact.tolist())]))


def peer_row(memory_size, steps, batch=8, segment=128, vocab=2048):
    """One memory size of the peer, in this process; returns its measurements."""
    import torch
    from memorizing_transformers_pytorch import MemorizingTransformer
    torch.manual_seed(0)
    memory_dir = tempfile.mkdtemp(prefix="peer_knn_")
    try:
        model = MemorizingTransformer(
            num_tokens=vocab, dim=128, depth=4, heads=4, dim_head=32, ff_mult=4,
            memorizing_layers=(3,) if memory_size else (), max_knn_memories=max(memory_size, 1),
            num_retrieved_memories=32, xl_memory_layers=(1, 2, 3, 4), xl_max_memories=segment,
            knn_memories_directory=memory_dir)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        data = torch.randint(1, vocab, (batch, segment + 1), generator=gen)  # 0 is its padding id
        x, y = data[:, :-1], data[:, 1:]
        with model.knn_memories_context(batch_size=batch) as knn_memories:
            n_steps = steps + 2  # two warm-up steps, then the timed ones
            if memory_size:  # filled so that the last timed step brings it to capacity, no further
                fill = memory_size - (n_steps - 1) * segment  # (its first step, with no XL memory, adds none)
                if fill < 0:
                    raise ValueError(f"memory size {memory_size} is below {n_steps - 1} steps of {segment} tokens.")
                rng = np.random.default_rng(1)
                kv = rng.standard_normal((batch, fill, 2, 32)).astype(np.float32)
                kv[:, :, 0] /= np.linalg.norm(kv[:, :, 0], axis=-1, keepdims=True)
                t0 = time.perf_counter()
                for memory in knn_memories:
                    memory.add(torch.from_numpy(kv))
                fill_s = time.perf_counter() - t0
            else:
                fill_s = 0.0
            xl, times = None, []
            for _ in range(n_steps):
                t0 = time.perf_counter()
                loss, xl = model(x, knn_memories=knn_memories, xl_memories=xl, labels=y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                xl = [m.detach() for m in xl]
                times.append(time.perf_counter() - t0)
            full = all(len(k.ids) == memory_size for m in knn_memories for k in m.knns) if memory_size else None
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
    return {"memory_size": memory_size, "step_s": statistics.median(times[2:]), "fill_s": fill_s,
            "filled_to_capacity": full, "recall": peer_recall(memory_size) if memory_size else None,
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def our_rows(sizes, steps):
    """benchmark.py's rows, one process per memory size: ({size: row}, 0), or (None, exit code)."""
    with tempfile.TemporaryDirectory() as tmp:
        ours_json = os.path.join(tmp, "ours.json")
        code, out, err = run_child([sys.executable, os.path.join(HERE, "benchmark.py"), "--memory-sizes",
                                    ",".join(map(str, sizes)), "--steps", str(steps), "--json", ours_json])
        if code:
            last = (err.strip().splitlines() or ["?"])[-1].removeprefix("error: ")
            # its refusal of bad input (before anything ran) is passed on as it is, one sentence
            print(f"error: {last}" if code == 2 else f"error: benchmark.py failed (exit code {code}): {last}",
                  file=sys.stderr)
            return None, code if code in (2, 130) else 1  # bad input, interrupted
        print(out, end="")
        with open(ours_json) as f:
            return {r["memory_size"]: r for r in json.load(f)}, 0


def their_rows(sizes, steps, peer_python, env):
    """The peer's rows, one process per memory size: ({size: row}, 0), or (None, 1)."""
    theirs = {}
    for m in sizes:
        code, out, err = run_child([peer_python, os.path.abspath(__file__), "--peer-row", str(m),
                                    "--steps", str(steps)], env=env)
        if code:
            print(f"error: the peer's row {m} failed: {(err.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
            return None, 130 if code == 130 else 1
        theirs[m] = json.loads(out.strip().splitlines()[-1])
        print(f"peer row {m}: step {theirs[m]['step_s']:.4f} s (memory filled in {theirs[m]['fill_s']:.0f} s)",
              file=sys.stderr)
    return theirs, 0


def side_by_side(ours_runs, theirs_runs, sizes):
    """The table's rows from the repeats: ours_runs and theirs_runs hold one {size: row} per
    repeat (theirs empty where the peer was skipped). Each ratio is taken within a repeat (a
    row over the same repeat's first row, ours over theirs), then the median over the
    repeats is given, with the range of ours over theirs. Recall does not depend on the
    repeat: the first one's is given."""
    med = lambda xs: statistics.median(xs) if xs else None
    rows = []
    for m in sizes:
        ours = [run[m] for run in ours_runs]
        theirs = [run[m] for run in theirs_runs if run]
        over = [o["step_s"] / t["step_s"] for o, t in zip(ours, theirs)]
        grads = [o["grad_over_forward"] for o in ours if o.get("grad_over_forward") is not None]
        rows.append({
            "memory_size": m,
            "ours_step_s": med([o["step_s"] for o in ours]),
            "ours_ratio": med([run[m]["step_s"] / run[sizes[0]]["step_s"] for run in ours_runs]),
            "ours_recall": ours[0]["recall"],
            "theirs_step_s": med([t["step_s"] for t in theirs]),
            "theirs_ratio": med([run[m]["step_s"] / run[sizes[0]]["step_s"] for run in theirs_runs if run]),
            "theirs_recall": theirs[0]["recall"] if theirs else None,
            "ours_over_theirs": med(over), "ours_over_theirs_min": min(over, default=None),
            "ours_over_theirs_max": max(over, default=None), "ours_over_theirs_by_repeat": over,
            "grad_over_forward": med(grads), "grad_over_forward_by_repeat": grads})
    return rows


class Parser(argparse.ArgumentParser):
    """Bad flags in one line and exit code 2 (train.Parser's behaviour, without importing JAX,
    which the peer's Python may not have)."""
    def error(self, message):
        self.exit(2, f"error: {message}\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, but no "(default: None)" (train.HelpFormatter's rule):
    an unset --json writes no file, as its help says."""
    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser():
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--memory-sizes", default="0,8192,65536", help="comma-separated memory sizes; 0 = no memory")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    p.add_argument("--peer-python", default=sys.executable,
                   help="the Python that has torch, faiss and memorizing_transformers_pytorch")
    p.add_argument("--repeats", type=int, default=1, help="run the whole side by side this many times in turn "
                   "and give each row's median over them (of each step time and of each ratio, which is taken "
                   "within a repeat), with the range of ours over theirs")
    p.add_argument("--json", help="write the table's rows and both sides' rows of every repeat (each with its "
                   "'repeat') to this file")
    p.add_argument("--peer-row", type=int, help=argparse.SUPPRESS)  # internal: one peer row in this process
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1.")
    if args.repeats < 1:
        p.error("--repeats must be >= 1.")
    if args.json == "" or args.peer_python == "":
        p.error(f"argument {'--json' if args.json == '' else '--peer-python'}: needs a path, got an empty string.")
    if args.peer_row is not None:
        print(json.dumps(peer_row(args.peer_row, args.steps)))
        return 0
    sys.path.insert(0, HERE)
    import train  # (not before: a peer row runs in the peer's Python, which has no JAX)
    import benchmark
    import memorizing_transformer as mt
    try:  # each size as benchmark.py will check it (our rows: tiny, its batch, float32)
        sizes = benchmark.memory_sizes(args.memory_sizes, mt.PRESETS["tiny"], mt.PRESETS["tiny"].batch_size, "float32")
    except train.UsageError as e:
        p.error(str(e))
    folder = os.path.dirname(os.path.abspath(args.json or "."))
    if args.json and not train.is_stream(args.json) and (os.path.isdir(args.json) or
                                                         not train.writable_directory(folder)):
        p.error(f"--json {args.json} is a directory, or its folder does not exist or cannot be written to.")
    if shutil.which(args.peer_python) is None:
        p.error(f"--peer-python {args.peer_python} is not a program that can be run.")

    # The way every script here runs its command (train.run_command): bad files one line and
    # exit code 2; Ctrl-C and SIGTERM a KeyboardInterrupt, on which run_child stops the child
    # that runs (benchmark.py, which stops its row, or a peer row) before we leave with 130.
    return train.run_command(lambda args: side_by_side_command(args, sizes), args)


def side_by_side_command(args, sizes):
    """Both sides, --repeats times, then the table (and --json)."""
    import train
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    code, _, err = run_child([args.peer_python, "-c", "import " + ", ".join(PEER_PACKAGES)], env=env)
    peer = not code
    if not peer:
        print(f"peer: skipped, {args.peer_python} cannot import it ({(err.strip().splitlines() or ['?'])[-1]}); "
              f"see this script's docstring for what to install.")
    ours_runs, theirs_runs = [], []
    for i in range(args.repeats):
        if args.repeats > 1:
            print(f"repeat {i + 1} of {args.repeats}", file=sys.stderr)
        ours, code = our_rows(sizes, args.steps)
        if ours is None:
            return code
        theirs, code = their_rows(sizes, args.steps, args.peer_python, env) if peer else ({}, 0)
        if theirs is None:
            return code
        ours_runs.append(ours)
        theirs_runs.append(theirs)

    rows = side_by_side(ours_runs, theirs_runs, sizes)
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    first = ours_runs[0][sizes[0]]
    spread = args.repeats > 1
    print(f"\nside by side, {first['device']}, median of {train.plural(args.steps, 'step')}"
          + (f", median of {args.repeats} repeats" if spread else "")
          + (f"; peer: torch {theirs_runs[0][sizes[0]]['torch']}, {theirs_runs[0][sizes[0]]['threads']} threads"
             if peer else ""))
    print(f"{'memory':>8} {'ours s':>8} {'ratio':>6} {'recall':>6} {'theirs s':>9} {'ratio':>6} {'recall':>6} "
          f"{'ours/theirs':>11}" + (f" {'min':>6} {'max':>6}" if spread else ""))
    for r in rows:
        print(f"{r['memory_size']:>8} {r['ours_step_s']:>8.4f} {r['ours_ratio']:>6.3f} "
              f"{fmt(r['ours_recall'], '.3f'):>6} {fmt(r['theirs_step_s'], '.4f'):>9} "
              f"{fmt(r['theirs_ratio'], '.3f'):>6} {fmt(r['theirs_recall'], '.3f'):>6} "
              f"{fmt(r['ours_over_theirs'], '.3f'):>11}"
              + (f" {fmt(r['ours_over_theirs_min'], '.3f'):>6} {fmt(r['ours_over_theirs_max'], '.3f'):>6}"
                 if spread else ""))
    for r in rows:  # benchmark.py times the gradient in the no-memory row only
        if r["grad_over_forward"] is not None:
            print(f"grad/fwd (ours, memory {r['memory_size']}: the gradient over the forward pass and loss it "
                  f"differentiates): {r['grad_over_forward']:.3f}"
                  + (f" (each repeat: {', '.join(f'{x:.3f}' for x in r['grad_over_forward_by_repeat'])})"
                     if spread else ""))
    if args.json:
        tag = lambda runs: [dict(row, repeat=i) for i, run in enumerate(runs) for row in run.values()]
        train.write_output(args.json, train.json_text({"repeats": args.repeats, "rows": rows,
                                                       "ours": tag(ours_runs), "theirs": tag(theirs_runs)}))
    return 0


if __name__ == "__main__":
    code = main()
    if "train" in sys.modules:  # our side leaves as every script here does (a peer row has no JAX, no train)
        sys.modules["train"].exit_with(code)
    sys.exit(code)

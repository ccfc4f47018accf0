"""Side by side: this model's train step against lucidrains' memorizing-transformers-pytorch.

  python peer_benchmark.py                                # tiny preset, M = 0, 8192, 65536
  python peer_benchmark.py --peer-python /tmp/peer/bin/python --json side_by_side.json

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


class Parser(argparse.ArgumentParser):
    """Bad flags in one line and exit code 2 (train.Parser's behaviour, without importing JAX,
    which the peer's Python may not have)."""
    def error(self, message):
        self.exit(2, f"error: {message}\n")


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--memory-sizes", default="0,8192,65536", help="comma-separated memory sizes; 0 = no memory")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row (median reported)")
    p.add_argument("--peer-python", default=sys.executable,
                   help="the Python that has torch, faiss and memorizing_transformers_pytorch")
    p.add_argument("--json", help="write both sides' rows to this file")
    p.add_argument("--peer-row", type=int, help=argparse.SUPPRESS)  # internal: one peer row in this process
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1.")
    try:
        sizes = [int(s) for s in args.memory_sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--memory-sizes must be comma-separated integers, got {args.memory_sizes!r}.")
    if not sizes or min(sizes) < 0:
        p.error("--memory-sizes needs at least one size, each >= 0.")
    if args.peer_row is not None:
        print(json.dumps(peer_row(args.peer_row, args.steps)))
        return 0
    if args.json and (os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json)))):
        p.error(f"--json {args.json} is a directory or its folder does not exist.")

    with tempfile.TemporaryDirectory() as tmp:  # ours: the project's own benchmark
        ours_json = os.path.join(tmp, "ours.json")
        code, out, err = run_child([sys.executable, os.path.join(HERE, "benchmark.py"), "--memory-sizes",
                              ",".join(map(str, sizes)), "--steps", str(args.steps), "--json", ours_json])
        if code:
            print(f"error: benchmark.py failed (exit code {code}): {(err.strip().splitlines() or ['?'])[-1]}",
                  file=sys.stderr)
            return code if code in (2, 130) else 1  # bad input (refused before anything ran), interrupted
        print(out, end="")
        with open(ours_json) as f:
            ours = {r["memory_size"]: r for r in json.load(f)}

    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    probe = "import " + ", ".join(PEER_PACKAGES)
    code, _, err = run_child([args.peer_python, "-c", probe], env=env)
    theirs = {}
    if code:
        print(f"peer: skipped, {args.peer_python} cannot import it ({(err.strip().splitlines() or ['?'])[-1]}); "
              f"see this script's docstring for what to install.")
    else:
        for m in sizes:
            code, out, err = run_child([args.peer_python, os.path.abspath(__file__), "--peer-row", str(m),
                                  "--steps", str(args.steps)], env=env)
            if code:
                print(f"error: the peer's row {m} failed: {(err.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
                return 1
            theirs[m] = json.loads(out.strip().splitlines()[-1])
            print(f"peer row {m}: step {theirs[m]['step_s']:.4f} s (memory filled in {theirs[m]['fill_s']:.0f} s)",
                  file=sys.stderr)

    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    base_ours, base_theirs = ours[sizes[0]]["step_s"], theirs[sizes[0]]["step_s"] if theirs else None
    print(f"\nside by side, {ours[sizes[0]]['device']}, median of {args.steps} steps"
          + (f"; peer: torch {theirs[sizes[0]]['torch']}, {theirs[sizes[0]]['threads']} threads" if theirs else ""))
    print(f"{'memory':>8} {'ours s':>8} {'ratio':>6} {'recall':>6} {'theirs s':>9} {'ratio':>6} {'recall':>6} "
          f"{'ours/theirs':>11}")
    rows = []
    for m in sizes:
        o, t = ours[m], theirs.get(m)
        row = {"memory_size": m, "ours_step_s": o["step_s"], "ours_ratio": o["step_s"] / base_ours,
               "ours_recall": o["recall"], "theirs_step_s": t and t["step_s"],
               "theirs_ratio": t and t["step_s"] / base_theirs, "theirs_recall": t and t["recall"],
               "ours_over_theirs": t and o["step_s"] / t["step_s"]}
        rows.append(row)
        print(f"{m:>8} {o['step_s']:>8.4f} {row['ours_ratio']:>6.3f} {fmt(o['recall'], '.3f'):>6} "
              f"{fmt(row['theirs_step_s'], '.4f'):>9} {fmt(row['theirs_ratio'], '.3f'):>6} "
              f"{fmt(row['theirs_recall'], '.3f'):>6} {fmt(row['ours_over_theirs'], '.3f'):>11}")
    if args.json:
        sys.path.insert(0, HERE)
        import train
        train.atomic_write(args.json, json.dumps({"rows": rows, "ours": list(ours.values()),
                                                  "theirs": list(theirs.values())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The peer's side of `benchmark.py --peer PYTHON`: one row of lucidrains'
memorizing-transformers-pytorch, run in PYTHON (not this project's dependency), printed as one JSON
line.

  PYTHON peer_benchmark.py M STEPS     # the row with memory size M (0: no kNN layer)
  PYTHON peer_benchmark.py --check     # exit code 0 if PYTHON can import the peer

PYTHON needs torch (CPU), faiss-cpu, einops, einops-exts, filelock, joblib and
memorizing-transformers-pytorch (installed with --no-deps: its metadata pins faiss-gpu). The peer's
closest configuration to the tiny preset: 4 layers of 128, 4 heads of 32, FFN x4, T 128, batch 8, k
32, an XL memory of one segment in every layer and the kNN memory in its 3rd layer (ours: index 2 of
0..3), filled to the capacity the timed steps reach (it wipes a row's index when an add would
overflow it); one Adam step a step, OMP_WAIT_POLICY=PASSIVE.
"""

import json
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np


def peer_row(memory_size, steps, batch=8, segment=128, vocab=2048):
    """One memory size of the peer, in the peer's Python: its step time, and its
    HNSW index's recall of the exact top-32 of 64 random unit queries among M
    random unit keys."""
    import torch
    from memorizing_transformers_pytorch import MemorizingTransformer
    from memorizing_transformers_pytorch.knn_memory import KNN

    torch.manual_seed(0)
    memory_dir, n_steps, rng = (
        tempfile.mkdtemp(prefix="peer_knn_"),
        steps + 2,
        np.random.default_rng(1),
    )
    unit = lambda x: (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)
    try:
        model = MemorizingTransformer(
            num_tokens=vocab,
            dim=128,
            depth=4,
            heads=4,
            dim_head=32,
            ff_mult=4,
            memorizing_layers=(3,) if memory_size else (),
            max_knn_memories=max(memory_size, 1),
            num_retrieved_memories=32,
            xl_memory_layers=(1, 2, 3, 4),
            xl_max_memories=segment,
            knn_memories_directory=memory_dir,
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        tokens = torch.randint(
            1, vocab, (batch, segment + 1), generator=torch.Generator().manual_seed(0)
        )
        with model.knn_memories_context(batch_size=batch) as knn_memories:
            fill = max(
                memory_size - (n_steps - 1) * segment, 0
            )  # the timed steps bring it to capacity
            kv = np.stack(
                [
                    unit(rng.standard_normal((batch, fill, 32))),
                    rng.standard_normal((batch, fill, 32)),
                ],
                2,
            )
            for memory in knn_memories if fill else ():
                memory.add(torch.from_numpy(kv.astype(np.float32)))
            xl, times = None, []
            for _ in range(n_steps):  # two warm-up steps, then the timed ones
                t0 = time.perf_counter()
                loss, xl = model(
                    tokens[:, :-1], knn_memories=knn_memories, xl_memories=xl, labels=tokens[:, 1:]
                )
                loss.backward()
                opt.step()
                opt.zero_grad()
                xl = [m.detach() for m in xl]
                times.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(memory_dir, ignore_errors=True)
    recall = None
    if memory_size:
        rng = np.random.default_rng(0)
        q, keys = unit(rng.standard_normal((64, 32))), unit(rng.standard_normal((memory_size, 32)))
        knn = KNN(dim=32, max_num_entries=memory_size, cap_num_entries=True)
        knn.add(keys, ids=np.arange(memory_size))
        found, exact = (
            knn.search(q, 32).tolist(),
            np.argsort(-(q @ keys.T), axis=1)[:, :32].tolist(),
        )
        recall = float(np.mean([len(set(a) & set(e)) / 32 for a, e in zip(found, exact)]))
    return {
        "memory_size": memory_size,
        "step_s": statistics.median(times[2:]),
        "recall": recall,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    if args != ["--check"] and not (len(args) == 2 and all(a.isdigit() for a in args)):
        print(
            "usage: PYTHON peer_benchmark.py M STEPS, or PYTHON peer_benchmark.py --check",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        import torch, faiss, einops, memorizing_transformers_pytorch  # noqa: F401, E401
    except ImportError as e:
        print(
            f"{e} in {sys.executable}: docs/performance.md's 'Against the PyTorch peer' shows "
            "what to install.",
            file=sys.stderr,
        )
        sys.exit(1)
    if args != ["--check"]:
        print(json.dumps(peer_row(int(args[0]), int(args[1]))))

"""Memorizing Transformers (Wu, Rabe, Hutchins, Szegedy; ICLR 2022): the model, plain, in the paper's order.

  params = init_params(config, rng);  state = init_state(config, batch_size)
  logits, state = forward(params, state, tokens, reset, config)    # ops=kernels.FAST: the faster drop-ins
Axes: B batch rows, T segment length, C cache length (T or 0), S = C + T local keys, H heads, D head
dim, M memory size, K neighbours, L layers (Lm with memory), V vocab, E d_model, F d_ff, N = B * T."""
import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # a finite "minus infinity": masked logits never make NaN gradients


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class Config:
    # model (Sec. 4.2)
    vocab_size: int = 32768
    d_model: int = 1024
    num_layers: int = 12
    num_heads: int = 8
    head_dim: int = 128
    d_ff: int = 4096
    segment_length: int = 512
    xl_cache: bool = True
    memory_layers: tuple = (8,)  # 0-based: the paper's "9th layer"
    memory_size: int = 8192  # M, per batch row and head; 0 = no memory at all
    num_neighbors: int = 32  # k
    num_buckets: int = 32  # T5 relative position bias
    max_distance: int = 128
    exact_topk: bool = False  # True: exact top-k; False: the binned approximate top-k (Sec. 3.3)
    topk_recall_target: float = 0.95  # sets the number of bins of the approximate top-k
    memory_chunk: int = 1024  # kernels.py scores the memory this many slots at a time
    dtype: str = "float32"  # activations and matmuls; "bfloat16" for mixed precision
    memory_dtype: str = None  # storage of the memory and the XL cache; None: as dtype
    attention: str = "explicit"  # kernels.py's local attention: "explicit", or "fused" (cuDNN's on a GPU)
    init_prev_token_bias: float = 0.0  # T5 bias at distance 1 in half the first layer's heads (README)
    init_gate_bias: float = 0.0  # Eq. (1)'s gate starts at sigmoid(0) = 0.5, as in the paper
    # training (Sec. 4.2)
    batch_size: int = 256  # rows; a batch holds batch_size * segment_length tokens
    grad_accum: int = 1  # micro-batches per step (rows are split between them)
    steps: int = 500_000
    lr: float = 1.0
    warmup_steps: int = 1000
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "memory_layers", memory_layers := tuple(self.memory_layers))  # (JSON: a list)
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "d_ff", "segment_length", "steps",
                     "num_neighbors", "num_buckets", "max_distance", "memory_chunk", "batch_size", "grad_accum"):
            value = getattr(self, name)
            check(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}.")
        M, T, L, K, layers = self.memory_size, self.segment_length, self.num_layers, self.num_neighbors, memory_layers
        check(self.max_distance > self.num_buckets // 2, f"max_distance ({self.max_distance}) must exceed num_buckets "
              f"// 2 ({self.num_buckets // 2}), where the T5 log-spaced buckets begin.")
        check(M >= 0 and M % T == 0, f"memory_size ({M}) must be a multiple of segment_length ({T}) and >= 0.")
        check(not M or K <= M, f"num_neighbors ({K}) must be <= memory_size ({M}).")
        for i in layers:
            check(0 <= i < L, f"memory layer index {i} is out of range for {L} layer{'s' * (L != 1)} (0-based).")
        check(len(set(layers)) == len(layers), f"memory_layers has a repeated index: {layers}.")
        check(not M or layers, f"memory_size is {M} but memory_layers names no layer; for no memory, set it to 0.")
        check(self.num_heads * self.head_dim == self.d_model, f"num_heads * head_dim ({self.num_heads} * "
              f"{self.head_dim}) must equal d_model ({self.d_model}).")
        check(0 < self.topk_recall_target < 1, f"topk_recall_target must be in (0, 1), got {self.topk_recall_target}.")
        for name, allowed in (("dtype", ("float32", "bfloat16")), ("memory_dtype", (None, "float32", "bfloat16")),
                              ("attention", ("explicit", "fused"))):
            check(getattr(self, name) in allowed, f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        check(self.batch_size % self.grad_accum == 0, f"batch_size ({self.batch_size}) must be divisible by "
              f"grad_accum ({self.grad_accum}).")
        check(self.lr > 0 and self.warmup_steps >= 0, f"lr must be > 0 and warmup_steps >= 0, got {self.lr}, "
              f"{self.warmup_steps}.")
        for name in ("lr", "init_prev_token_bias", "init_gate_bias"):
            check(math.isfinite(getattr(self, name)), f"{name} must be finite, got {getattr(self, name)}.")

    @property
    def active_memory_layers(self):
        """The kNN-augmented layers; none when memory_size is 0."""
        return tuple(sorted(self.memory_layers)) if self.memory_size else ()

    @property
    def storage_dtype(self):
        return self.memory_dtype or self.dtype

    @property
    def cache_length(self):
        return self.segment_length if self.xl_cache else 0

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def check(ok, message):
    if not ok:
        raise ValueError(message)


PRESETS = {
    # Sec. 4.2: 2^17 tokens a step as 8 micro-batches of 32 rows; the memory scored 8192 slots at a time.
    "paper": Config(grad_accum=8, memory_chunk=8192),
    # One GPU, a few minutes.
    "small": Config(vocab_size=8192, d_model=512, num_layers=8, num_heads=8, head_dim=64, d_ff=2048, segment_length=512,
                    memory_layers=(5,), memory_size=2048, batch_size=32, steps=5000, warmup_steps=500),
    # A 2-core CPU: visibly learns within ten minutes.
    "tiny": Config(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, head_dim=32, d_ff=512, segment_length=128,
                   memory_layers=(2,), memory_size=512, batch_size=8, steps=1200, warmup_steps=100),
    # The synthetic task's recipe (README): two layers, so that the copy circuit's second half can only live
    # in the memory layer; a previous-token prior; a rate at which the weights do not learn the bindings.
    "synthetic": Config(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, head_dim=32, d_ff=512,
                        segment_length=128, memory_layers=(1,), memory_size=512, batch_size=8, steps=2000,
                        warmup_steps=100, lr=0.3, init_prev_token_bias=6.0),
}


# ----------------------------------------------------------------------------- state and parameters
class State(NamedTuple):
    """What is carried from one segment to the next; every leaf is batch-leading."""
    cache_k: jax.Array  # [B, L, H, C, D] the previous segment's keys (Transformer-XL)
    cache_v: jax.Array  # [B, L, H, C, D]
    cache_valid: jax.Array  # [B, C] bool: False for padding and before a document start
    mem_k: jax.Array  # [B, Lm, H, M, D] the external memory (Sec. 3.1), a ring buffer
    mem_v: jax.Array  # [B, Lm, H, M, D]
    mem_valid: jax.Array  # [B, M] bool: the slot holds a key of the current document
    mem_pos: jax.Array  # [B] int32: the next slot to write
    pending_k: jax.Array  # [B, Lm, H, T, D] the last segment's keys, appended at the next call
    pending_v: jax.Array  # [B, Lm, H, T, D]
    pending_valid: jax.Array  # [B, T] bool


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_state(config, batch_size):
    c, n, B = config, len(config.active_memory_layers), batch_size
    L, H, C, M, T = c.num_layers, c.num_heads, c.cache_length, *((c.memory_size, c.segment_length) if n else (0, 0))
    kv = lambda *shape: jnp.zeros((B,) + shape + (c.head_dim,), c.storage_dtype)
    return State(kv(L, H, C), kv(L, H, C), jnp.zeros((B, C), bool), kv(n, H, M), kv(n, H, M), jnp.zeros((B, M), bool),
                 jnp.zeros(B, jnp.int32), kv(n, H, T), kv(n, H, T), jnp.zeros((B, T), bool))


def init_params(config, rng):
    """Nested dicts of float32 arrays; the README explains each choice."""
    c, E, H, D, F = config, config.d_model, config.num_heads, config.head_dim, config.d_ff
    keys = iter(jax.random.split(rng, 2 + 6 * c.num_layers))
    normal = lambda shape, std: std * jax.random.normal(next(keys), shape, jnp.float32)
    prior = np.zeros((c.num_buckets, H), np.float32)
    prior[1, :H // 2] = c.init_prev_token_bias  # bucket 1 = distance 1: a previous-token head
    layers = []
    for i in range(c.num_layers):
        layer = {"attn_norm": np.ones(E, np.float32),
                 "wq": normal((E, H, D), E ** -0.5), "wk": normal((E, H, D), E ** -0.5),
                 "wv": normal((E, H, D), E ** -0.5), "wo": normal((H, D, E), (H * D * 2 * c.num_layers) ** -0.5),
                 "qk_scale": np.full(H, math.sqrt(D), np.float32),  # Sec. 3.2: unit q.k logits at the start
                 "rel_bias": prior if i == 0 else np.zeros((c.num_buckets, H), np.float32),  # T5 bias
                 "ffn_norm": np.ones(E, np.float32),
                 "w1": normal((E, F), E ** -0.5), "w2": normal((F, E), (F * 2 * c.num_layers) ** -0.5)}
        if i in c.active_memory_layers:
            layer["gate_bias"] = np.full(H, c.init_gate_bias, np.float32)  # Eq. (1)'s b_g
        layers.append(layer)
    params = {"embed": normal((c.vocab_size, E), 1.0), "layers": layers, "final_norm": np.ones(E, np.float32)}
    return jax.tree.map(jnp.asarray, dict(params, w_out=normal((E, c.vocab_size), E ** -0.5)))


# ----------------------------------------------------------------------------- Sec. 3: local attention
def rms_norm(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6) * w[None]).astype(x.dtype)


def l2_normalize(x):
    """Sec. 3.2: queries and keys become unit vectors along D."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def precision(config):
    """bfloat16 matmuls that return float32 keep bf16 inputs in the backward pass too."""
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if config.dtype == "bfloat16" else None


def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
    """T5's causal buckets of key minus query position (<= 0): one a distance below num_buckets // 2,
    then log-spaced up to max_distance. numpy: the buckets are constants of the compiled step."""
    n = np.maximum(-np.asarray(relative_position), 0)  # distance into the past
    exact = num_buckets // 2
    log_ratio = np.log(np.maximum(n, 1).astype(np.float32) / exact) / np.float32(math.log(max_distance / exact))
    large = np.minimum(exact + (log_ratio * (num_buckets - exact)).astype(np.int32), num_buckets - 1)
    return np.where(n < exact, n, large).astype(np.int32)


def masked_softmax(logits, valid):
    """Softmax over the last axis restricted to `valid`, and whether anything was (else all 0)."""
    any_valid = jnp.any(valid, axis=-1, keepdims=True)
    weights = jax.nn.softmax(jnp.where(valid, logits.astype(jnp.float32), NEG_INF), axis=-1)
    return weights * any_valid, any_valid[..., 0]


def local_attention(q, k, v, key_valid, rel_bias, scale, config):
    """Sec. 3: causal attention over [XL cache; segment] with a sliding window and the T5 bias.
    q [B, H, T, D]; k, v [B, H, S, D], the cache first; key_valid [B, S] -> [B, H, T, D].
    Query t sits at position C + t and sees key s iff 0 <= C + t - s <= T: itself and at most
    the previous segment_length tokens. A padding query (key C + t invalid) gets 0."""
    T, S = q.shape[2], k.shape[2]
    dist = (S - T + np.arange(T))[:, None] - np.arange(S)[None, :]  # [T, S] query minus key position
    buckets = relative_position_bucket(-dist, config.num_buckets, config.max_distance)  # [T, S]
    bias = jnp.moveaxis(rel_bias[buckets], -1, 0)[None]  # [1, H, T, S]
    qs = q * scale.astype(q.dtype)[None, :, None, None]  # Sec. 3.2: the per-head scale of the unit vectors
    logits = jnp.einsum("bhtd,bhsd->bhts", qs, k, preferred_element_type=jnp.float32, precision=precision(config))
    logits = logits + bias  # [B, H, T, S]
    visible = (dist >= 0) & (dist <= config.segment_length)  # [T, S] the window
    weights, _ = masked_softmax(logits, visible[None, None] & key_valid[:, None, None, :])  # [B, H, T, S]
    out = jnp.einsum("bhts,bhsd->bhtd", weights.astype(v.dtype), v)  # [B, H, T, D]
    return out * key_valid[:, None, S - T:, None].astype(out.dtype)


# ----------------------------------------------------------------------------- Sec. 3.3: top-k
def num_topk_bins(k, memory_size, recall_target):
    """The fewest bins L (a power of two, at least k, at most M) whose expected recall, with the true
    top-k spread uniformly over L bins and one winner a bin, (L / k) * (1 - (1 - 1/L)^k), meets the target."""
    L = 1
    while L < memory_size and (L < k or (L / k) * (1 - (1 - 1 / L) ** k) < recall_target):
        L *= 2
    return min(L, memory_size)


def bin_layout(k, memory_size, recall_target):
    """(L, rows): the memory seen as rows of L bins, slot s in bin s mod L; rows the largest power
    of two that divides M and leaves at least num_topk_bins bins (M = 768: one row of 768)."""
    bins, rows = num_topk_bins(k, memory_size, recall_target), 1
    while memory_size % (2 * rows) == 0 and 2 * rows <= memory_size // bins:
        rows *= 2
    return memory_size // rows, rows


def memory_search(q, mem_k, mem_valid, scale, config):
    """The top-k memory slots of every query: q [B, H, T, D], mem_k [B, H, M, D], mem_valid [B, M]
    -> scores, slots [B, H, T, K]. Exact, or binned (Sec. 3.3): each bin's best slot, then the
    top-k of the bins' winners. Slots written one after another fall in different bins.
    Invalid slots score NEG_INF. Not differentiable: retrieval only picks slots."""
    B, H, M, D = mem_k.shape
    T, K = q.shape[2], config.num_neighbors
    qs = jax.lax.stop_gradient(q * scale.astype(q.dtype)[None, :, None, None])  # [B, H, T, D]
    scores = jnp.einsum("bhtd,bhmd->bhtm", qs, mem_k.astype(q.dtype), preferred_element_type=q.dtype)
    scores = jnp.where(mem_valid[:, None, None, :], scores, NEG_INF)  # [B, H, T, M]
    if config.exact_topk:
        return jax.lax.top_k(scores, K)
    L, rows = bin_layout(K, M, config.topk_recall_target)
    binned = scores.reshape(B, H, T, rows, L)  # slot s = row * L + bin
    best, row = jnp.max(binned, axis=3), jnp.argmax(binned, axis=3)  # [B, H, T, L] each bin's winner
    top, bins = jax.lax.top_k(best, K)  # [B, H, T, K]
    return top, jnp.take_along_axis(row, bins, axis=-1) * L + bins


# ----------------------------------------------------------------------------- Sec. 3.1: kNN attention
def attend_to_retrieved(q, mem_k, mem_v, slots, valid, scale, config):
    """Softmax attention of each query over its K retrieved pairs, with no position bias:
    q [B, H, T, D], slots and valid [B, H, T, K] -> out [B, H, T, D], weights [B, H, T, K],
    has_memory [B, H, T] (False where no retrieved slot was valid)."""
    gather = lambda mem: jnp.take_along_axis(mem[:, :, None], slots[..., None], axis=3).astype(q.dtype)
    keys, vals = gather(mem_k), gather(mem_v)  # [B, H, T, K, D]
    logits = jnp.einsum("bhtd,bhtkd->bhtk", q, keys, preferred_element_type=jnp.float32, precision=precision(config))
    weights, has_memory = masked_softmax(logits * scale[None, :, None, None], valid)  # [B, H, T, K]
    return jnp.einsum("bhtk,bhtkd->bhtd", weights.astype(vals.dtype), vals), weights, has_memory


def knn_attention(q, mem_k, mem_v, mem_valid, scale, config, search=memory_search, attend=attend_to_retrieved):
    """Sec. 3.1: retrieve each query's top-k pairs from the memory and attend to them.
    q [B, H, T, D]; mem_k, mem_v [B, H, M, D]; mem_valid [B, M] -> out, has_memory [B, H, T],
    slots, weights [B, H, T, K]. The memory is a constant: gradients reach q through the keys."""
    mem_k, mem_v = jax.lax.stop_gradient(mem_k), jax.lax.stop_gradient(mem_v)
    _, slots = search(q, mem_k, mem_valid, scale, config)  # [B, H, T, K]
    valid = jax.vmap(lambda m, i: m[i])(mem_valid, slots)  # [B, H, T, K]
    out, weights, has_memory = attend(q, mem_k, mem_v, slots, valid, scale, config)
    return out, has_memory, slots, weights


# ----------------------------------------------------------------------------- Sec. 3.1: the ring buffer
def write_memory(mem, new, pos, axis):
    """FIFO ring buffer append: row b writes new[b] at slot pos[b] along `axis` (counted after B).
    M and pos are multiples of T, so a write never wraps around."""
    write = lambda m, n, p: jax.lax.dynamic_update_slice_in_dim(m, n.astype(m.dtype), p, axis=axis)
    return jax.vmap(write)(mem, new, pos)


def clear_rows(mem, reset):
    """Zeros in the rows b of mem [B, ...] where reset[b], in place, one reset row at a time: a
    step where no row starts a document writes nothing, where a select would rewrite all M slots."""
    order = jnp.argsort(~reset)  # [B]: the reset rows first
    zeros = jnp.zeros((1,) + mem.shape[1:], mem.dtype)
    clear = lambda i, m: jax.lax.dynamic_update_slice_in_dim(m, zeros, order[i], axis=0)
    return jax.lax.fori_loop(0, jnp.sum(reset), clear, mem)


def commit_memory(state, reset):
    """Clear the rows that start a document (Ethics section: zeros, not only invalid flags) and
    append the pending segment to the others. Returns (mem_k, mem_v, mem_valid, mem_pos).
    Sec. 3.1 retrieves, then appends; the append waits for the next call, which searches the
    same memory, so that XLA writes the memory in place (README, deviation 5)."""
    keep = ~reset.astype(bool)  # [B]
    ok, kept = state.pending_valid & keep[:, None], keep[:, None, None, None, None]  # [B, T], [B, 1, 1, 1, 1]
    mem_k = write_memory(clear_rows(state.mem_k, ~keep), jnp.where(kept, state.pending_k, 0), state.mem_pos, 2)
    mem_v = write_memory(clear_rows(state.mem_v, ~keep), jnp.where(kept, state.pending_v, 0), state.mem_pos, 2)
    mem_valid = write_memory(state.mem_valid, ok, state.mem_pos, 0) & keep[:, None]  # [B, M]
    advanced = (state.mem_pos + ok.shape[1] * jnp.any(ok, axis=1)) % max(mem_valid.shape[1], 1)  # [B]
    return mem_k, mem_v, mem_valid, jnp.where(keep, advanced, 0).astype(jnp.int32)


# ----------------------------------------------------------------------------- the model
class Ops(NamedTuple):
    """The pieces forward computes with; kernels.FAST has drop-ins of the same signatures."""
    local_attention: Callable
    memory_search: Callable
    attend_to_retrieved: Callable


PLAIN = Ops(local_attention, memory_search, attend_to_retrieved)


def forward(params, state, tokens, reset, config, mask=None, return_retrievals=False, ops=PLAIN):
    """One segment of every row: tokens int [B, T]; reset bool [B] (the row starts a document);
    mask bool [B, T], False on padding, which never enters the memory or the cache as valid.
    Returns (logits [B, T, V] float32, new state), and with return_retrievals also a list, per
    memory layer, of {"slots", "weights"} [B, H, T, K]."""
    c, (B, T), E, H, D, dt = config, tokens.shape, config.d_model, config.num_heads, config.head_dim, config.dtype
    check(T == c.segment_length, f"tokens have {T} positions but segment_length is {c.segment_length}.")
    if not isinstance(tokens, jax.core.Tracer):  # under jit the training loop checks each batch
        check_tokens(tokens, c.vocab_size)
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)  # [B, T]
    keep = ~reset.astype(bool)  # [B]: a document start clears the row's cache and memory
    cache_valid = state.cache_valid & keep[:, None]  # [B, C]
    mem_k, mem_v, mem_valid, mem_pos = commit_memory(state, reset) if c.active_memory_layers else (
        state.mem_k, state.mem_v, state.mem_valid, state.mem_pos)
    key_valid = jnp.concatenate([cache_valid, mask], axis=1)  # [B, S]
    # The residual stream as a matrix, a row a token: each weight's gradient is one plain matmul.
    x = params["embed"][tokens.reshape(B * T)].astype(dt)  # [N, E], N = B * T
    heads = lambda y: jnp.swapaxes(y.reshape(B, T, H, D), 1, 2)  # [N, HD] -> [B, H, T, D]
    new_k, new_v, pending_k, pending_v, retrievals = [], [], [], [], []
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])  # [N, E]
        w_qkv = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).reshape(E, -1).astype(dt)  # [E, 3HD]: one matmul
        q, k, v = (heads(y) for y in jnp.split(h @ w_qkv, 3, axis=1))  # [B, H, T, D] each
        q, k = l2_normalize(q), l2_normalize(k)
        # Transformer-XL: the previous segment's keys and values first, constants (no gradient).
        ks, vs = (jnp.concatenate([jax.lax.stop_gradient(cache[:, i]).astype(dt), x], axis=2)  # [B, H, S, D]
                  for cache, x in ((state.cache_k, k), (state.cache_v, v)))
        out = ops.local_attention(q, ks, vs, key_valid, p["rel_bias"], p["qk_scale"], c)  # [B, H, T, D]
        if i in c.active_memory_layers:
            j = c.active_memory_layers.index(i)
            mem_out, has_memory, slots, weights = knn_attention(
                q, mem_k[:, j], mem_v[:, j], mem_valid, p["qk_scale"], c, ops.memory_search, ops.attend_to_retrieved)
            # Eqs. (1)-(2): V_a = V_m * g + V_c * (1 - g), g = sigmoid(b_g) per head. A query with
            # no valid memory (its document's first segment) keeps its local result.
            g = (has_memory * jax.nn.sigmoid(p["gate_bias"])[None, :, None])[..., None]  # [B, H, T, 1]
            out = (mem_out * g + out * (1 - g)).astype(dt)  # [B, H, T, D]
            pending_k.append(jax.lax.stop_gradient(k))  # to the memory at the next call (commit_memory)
            pending_v.append(jax.lax.stop_gradient(v))
            retrievals.append({"slots": slots, "weights": weights})
        x = x + jnp.einsum("bhtd,hde->bte", out, p["wo"].astype(dt)).reshape(B * T, E)  # [N, E]
        x = x + jax.nn.gelu(rms_norm(x, p["ffn_norm"]) @ p["w1"].astype(dt)) @ p["w2"].astype(dt)  # [N, E]
        new_k.append(jax.lax.stop_gradient(k))
        new_v.append(jax.lax.stop_gradient(v))

    logits = jnp.einsum("ne,ev->nv", rms_norm(x, params["final_norm"]), params["w_out"].astype(dt),
                        preferred_element_type=jnp.float32, precision=precision(c)).reshape(B, T, -1)  # [B, T, V]
    stack = lambda xs, like: jnp.stack(xs, axis=1).astype(like.dtype)  # [B, L or Lm, H, T, D]
    # This segment's keys and values: the next segment's XL cache, and the memory's next append.
    cache = (stack(new_k, state.cache_k), stack(new_v, state.cache_v), mask) if c.xl_cache else state[:3]
    pending = (stack(pending_k, mem_k), stack(pending_v, mem_v), mask) if c.active_memory_layers else state[7:]
    new_state = State(*cache, mem_k, mem_v, mem_valid, mem_pos, *pending)
    return (logits, new_state, retrievals) if return_retrievals else (logits, new_state)


def check_tokens(tokens, vocab_size):
    """A clear error for token ids outside [0, vocab_size): never clipped silently."""
    bad = np.asarray(tokens)[(np.asarray(tokens) < 0) | (np.asarray(tokens) >= vocab_size)]
    check(not bad.size, f"token id {int(bad[0]) if bad.size else 0} is out of range for vocab_size {vocab_size}.")


def cross_entropy(logits, targets):
    """Per-token cross-entropy in nats: [B, T, V], [B, T] -> [B, T]."""
    logits = logits.astype(jnp.float32)
    target_logit = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype) * logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def loss(logits, targets, mask):
    """Mean cross-entropy over the unmasked tokens."""
    m = mask.astype(jnp.float32)
    return jnp.sum(cross_entropy(logits, targets) * m) / jnp.maximum(jnp.sum(m), 1.0)


def memory_off(params):
    """The memory-off ablation: the same weights with every gate forced to 0 (local attention only)."""
    layers = [dict(p, gate_bias=jnp.full_like(p["gate_bias"], -1e9)) if "gate_bias" in p else p
              for p in params["layers"]]
    return dict(params, layers=layers)

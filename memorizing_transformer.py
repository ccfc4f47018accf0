"""Memorizing Transformers (Wu, Rabe, Hutchins, Szegedy; ICLR 2022) in plain JAX.

The whole model in one file, in the order of the paper:
  Sec. 3      a decoder-only transformer with a Transformer-XL cache, a sliding-window
              causal mask and the T5 relative position bias;
  Sec. 3.2    normalized queries and keys with a learned per-head scale;
  Sec. 3.1    the kNN-augmented attention layer: top-k retrieval from an external
              memory, a FIFO ring buffer of the last M (key, value) pairs per batch
              row and head, mixed with local attention by a per-head gate;
  Sec. 3.3    an approximate top-k.

Everything is a pure function over pytrees:
  params = init_params(config, rng)
  state = init_state(config, batch_size)
  logits, state = forward(params, state, tokens, reset, config)

Axes: B batch rows, T segment length, C cache length (T with the XL cache, else 0),
S = C + T local keys, H heads, D head dim, M memory size, K neighbours, L layers,
V vocab, E d_model, F d_ff.
"""
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # finite "minus infinity": masked logits never produce NaN gradients
# memory_search: the most bytes of bin winners a block of batch rows keeps, by backend
# (absent: all rows at once)
WINNERS_BYTES = {"cpu": 2 ** 21}
# memory_search: the backends that lay the scores out slots first (absent: queries first)
SLOTS_FIRST = {"cpu": True, "gpu": True}


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
    exact_topk: bool = False  # True: lax.top_k; False: binned approximate top-k (Sec. 3.3)
    topk_recall_target: float = 0.95  # sets the number of bins of the approximate top-k
    memory_chunk: int = 1024  # memory slots scored at once: scores never exceed [B, H, T, chunk]
    dtype: str = "float32"  # activations, matmuls and memory search scores; "bfloat16" for mixed precision
    memory_dtype: str = None  # storage of the memory and the XL cache; None: the same as dtype
    # local attention: "explicit" (einsums and a softmax, below) or "fused" (one call of
    # jax.nn.dot_product_attention: cuDNN's flash attention on a GPU with bfloat16)
    attention: str = "explicit"
    # init: T5 bias of the first layer's first H/2 heads at distance 1 (0 = none, as in the paper).
    # A previous-token head is half of a copy (induction) circuit; this prior speeds it up.
    init_prev_token_bias: float = 0.0
    init_gate_bias: float = 0.0  # Eq. (1)'s gate starts at sigmoid(init_gate_bias): 0.5, as in the paper
    # training (Sec. 4.2)
    batch_size: int = 256  # rows; a batch holds batch_size * segment_length tokens
    grad_accum: int = 1  # micro-batches per step (rows are split between them)
    steps: int = 500_000
    lr: float = 1.0
    warmup_steps: int = 1000
    seed: int = 0

    def __post_init__(self):
        positive = ["vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "d_ff",
                    "segment_length", "num_neighbors", "num_buckets", "max_distance",
                    "memory_chunk", "batch_size", "grad_accum", "steps"]
        for name in positive:
            if not (isinstance(getattr(self, name), int) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.max_distance <= self.num_buckets // 2:
            raise ValueError(f"max_distance ({self.max_distance}) must exceed num_buckets // 2 "
                             f"({self.num_buckets // 2}), where the T5 log-spaced buckets begin.")
        if self.memory_size < 0:
            raise ValueError(f"memory_size must be >= 0 (0 = no memory), got {self.memory_size}.")
        if self.memory_size % self.segment_length:
            raise ValueError(f"memory_size ({self.memory_size}) must be a multiple of "
                             f"segment_length ({self.segment_length}).")
        if self.memory_size and self.num_neighbors > self.memory_size:
            raise ValueError(f"num_neighbors ({self.num_neighbors}) must be <= memory_size "
                             f"({self.memory_size}).")
        if not isinstance(self.memory_layers, tuple):
            object.__setattr__(self, "memory_layers", tuple(self.memory_layers))
        for layer in self.memory_layers:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"memory layer index {layer} is out of range for {self.num_layers} "
                                 f"layer{'' if self.num_layers == 1 else 's'} (0-based).")
        if len(set(self.memory_layers)) != len(self.memory_layers):
            raise ValueError(f"memory_layers has a repeated index: {self.memory_layers}.")
        if self.memory_size and not self.memory_layers:
            raise ValueError(f"memory_size is {self.memory_size} but memory_layers names no layer; "
                             f"for no memory, set memory_size to 0.")
        if self.num_heads * self.head_dim != self.d_model:
            raise ValueError(f"num_heads * head_dim ({self.num_heads} * {self.head_dim}) must equal "
                             f"d_model ({self.d_model}).")
        if not 0.0 < self.topk_recall_target < 1.0:
            raise ValueError(f"topk_recall_target must be in (0, 1), got {self.topk_recall_target}.")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}.")
        if self.memory_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"memory_dtype must be 'float32', 'bfloat16' or None (as dtype), "
                             f"got {self.memory_dtype!r}.")
        if self.attention not in ("explicit", "fused"):
            raise ValueError(f"attention must be 'explicit' or 'fused', got {self.attention!r}.")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by grad_accum "
                             f"({self.grad_accum}).")
        if not (math.isfinite(self.lr) and self.lr > 0) or self.warmup_steps < 0:
            raise ValueError(f"lr must be a finite number > 0 and warmup_steps >= 0, got {self.lr} and "
                             f"{self.warmup_steps}.")
        for name in ("init_prev_token_bias", "init_gate_bias"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}.")

    @property
    def active_memory_layers(self):
        """The kNN-augmented layers; none when memory_size is 0."""
        return tuple(sorted(self.memory_layers)) if self.memory_size else ()

    @property
    def storage_dtype(self):
        """What the memory and the XL cache are stored in."""
        return self.memory_dtype or self.dtype

    @property
    def cache_length(self):
        return self.segment_length if self.xl_cache else 0

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


PRESETS = {
    # Sec. 4.2: 12 layers, d_model 1024, 8 heads of 128, FFN 4096, 32K vocab, T = 512, XL cache,
    # memory in the 9th layer, M = 8192, k = 32; 2^17 tokens a batch = 256 rows of 512.
    # 8 micro-batches of 32 rows on one accelerator. The memory is searched 8192 slots at a
    # time (2 GiB of bf16 scores at batch 32): on an H200, in whole bins, the 65K train step
    # 7.4 ms faster than with 1024, 9 ms in whole rows; 8K within 1% (JOURNAL.md, "On a GPU").
    "paper": Config(grad_accum=8, memory_chunk=8192),
    # One GPU, a few minutes.
    "small": Config(vocab_size=8192, d_model=512, num_layers=8, num_heads=8, head_dim=64, d_ff=2048,
                    segment_length=512, memory_layers=(5,), memory_size=2048, batch_size=32,
                    steps=5000, warmup_steps=500),
    # A 2-core CPU: visibly learns within ten minutes.
    "tiny": Config(vocab_size=2048, d_model=128, num_layers=4, num_heads=4, head_dim=32, d_ff=512,
                   segment_length=128, memory_layers=(2,), memory_size=512, num_neighbors=32,
                   batch_size=8, steps=1200, warmup_steps=100),
    # The synthetic recipe (README, "Synthetic"): two layers, so the copy circuit's second half
    # can only live in the memory layer; a previous-token prior; a lower rate, at which the
    # weights do not memorize a document's bindings while it streams past.
    "synthetic": Config(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, head_dim=32, d_ff=512,
                        segment_length=128, memory_layers=(1,), memory_size=512, num_neighbors=32,
                        batch_size=8, steps=2000, warmup_steps=100, lr=0.3, init_prev_token_bias=6.0),
}


class State(NamedTuple):
    """Everything carried from one segment to the next; every leaf is batch-leading."""
    cache_k: jax.Array  # [B, L, H, C, D] the previous segment's keys (Transformer-XL)
    cache_v: jax.Array  # [B, L, H, C, D]
    cache_valid: jax.Array  # [B, C] bool: False for padding and before a document start
    mem_k: jax.Array  # [B, Lm, H, M, D] external memory (Sec. 3.1), a ring buffer
    mem_v: jax.Array  # [B, Lm, H, M, D]
    mem_valid: jax.Array  # [B, M] bool: slot holds a key of the current document
    mem_pos: jax.Array  # [B] int32: next slot to write
    pending_k: jax.Array  # [B, Lm, H, T, D] the last segment's keys, appended at the next call
    pending_v: jax.Array  # [B, Lm, H, T, D]
    pending_valid: jax.Array  # [B, T] bool


@functools.partial(jax.jit, static_argnums=(0, 1))  # one program makes every buffer, on the device
def init_state(config, batch_size):
    c, m = config, config.memory_size
    dt = jnp.dtype(c.storage_dtype)
    n_mem = len(c.active_memory_layers)
    C, H, D = c.cache_length, c.num_heads, c.head_dim
    return State(
        cache_k=jnp.zeros((batch_size, c.num_layers, H, C, D), dt),
        cache_v=jnp.zeros((batch_size, c.num_layers, H, C, D), dt),
        cache_valid=jnp.zeros((batch_size, C), bool),
        mem_k=jnp.zeros((batch_size, n_mem, H, m if n_mem else 0, D), dt),
        mem_v=jnp.zeros((batch_size, n_mem, H, m if n_mem else 0, D), dt),
        mem_valid=jnp.zeros((batch_size, m if n_mem else 0), bool),
        mem_pos=jnp.zeros((batch_size,), jnp.int32),
        pending_k=jnp.zeros((batch_size, n_mem, H, c.segment_length if n_mem else 0, D), dt),
        pending_v=jnp.zeros((batch_size, n_mem, H, c.segment_length if n_mem else 0, D), dt),
        pending_valid=jnp.zeros((batch_size, c.segment_length if n_mem else 0), bool),
    )


# ----------------------------------------------------------------------------- params
def init_params(config, rng):
    """Nested dicts of float32 arrays. Initialization is documented in the README."""
    c = config
    E, H, D, F = c.d_model, c.num_heads, c.head_dim, c.d_ff
    keys = iter(jax.random.split(rng, 2 + 6 * c.num_layers))

    def normal(shape, std):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    layers = []
    prior = np.zeros((c.num_buckets, H), np.float32)
    prior[1, :H // 2] = c.init_prev_token_bias  # bucket 1 = distance 1
    for i in range(c.num_layers):
        layer = {
            "attn_norm": np.ones(E, np.float32),
            "wq": normal((E, H, D), E ** -0.5),
            "wk": normal((E, H, D), E ** -0.5),
            "wv": normal((E, H, D), E ** -0.5),
            "wo": normal((H, D, E), (H * D * 2 * c.num_layers) ** -0.5),
            # Sec. 3.2: q and k are unit vectors, so q.k has spread 1/sqrt(D); a scale of
            # sqrt(D) gives the initial logits unit spread.
            "qk_scale": np.full(H, math.sqrt(D), np.float32),
            "rel_bias": prior if i == 0 else np.zeros((c.num_buckets, H), np.float32),  # T5 bias, one table a layer
            "ffn_norm": np.ones(E, np.float32),
            "w1": normal((E, F), E ** -0.5),
            "w2": normal((F, E), (F * 2 * c.num_layers) ** -0.5),
        }
        if i in c.active_memory_layers:
            layer["gate_bias"] = np.full(H, c.init_gate_bias, np.float32)  # Eq. (1): g = sigmoid(0) = 0.5 by default
        layers.append(layer)
    return jax.tree.map(jnp.asarray, {  # the constants above are numpy: no program to compile
        "embed": normal((c.vocab_size, E), 1.0),
        "layers": layers,
        "final_norm": np.ones(E, np.float32),
        "w_out": normal((E, c.vocab_size), E ** -0.5),
    })


# ----------------------------------------------------------------------------- pieces
def rms_norm(x, w):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * w[None, None, :]).astype(x.dtype)  # [B, T, E]


def l2_normalize(x):
    """Sec. 3.2: queries and keys become unit vectors along D."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
    """T5's causal bucketing of relative_position = key_position - query_position (<= 0).

    Distances below num_buckets // 2 get a bucket each; larger ones share log-spaced
    buckets up to max_distance, after which everything is bucket num_buckets - 1.
    Positions are static, so this is numpy: the buckets are a constant of the compiled step.
    """
    n = np.maximum(-np.asarray(relative_position), 0)  # distance into the past, >= 0
    max_exact = num_buckets // 2
    log_ratio = np.log(np.maximum(n, 1).astype(np.float32) / max_exact)
    large = max_exact + (log_ratio / np.float32(math.log(max_distance / max_exact))
                         * (num_buckets - max_exact)).astype(np.int32)
    large = np.minimum(large, num_buckets - 1)
    return np.where(n < max_exact, n, large).astype(np.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast_rows(x, rows):
    """x repeated along a new leading axis of `rows`. Its gradient, the sum over that axis,
    is taken as a product with a vector of ones: XLA's CPU backend runs a sum over the
    leading axis alone 20-50x slower than that (jax.grad of a plain broadcast gives one)."""
    return jnp.broadcast_to(x, (rows,) + x.shape)


broadcast_rows.defvjp(lambda x, rows: (broadcast_rows(x, rows), None),
                      lambda rows, _, g: (jnp.einsum("b,b...->...", jnp.ones((rows,), g.dtype), g),))


def masked_softmax(logits, valid):
    """Softmax over the last axis restricted to `valid`; a row with nothing valid is all 0.

    Returns the weights and whether the row had anything valid (the last axis reduced)."""
    any_valid = jnp.any(valid, axis=-1, keepdims=True)
    weights = jax.nn.softmax(jnp.where(valid, logits.astype(jnp.float32), NEG_INF), axis=-1)
    return weights * any_valid, any_valid[..., 0]


def matmul_precision(config):
    """bfloat16 runs: matmuls with float32 outputs still take bf16 inputs, in the backward pass
    too (a float32 cotangent would otherwise make them float32, i.e. TF32-class, matmuls).
    float32 runs: the backend's default (see the README on GPUs)."""
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if config.dtype == "bfloat16" else None


def query_block(T):
    """Queries per block of the local attention: on a CPU half the segment, elsewhere a quarter
    (if T divides by that), else the whole segment (one block). Fewer, larger blocks score more
    keys a query (T + T/2 instead of T + T/4) in fewer, larger products: on a CPU the tiny
    preset's gradient is about 6% faster with two blocks than with four, and its forward pass
    no slower (JOURNAL.md, "The CPU step against the PyTorch peer"); a GPU was not measured."""
    n = 2 if jax.default_backend() == "cpu" else 4
    return T // n if T % n == 0 else T


def transpose_product(a, b, precision=None):
    """a^T b in float32: a [..., K, M], b [..., K, N] -> [..., M, N], contracting the leading axis
    of both. The backward pass of every product x @ w asks for one (x^T g).

    XLA's CPU backend runs such a product as a generic dot, 1.5-2x slower than the library
    matmul it uses when each operand is contracted along its rows ([M, K] x [K, N]). So on a
    CPU the smaller operand is transposed first, as a copy of its own (an optimization barrier
    keeps XLA from folding the transpose back into the product); when that is b, the product
    is (b^T a)^T, its result kept apart from the final transpose likewise. Elsewhere it is one
    product, as autodiff would write it.
    """
    apart = jax.lax.optimization_barrier if jax.default_backend() == "cpu" else (lambda x: x)
    swap = lambda x: jnp.swapaxes(x, -1, -2)
    product = functools.partial(jnp.matmul, preferred_element_type=jnp.float32, precision=precision)
    if a.size <= b.size:
        return product(apart(swap(a)), b)
    return swap(apart(product(apart(swap(b)), a)))


def _pad_rows(x, rows):
    """x [..., R, D] with `rows` rows of zeros in front: [..., rows + R, D]."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(rows, 0), (0, 0)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def product_qk(q, k, precision, constant_rows=0):
    """q k^T in float32: q [..., Q, D], k [..., W, D] -> [..., Q, W] (the local attention's
    logits), with a gradient whose k^T-side product is a transpose_product. The first
    constant_rows rows of k are constants: their gradient is 0, and it is not computed."""
    return jnp.einsum("...qd,...wd->...qw", q, k, preferred_element_type=jnp.float32, precision=precision)


def _product_qk_bwd(precision, constant_rows, saved, g):
    q, k = saved
    g = g.astype(q.dtype)
    dq = jnp.matmul(g, k, preferred_element_type=jnp.float32, precision=precision)  # [..., Q, D]
    dk = transpose_product(g[..., constant_rows:], q, precision)  # g^T q [..., W - constant_rows, D]
    return dq.astype(q.dtype), _pad_rows(dk, constant_rows).astype(k.dtype)


product_qk.defvjp(lambda q, k, precision, rows: (product_qk(q, k, precision, rows), (q, k)), _product_qk_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def product_pv(p, v, precision, constant_rows=0):
    """p v in float32: p [..., Q, W], v [..., W, D] -> [..., Q, D] (the local attention's
    weighted values), with a gradient whose p^T-side product is a transpose_product. The
    first constant_rows rows of v are constants: their gradient is 0, and it is not computed."""
    return jnp.matmul(p, v, preferred_element_type=jnp.float32, precision=precision)


def _product_pv_bwd(precision, constant_rows, saved, g):
    p, v = saved
    g = g.astype(v.dtype)
    dp = jnp.einsum("...qd,...wd->...qw", g, v, preferred_element_type=jnp.float32, precision=precision)
    dv = transpose_product(p[..., constant_rows:], g, precision)  # p^T g [..., W - constant_rows, D]
    return dp.astype(p.dtype), _pad_rows(dv, constant_rows).astype(v.dtype)


product_pv.defvjp(lambda p, v, precision, rows: (product_pv(p, v, precision, rows), (p, v)), _product_pv_bwd)


@jax.custom_vjp
def dense(x, w):
    """x @ w for x [N, E], w [E, F], with a weight gradient x^T g that is a transpose_product."""
    return x @ w


def _dense_bwd(saved, g):
    x, w = saved
    return g @ w.T, transpose_product(x, g).astype(w.dtype)


dense.defvjp(lambda x, w: (dense(x, w), (x, w)), _dense_bwd)


def window_and_buckets(dist, config):
    """For query-minus-key distances (numpy): whether the sliding window shows the key (the
    token itself and the previous segment_length), and the T5 bucket of the distance."""
    window = (dist >= 0) & (dist <= config.segment_length)
    return window, relative_position_bucket(-dist, config.num_buckets, config.max_distance)


def position_bias(rel_bias, buckets, one_hot=None):
    """The T5 bias of every (query, key) pair: rel_bias [num_buckets, H], buckets int [...]
    (numpy) -> [H, ...].

    On a CPU, a gather. Its gradient is a scatter-add of every pair into num_buckets slots
    per head, which a GPU does slowly (7.2 ms of a 74 ms step on an H100); there (one_hot
    None on a GPU, or True) the lookup is a product with the buckets' one-hot matrix, so
    that its gradient is a matmul. Both give the same values at full precision.
    """
    if one_hot is None:
        one_hot = jax.default_backend() == "gpu"
    if not one_hot:
        return jnp.moveaxis(rel_bias[buckets], -1, 0)
    hot = jax.nn.one_hot(buckets, rel_bias.shape[0], dtype=rel_bias.dtype)  # [..., num_buckets]
    return jnp.einsum("...n,nh->h...", hot, rel_bias, precision=jax.lax.Precision.HIGHEST)


def local_attention(q, k, v, key_valid, rel_bias, scale, config):
    """Sec. 3: causal self-attention over [XL cache; segment] with a sliding window and T5 bias.

    q: [B, H, T, D]; k, v: [B, H, S, D] with S = C + T, the cache first; key_valid: [B, S]
    (query t is valid iff key C + t is; a padding query gets 0). Query t sits at position
    C + t; key s is visible iff 0 <= (C + t) - s <= T, that is, each token sees itself and at
    most the previous segment_length tokens.

    A query sees at most T + 1 of the S keys, so the queries go in n blocks of Q, and each
    block meets only the W = T + Q keys its windows reach (W = S when that is fewer): with
    the XL cache, 192 scores a query instead of 256 in two blocks (a CPU), 160 in four.

    The cache is a constant: its keys and values get no gradient (forward() stops it too),
    and none is computed for the leading keys that every block takes from the cache (with
    the XL cache, Q of each block's W keys).
    """
    if config.attention == "fused":  # the same, in the fused call's layout [B, T, H, D]
        swap = lambda x: jnp.swapaxes(x, 1, 2)
        return swap(fused_local_attention(swap(q), swap(k), swap(v), key_valid, rel_bias, scale, config))
    B, H, T, D = q.shape
    S = k.shape[2]
    # The cache a constant (above); XLA folds the slices and the concatenation away.
    k, v = (jnp.concatenate([jax.lax.stop_gradient(x[:, :, :S - T]), x[:, :, S - T:]], axis=2) for x in (k, v))
    Q = query_block(T)
    n, W = T // Q, min(T + Q, S)
    q_pos = (S - T) + np.arange(T).reshape(n, Q)  # [n, Q]
    starts = np.clip(q_pos[:, -1] + 1 - W, 0, S - W)  # [n]: each block's first key
    k_pos = starts[:, None] + np.arange(W)  # [n, W]
    dist = q_pos[:, :, None] - k_pos[:, None, :]  # [n, Q, W]
    window, buckets = window_and_buckets(dist, config)  # [n, Q, W] each
    blocks = lambda x, axis: jnp.stack([jax.lax.slice_in_dim(x, s, s + W, axis=axis) for s in starts], axis=axis)
    valid = window[None] & blocks(key_valid, 1)[:, :, None, :]  # [B, n, Q, W]
    # The bias, and the mask as a bias: masked keys get NEG_INF, and so the softmax weight 0.
    bias = broadcast_rows(position_bias(rel_bias, buckets), B)  # [B, H, n, Q, W]
    bias = bias + jnp.where(valid, 0.0, NEG_INF)[:, None]  # [B, H, n, Q, W]
    qs = (q * scale.astype(q.dtype)[None, :, None, None]).reshape(B, H, n, Q, D)  # the per-head scale on the queries
    kb, vb = blocks(k, 2), blocks(v, 2)  # [B, H, n, W, D]
    cached = int(np.clip(S - T - starts, 0, W).min())  # leading keys of every block that are the cache's
    precision = matmul_precision(config)
    logits = product_qk(qs, kb, precision, cached) + bias  # [B, H, n, Q, W]
    # softmax(logits) @ v, normalized after the product: the division is then over [.., D],
    # not over [.., W]. The max only keeps exp() in range; it cancels, so it needs no gradient.
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))  # [B, H, n, Q, W]
    out = product_pv(e.astype(v.dtype), vb, precision, cached)  # [B, H, n, Q, D]
    # A padding query gets 0. Every other query sees at least its own key.
    q_valid = key_valid[:, S - T:].reshape(B, 1, n, Q, 1)  # [B, 1, n, Q, 1]
    out = (out / jnp.sum(e, axis=-1, keepdims=True) * q_valid).astype(v.dtype)  # [B, H, n, Q, D]
    return out.reshape(B, H, T, D)


def fused_implementation(dtype, T, S, D):
    """cuDNN's fused attention where it applies (a GPU, bfloat16, even T and S, D a multiple of
    8 up to 128: the shapes its kernel takes with a bias in training), else JAX's XLA version
    of the same call: the same math, which is how the tests hold it equal to the explicit one."""
    cudnn = jax.default_backend() == "gpu" and dtype == jnp.bfloat16 and T % 2 == 0 and S % 2 == 0 and \
        D % 8 == 0 and D <= 128
    return "cudnn" if cudnn else "xla"


def fused_local_attention(q, k, v, key_valid, rel_bias, scale, config):
    """local_attention as one call of jax.nn.dot_product_attention (config.attention "fused"),
    in that call's layout: q [B, T, H, D]; k, v [B, S, H, D] (the cache first) -> [B, T, H, D].

    The call's own masks are per row only as key lengths: key s < length[b] is valid. So the
    keys go in as [segment; cache], and length = T + the cache's valid count. That is exact
    when each row's valid keys are a prefix of the segment and a prefix of the cache, as
    data.py makes them (padding only at a segment's end; forward() checks it): a valid query
    sees only earlier keys of its segment, all valid, and the cache's first valid ones.
    The window and the T5 bias are then one bias [1, H, T, S] for all rows (its gradient
    reaches the bias table), not a [B, H, T, S] bias built from a mask. A padding query gets
    0, as in local_attention. The kernel keeps no [B, H, T, S] probabilities for the
    backward pass, but it scores all S keys, not only the T + 1 of each window. On cuDNN the
    bias is bfloat16, like the logits it meets.
    """
    B, T, H, D = q.shape
    S = k.shape[1]
    C = S - T
    order = np.concatenate([np.arange(C, S), np.arange(C)])  # positions of [segment; cache]
    # slices: no scatter in the gradient; the cache a constant, as in local_attention
    k, v = (jnp.concatenate([x[:, C:], jax.lax.stop_gradient(x[:, :C])], axis=1) for x in (k, v))
    dist = (C + np.arange(T))[:, None] - order[None, :]  # [T, S]: query minus key position
    window, buckets = window_and_buckets(dist, config)  # [T, S] each
    impl = fused_implementation(q.dtype, T, S, D)
    dt = q.dtype if impl == "cudnn" else jnp.float32
    hidden = -2.0 ** 41 if impl == "cudnn" else NEG_INF  # the value JAX's cuDNN path masks bfloat16 with
    bias = jnp.where(window, position_bias(rel_bias, buckets).astype(dt), jnp.asarray(hidden, dt))[None]  # [1, H, T, S]
    lengths = (T + jnp.sum(key_valid[:, :C], axis=1)).astype(jnp.int32)  # [B]
    qs = q * scale.astype(q.dtype)[None, None, :, None]  # the per-head scale on the queries
    out = jax.nn.dot_product_attention(qs, k, v, bias=bias, key_value_seq_lengths=lengths, scale=1.0,
                                       implementation=impl)  # [B, T, H, D]
    return out * key_valid[:, C:, None, None].astype(out.dtype)


def check_prefix_mask(mask):
    """The fused local attention's condition: each row's True entries come first (padding only
    at the end of a segment). Raises ValueError otherwise."""
    m = np.asarray(mask, bool)
    if np.any(m[..., 1:] & ~m[..., :-1]):
        raise ValueError("the fused attention takes padding only at the end of a segment, but the mask has "
                         "a valid position after a padded one; use --attention explicit for such masks.")


# ----------------------------------------------------------------------------- top-k (Sec. 3.3)
def num_topk_bins(k, memory_size, recall_target):
    """Bins for the approximate top-k: the fewest bins L with expected recall >= target.

    Only a bin's best entry survives. With the true top-k spread uniformly over L bins,
    the r-th best survives iff none of the r-1 better ones shares its bin, so the
    expected recall is (1/k) * sum_r (1 - 1/L)^(r-1) = (L/k) * (1 - (1 - 1/L)^k),
    about 1 - (k-1)/(2L). L is the smallest power of two that is at least k (each bin gives
    one winner) and meets the target; at most M.
    """
    L = 1
    while L < memory_size and (L < k or (L / k) * (1 - (1 - 1 / L) ** k) < recall_target):
        L *= 2
    return min(L, memory_size)


def bin_layout(k, memory_size, recall_target):
    """The binned search's layout: (L, rows), the memory seen as `rows` rows of L bins (slot
    s = row * L + bin). Bins of `rows` slots, the largest power of two that divides M and
    leaves at least num_topk_bins bins; so L = num_topk_bins where M is a power of two, and
    more bins where it is not (M = 768: one row of 768)."""
    bins, rows = num_topk_bins(k, memory_size, recall_target), 1
    while memory_size % (2 * rows) == 0 and 2 * rows <= memory_size // bins:
        rows *= 2
    return memory_size // rows, rows


def _largest_divisor_at_most(n, cap):
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _pack(scores, row, bits):
    """Scores as int32 keys that sort like them, their low `bits` bits replaced by `row`.

    A float's bits, read as an int32 with the negative ones negated (sign bit cleared), sort
    like the float. So one integer max finds a bin's best entry and carries its row: no
    argmax pass. Float32 values lose `bits` low mantissa bits (7 of 23 for 128 rows; ranking
    is unchanged beyond ~1e-5 relative); bfloat16 scores lose nothing, as their low 16 bits
    are 0 once widened to float32.
    """
    raw = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    key = jnp.where(raw < 0, -(raw & 0x7FFFFFFF), raw)  # monotone in the float value
    low = (1 << bits) - 1
    return (key & ~low) | row


def _unpack(key, bits):
    """_pack's inverse: keys -> (the scores, truncated), rows."""
    low = (1 << bits) - 1
    value = key & ~low
    value = jnp.where(value < 0, -value | jnp.iinfo(jnp.int32).min, value)
    return jax.lax.bitcast_convert_type(value, jnp.float32), key & low


def _bin_keys(best):
    """The bins' winners' packed keys [..., L] -> the keys the top-k ranks: the low log2(L)
    bits replaced by the bin, reversed, so that of equal scores the lower bin wins (as in
    lax.top_k). A row's keys are then distinct and each names its bin (_key_bin)."""
    low = (1 << (best.shape[-1] - 1).bit_length()) - 1
    return (best & ~low) | (low - jax.lax.broadcasted_iota(jnp.int32, best.shape, best.ndim - 1))


def _key_bin(key, L):
    """The bin a _bin_keys key names."""
    low = (1 << (L - 1).bit_length()) - 1
    return low - (key & low)


def _key_floats(key):
    """_pack's keys of floats below 2^127 in magnitude -> float32 numbers in the same order,
    one for one: the floats whose keys they are, after the keys are moved 2^23 away from 0 so
    that no float is subnormal or zero (a backend may flush those to zero, which would tie
    them). Larger floats' keys move past the largest float, to NaN, which only a sort in
    IEEE total order still ranks; no score is near: a score is at most its head's scale in
    magnitude, or NEG_INF. _float_keys inverts it."""
    return _unpack(key + jnp.where(key >= 0, 1 << 23, -(1 << 23)), 0)[0]


def _float_keys(x):
    """_key_floats' inverse."""
    moved = _pack(x, 0, 0)
    return moved - jnp.where(moved > 0, 1 << 23, -(1 << 23))


def _max_by_halves(x):
    """The maximum over the last axis, [..., L] -> [..., 1], as a tree of elementwise maxima
    of halves (an odd middle entry waits for the next level)."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        h = n // 2
        y = jnp.maximum(x[..., :h], x[..., n - h:])
        x = y if n % 2 == 0 else jnp.concatenate([y, x[..., h:h + 1]], axis=-1)
    return x


def top_k_in_passes(x, k, block=2 ** 20):
    """jax.lax.top_k(x, k)[0] for integer x whose entries in each row are distinct: the k
    largest, largest first, in k passes over the last axis, each taking the largest entry
    below the one the pass before took. The entries being distinct, a value says which entry
    it was (memory_search puts each entry's position in its low bits), and no pass writes.

    On the 2-core CPU this project is measured on, XLA's top-k runs on one core: 22 ms for
    `tiny`'s 4096 rows of 512 bins' winners, a quarter of the 8K train step then. These
    passes take about 5 ms there (11-13 ms when each pass also searched for its maximum's
    position and masked it). Each maximum is a tree of elementwise maxima: as a reduce, it
    was slower. The passes are a loop, not unrolled: XLA fused the elementwise work that
    makes x (memory_search's packing of the scores) into each unrolled pass, 32 times over
    (the search at M = 512 took 48 ms instead of 7). The rows go in blocks of at most `block`
    entries, which take their k passes while they are in the cache.
    """
    *lead, L = x.shape
    if k > L:
        raise ValueError(f"k ({k}) exceeds the {L} entries of a row.")
    rows = x.size // L
    nb = -(-rows // max(1, block // L))  # blocks
    n = -(-rows // nb)  # rows a block; the last block is padded with rows of zeros
    lowest = jnp.iinfo(x.dtype).min

    def passes(xb):  # [n, L] -> [n, k]
        def next_largest(last, _):  # the entries are distinct: those left are those below the last taken
            m = _max_by_halves(jnp.where(xb < last, xb, lowest))  # [n, 1]
            return m, m

        first = _max_by_halves(xb)  # [n, 1]
        _, rest = jax.lax.scan(next_largest, first, None, length=k - 1)  # [k - 1, n, 1]
        return jnp.concatenate([first, jnp.moveaxis(rest[..., 0], 0, 1)], -1)

    xr = jnp.pad(x.reshape(rows, L), ((0, nb * n - rows), (0, 0)))  # [nb * n, L]
    top = jax.lax.map(passes, xr.reshape(nb, n, L))  # [nb, n, k]
    return top.reshape(nb * n, k)[:rows].reshape(*lead, k)


def top_k(keys, k, passes=None):
    """The k largest of each row's distinct int32 keys (_pack's, of scores below 2^127), largest
    first: by top_k_in_passes, or by lax.top_k of the keys as floats in the same order
    (_key_floats; lax.top_k of int32 took 8x as long on a CPU). passes None: the passes on a
    CPU for k <= 128, where they were faster at every size measured (4096 rows, ms):

        L x k          512x32  1024x64  2048x128  8192x32
        passes            4.8     13.8      43.7     62.3
        lax.top_k        23.1     52.4     112.2     78.4
    """
    if passes is None:
        passes = jax.default_backend() == "cpu" and k <= 128
    if passes:
        return top_k_in_passes(keys, k)
    return _float_keys(jax.lax.top_k(_key_floats(keys), k)[0])


def memory_search(q, mem_k, mem_valid, scale, config, wide=True, batch_block=None, slots_first=None):
    """Top-k memory slots for every query, the memory scored a piece at a time: never more
    than [B, H, T, config.memory_chunk] scores at once.

    q: [B, H, T, D]; mem_k: [B, H, M, D]; mem_valid: [B, M] -> scores, slots: [B, H, T, K].
    Exact (config.exact_topk): each contiguous piece's top-k are candidates, and the top-k
    of all candidates is the answer. Binned (Sec. 3.3): slot s is in bin s mod L (row s // L), so
    slots written one after the other, whose keys resemble each other, never share a bin,
    and a memory holding n valid slots fills min(n, L) bins. Seen as [rows, L], the memory
    is scored in pieces of R rows by W bins; each bin's best packed key (_pack: score and row
    in one int32) so far is kept in a [B, H, T, L] array ([B, H, L, T]: slots_first, below),
    and the answer is the top-k of those L winners (top_k: on a CPU, in passes), ranked by
    their keys with the bin in the low log2(L) bits: float32 scores are ranked to 23 - log2(L)
    bits of their mantissa (14 for L = 512: scores within about 2^-14 of each other count as
    equal, and the lower bin comes first; fewer bits only where rows outnumber bins, M > L^2,
    and _pack took more), bfloat16 scores to all of theirs while rows and bins fit in their
    16 free bits. The scores returned are the packed ones (_pack). Invalid slots score
    NEG_INF. Not differentiable: retrieval only picks slots.

    wide: the pieces' shape, which decides the speed only (the tests hold both equal).
    True: whole rows (W = L, a few rows a piece), contiguous reads, and every piece reads
    and writes all L winners. False: whole bins (R = all rows, W bins a piece), W consecutive
    slots read from each row, copied out for the piece's matmul, and each bin's winner is
    final after one piece. True was as fast or faster on both backends measured: the search
    alone at `tiny`'s 65K on a CPU took about 0.8x the time of whole bins (XLA splits their
    reduction over 128 rows in two and stores the packed scores between); on an H200 the
    paper preset's train step (batch 32, bf16, pieces of 8192 slots) took 74.8 ms against
    75.6 at 8K and 89.5 against 91.1 at 65K (in pieces of 1024, whole bins spent 7.5 ms a
    step copying keys; JOURNAL.md, "On a GPU").

    batch_block: the binned search takes this many batch rows at a time (the largest divisor
    of B that is at most this), each block to its top-k before the next starts; the answer
    does not depend on it (the tests hold 1 and B equal). None: as many rows as keep the
    block's winners within the backend's WINNERS_BYTES. On a CPU 2 MiB (`tiny`: 2 of its 8
    rows), so that the winners, read and written by every piece, and each piece's scores stay
    in the caches (on the 2-core EPYC: the `tiny` train step 9 ms faster at 8K and 30-45 ms
    at 65K, about a quarter of the search's time); elsewhere all rows at once: on an H200,
    blocks of 16 or 8 of the paper preset's 32 rows made its 8K step 1.3-1.5 ms slower and
    left its peak memory as it was.

    slots_first: the binned search's scores laid out [.., slots, T] (True) or [.., T, slots]
    (False), which decides the speed only (the tests hold both equal). True: each piece's
    product reads the memory's keys as they are stored, [slots, D] contracted along D (the
    compiled CPU search copies no transposed piece of them), and the winners are [.., L, T]
    until the top-k. False: XLA's CPU backend copied every piece of the memory's keys to a
    transposed buffer before its product. None: the backend's SLOTS_FIRST. True on a CPU,
    where the `tiny` train step was 4.6 ms faster at 8K and 42 ms at 65K (the search alone
    1.3x and 1.6x as fast), and on a GPU, where on an H200 the paper preset's search alone
    took 4.62 ms against 5.20 at 8K and 16.86 against 18.93 at 65K (bf16, batch 32), and its
    8K train step 1.098 of the no-memory step against 1.134 (paired, one machine); False
    elsewhere (unmeasured).
    """
    B, H, M, D = mem_k.shape
    T, K = q.shape[2], config.num_neighbors
    # The scale inside the stop_gradient too: were the scores differentiable, JAX would
    # linearize the loop and hoist its loop-invariant parts (a [B, H, T, piece] fill and
    # iota) out of it, to be read back by every piece: 4x the scores' own traffic.
    qs = jax.lax.stop_gradient(q * scale.astype(q.dtype)[None, :, None, None])  # [B, H, T, D]

    def score(qs, keys, valid, slots_first=False):  # keys [B, H, *piece, D], valid [B, *piece]
        # -> [B, H, T, *piece] (slots_first: [B, H, *piece, T]). The scores are the largest
        # tensor of a step (T per slot): they stay in the queries' dtype, so bfloat16 halves
        # their traffic. Accumulation is float32 either way.
        keys = keys.astype(qs.dtype)
        if slots_first:
            s = jnp.einsum("bh...d,bhtd->bh...t", keys, qs, preferred_element_type=qs.dtype)
            return jnp.where(valid[:, None, ..., None], s, NEG_INF)
        s = jnp.einsum("bhtd,bh...d->bht...", qs, keys, preferred_element_type=qs.dtype)
        return jnp.where(valid[:, None, None], s, NEG_INF)

    if config.exact_topk:
        size = _largest_divisor_at_most(M, config.memory_chunk)
        def candidates(_, c):
            s = score(qs, jax.lax.dynamic_slice_in_dim(mem_k, c * size, size, axis=2),
                      jax.lax.dynamic_slice_in_dim(mem_valid, c * size, size, axis=1))  # [B, H, T, size]
            vals, idx = jax.lax.top_k(s, min(K, size))  # [B, H, T, K]
            return None, (vals, idx + c * size)
        _, (vals, idx) = jax.lax.scan(candidates, None, jnp.arange(M // size))  # [n, B, H, T, K]
        vals = jnp.moveaxis(vals, 0, 3).reshape(B, H, T, -1)  # [B, H, T, n * K]
        idx = jnp.moveaxis(idx, 0, 3).reshape(B, H, T, -1)  # [B, H, T, n * K]
        top, pos = jax.lax.top_k(vals, K)  # [B, H, T, K]
        return top, jnp.take_along_axis(idx, pos, axis=-1)

    L, rows = bin_layout(K, M, config.topk_recall_target)  # slot s = row * L + bin
    bits = rows.bit_length() - 1
    if wide:  # where a row is longer than a piece, a piece is part of one row
        W = _largest_divisor_at_most(L, config.memory_chunk)
        R = _largest_divisor_at_most(rows, config.memory_chunk // W)
    else:  # where a bin is taller than a piece, a piece is part of one bin
        R = _largest_divisor_at_most(rows, config.memory_chunk)
        W = _largest_divisor_at_most(L, config.memory_chunk // R)
    if batch_block is None:  # as many batch rows as keep their winners within the backend's budget
        budget = WINNERS_BYTES.get(jax.default_backend())
        batch_block = B if budget is None else max(1, budget // (H * T * L * 4))
    n = _largest_divisor_at_most(B, batch_block)
    if slots_first is None:
        slots_first = SLOTS_FIRST.get(jax.default_backend(), False)
    a = 2 if slots_first else 3  # the rows' axis of a piece's scores, and the bins' axis of the winners

    def search_rows(b):  # batch rows b .. b + n - 1
        qb = jax.lax.dynamic_slice_in_dim(qs, b, n)  # [n, H, T, D]

        def best_so_far(best, c):  # best: [n, H, T, L] ([n, H, L, T] slots first) each bin's best packed key so far
            r, w = (c % (rows // R)) * R, (c // (rows // R)) * W  # the piece's first row and bin
            s = score(qb, jax.lax.dynamic_slice(keys, (b, 0, r, w, 0), (n, H, R, W, D)),
                      jax.lax.dynamic_slice(valid, (b, r, w), (n, R, W)), slots_first)  # [n, H, T, R, W] (or R, W, T)
            new = jnp.max(_pack(s, r + jax.lax.broadcasted_iota(jnp.int32, s.shape, a), bits), axis=a)
            old = jax.lax.dynamic_slice_in_dim(best, w, W, axis=a)  # [n, H, T, W] or [n, H, W, T]
            return jax.lax.dynamic_update_slice_in_dim(best, jnp.maximum(old, new), w, axis=a), None

        start = jnp.full((n, H, L, T) if slots_first else (n, H, T, L), jnp.iinfo(jnp.int32).min, jnp.int32)
        best, _ = jax.lax.scan(best_so_far, start, jnp.arange(M // (R * W)))
        best = jnp.swapaxes(best, 2, 3) if slots_first else best  # [n, H, T, L]
        # Keys that name their bins: the top-k needs no pass for positions.
        pos = _key_bin(top_k(_bin_keys(best), K), L)  # [n, H, T, K] the winners' bins
        vals, row = _unpack(jnp.take_along_axis(best, pos, axis=-1), bits)  # [n, H, T, K]
        return vals, row * L + pos

    keys, valid = mem_k.reshape(B, H, rows, L, D), mem_valid.reshape(B, rows, L)
    if n == B:
        return search_rows(0)
    top, slots = jax.lax.map(search_rows, jnp.arange(0, B, n))  # [B // n, n, H, T, K] each
    return top.reshape(B, H, T, K), slots.reshape(B, H, T, K)


def attend_to_retrieved(q, mem_k, mem_v, slots, valid, scale, config, products, layout="bhtd"):
    """Softmax attention of each query over its K retrieved pairs: q [B, H, T, D] and slots,
    valid [B, H, T, K] -> out [B, H, T, D], weights [B, H, T, K], has_memory [B, H, T]; with
    layout "bthd", T before H in all of them (the fused attention's layout).

    The retrieved keys and values, [B, H, T, K, D] each, are K times the size of the queries
    (1 GiB each at the paper's shapes, bf16, batch 32). As einsums (products False) they are
    gathered into buffers and kept for the backward pass. As products (True) the same
    arithmetic, in float32, is written one retrieved pair at a time: K terms, each a product
    with one gathered row of the memory, which XLA fuses on a GPU with their gathers and
    their sum, so no [B, H, T, K, D] tensor is stored. Written as one product and a sum over
    the K axis, XLA on a GPU stored four such products in float32 (2 GiB each at the
    paper's shapes), each transposed to put the summed axis last, and read them back to sum
    them: the paper preset's 8K step took 0.0695-0.0698 s on an H200, against 0.0658-0.0663
    s as K terms (JOURNAL.md, "On a GPU").
    """
    if layout == "bthd":  # per (b, t): [H, M, D], [H, K] -> [H, K, D]
        take = jax.vmap(jax.vmap(lambda m, i: m[jnp.arange(m.shape[0])[:, None], i], in_axes=(None, 0)))
        head_scale = scale[None, None, :, None]  # [1, 1, H, 1]
    elif layout == "bhtd":  # per (b, h): [M, D], [T, K] -> [T, K, D]
        take = jax.vmap(jax.vmap(lambda m, i: m[i]))
        head_scale = scale[None, :, None, None]  # [1, H, 1, 1]
    else:
        raise ValueError(f"layout must be 'bhtd' or 'bthd', got {layout!r}.")
    keys = take(mem_k, slots).astype(q.dtype)  # [B, H, T, K, D] (bthd: [B, T, H, K, D])
    vals = take(mem_v, slots).astype(q.dtype)
    K = slots.shape[-1]
    f32 = lambda x: x.astype(jnp.float32)
    if products:  # one retrieved key at a time: [B, H, T, D] each -> [B, H, T, K]
        logits = jnp.stack([jnp.sum(f32(q) * f32(keys[..., k, :]), axis=-1) for k in range(K)], axis=-1)
    else:  # the einsum's letters name positions: the same for either layout
        logits = jnp.einsum("bhtd,bhtkd->bhtk", q, keys, preferred_element_type=jnp.float32,
                            precision=matmul_precision(config))  # [B, H, T, K]
    weights, has_memory = masked_softmax(logits * head_scale, valid)  # [B, H, T, K], [B, H, T]
    w = weights.astype(vals.dtype)  # [B, H, T, K]
    if products:  # one retrieved value at a time
        out = sum(f32(w[..., k, None]) * f32(vals[..., k, :]) for k in range(K)).astype(vals.dtype)  # [B, H, T, D]
    else:
        out = jnp.einsum("bhtk,bhtkd->bhtd", w, vals)  # [B, H, T, D]
    return out, weights, has_memory


def knn_attention(q, mem_k, mem_v, mem_valid, scale, config, products=None, layout="bhtd"):
    """Sec. 3.1: attend to the top-k retrieved (key, value) pairs; no position bias.

    q: [B, H, T, D]; mem_k, mem_v: [B, H, M, D]; mem_valid: [B, M].
    Returns out [B, H, T, D], has_memory [B, H, T] (False where no valid slot was found),
    slots [B, H, T, K] and weights [B, H, T, K]. With layout "bthd", q, out and has_memory
    have T before H (slots and weights do not). Gradients reach q through the K retrieved
    keys only; the memory itself is constant.

    products (attend_to_retrieved): None is True on a GPU, where the stored [B, H, T, K, D]
    keys and values were most of the memory's peak beyond its own storage, and False on a
    CPU, where the einsums are faster (the other form cost about a tenth of the step). Also
    False for K > 64: the products are K terms in the program, and its compile time grows
    with K (one layer's gradient on the CPU: 2 s at K = 32, 33 s at K = 512).
    """
    if products is None:
        products = jax.default_backend() == "gpu" and config.num_neighbors <= 64
    swap = (lambda x: jnp.swapaxes(x, 1, 2)) if layout == "bthd" else (lambda x: x)
    mem_k, mem_v = jax.lax.stop_gradient(mem_k), jax.lax.stop_gradient(mem_v)  # [B, H, M, D]
    _, slots = memory_search(swap(q), mem_k, mem_valid, scale, config)  # [B, H, T, K]
    ours = swap(slots)  # [B, H, T, K] (bthd: [B, T, H, K])
    valid = jax.vmap(lambda m, i: m[i])(mem_valid, ours)
    out, weights, has_memory = attend_to_retrieved(q, mem_k, mem_v, ours, valid, scale, config, products, layout)
    return out, has_memory, slots, swap(weights)


def write_memory(mem, new, pos, axis):
    """FIFO ring buffer append: row b writes new[b] at slot pos[b] along `axis`.

    mem: [B, ...] with M on `axis` (counted after B), new: the same with T, pos: [B].
    M and pos are multiples of T, so a write never wraps around.
    """
    def one_row(m, n, p):
        start = [0] * m.ndim
        start[axis] = p
        return jax.lax.dynamic_update_slice(m, n.astype(m.dtype), start)
    return jax.vmap(one_row)(mem, new, pos)


def clear_rows(mem, reset):
    """Zeros in the rows b of mem [B, ...] where reset[b], one row at a time, in place.

    Only the reset rows are written: a step where no row starts a document costs nothing,
    where a select of zeros over all rows would read and write the whole memory every step
    (5.7 ms of a 103 ms step on an H100 at M = 65536).
    """
    reset = reset.astype(bool)  # [B]
    order = jnp.argsort(~reset)  # [B]: the reset rows first
    zeros = jnp.zeros((1,) + mem.shape[1:], mem.dtype)
    clear = lambda i, m: jax.lax.dynamic_update_slice_in_dim(m, zeros, order[i], axis=0)
    return jax.lax.fori_loop(0, jnp.sum(reset), clear, mem)


def commit_memory(state, reset):
    """Clear the rows that start a new document, and append the pending segment (the last
    call's keys and values) to the others. Returns (mem_k, mem_v, mem_valid, mem_pos).

    Sec. 3.1 retrieves with a segment's queries and then appends its keys and values. Here
    the append is held back to the start of the next call: the memory that call searches
    is the same, and as the reads now depend on the write, XLA updates the memory in place
    instead of copying all M slots each step. A row advances only if it had something to
    append; a reset row drops its pending segment and starts empty at slot 0.

    Ethics section: a reset row's memory is cleared physically, zeros and not only invalid
    flags, so that nothing of the finished document stays in the state (nor in a checkpoint
    of it). clear_rows writes the reset rows only, so a step where no row resets pays nothing.
    """
    keep = ~reset.astype(bool)  # [B]
    ok = state.pending_valid & keep[:, None]  # [B, T]
    kept = keep[:, None, None, None, None]  # [B, 1, 1, 1, 1]
    # Zeros first (clear_rows), then the append (of zeros for a reset row), both in place.
    mem_k = write_memory(clear_rows(state.mem_k, reset), jnp.where(kept, state.pending_k, 0),
                         state.mem_pos, axis=2)  # [B, Lm, H, M, D]
    mem_v = write_memory(clear_rows(state.mem_v, reset), jnp.where(kept, state.pending_v, 0),
                         state.mem_pos, axis=2)  # [B, Lm, H, M, D]
    mem_valid = write_memory(state.mem_valid, ok, state.mem_pos, axis=0) & keep[:, None]  # [B, M]
    advanced = (state.mem_pos + ok.shape[1] * jnp.any(ok, axis=1)) % max(mem_valid.shape[1], 1)  # [B]
    return mem_k, mem_v, mem_valid, jnp.where(keep, advanced, 0).astype(jnp.int32)


# ----------------------------------------------------------------------------- the model
def forward(params, state, tokens, reset, config, mask=None, return_retrievals=False):
    """One segment of every row: tokens int [B, T], reset bool [B] (row starts a new document).

    mask: bool [B, T], False on padding (default: all True); padding never enters the
    memory or the cache as a valid entry. Returns (logits [B, T, V] float32, new_state), and
    with return_retrievals also a list, per memory layer, of dicts with the retrieved
    `slots` [B, H, T, K] and their attention `weights` [B, H, T, K].
    """
    c = config
    B, T = tokens.shape
    if T != c.segment_length:
        raise ValueError(f"tokens have {T} positions but segment_length is {c.segment_length}.")
    try:  # outside jit; under jit the training loop checks each batch on the host
        check_tokens(np.asarray(tokens), c.vocab_size)
        if c.attention == "fused" and mask is not None:
            check_prefix_mask(np.asarray(mask))
    except jax.errors.TracerArrayConversionError:
        pass
    dt = jnp.dtype(c.dtype)
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)  # [B, T]
    keep = ~reset.astype(bool)  # [B]
    # A document start clears the row's cache and memory: nothing crosses a document boundary.
    cache_valid = state.cache_valid & keep[:, None]  # [B, C]
    mem_k, mem_v, mem_valid, mem_pos = commit_memory(state, reset) if c.active_memory_layers else (
        state.mem_k, state.mem_v, state.mem_valid, state.mem_pos)
    key_valid = jnp.concatenate([cache_valid, mask], axis=1)  # [B, S]

    x = params["embed"][tokens].astype(dt)  # [B, T, E]
    new_k, new_v, pending_k, pending_v, retrievals = [], [], [], [], []
    # The layers' layout for q, k and v: [B, H, T, D], heads next to the batch axis as in the
    # memory and the XL cache (attention is a batch of [T, D] matrices); with the fused local
    # attention, [B, T, H, D], the layout of the q/k/v matmul and of the fused call, with no
    # transposes between them. bhtd converts both ways.
    fused = c.attention == "fused"
    bhtd = (lambda x: jnp.swapaxes(x, 1, 2)) if fused else (lambda x: x)
    time_axis = 1 if fused else 2
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])  # [B, T, E]
        # q, k and v by one matmul over [B * T, E] (and its gradient by one more).
        w_qkv = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).astype(dt)  # [E, 3H, D]
        qkv = (h.reshape(B * T, -1) @ w_qkv.reshape(w_qkv.shape[0], -1)).reshape(B, T, 3, c.num_heads, -1)
        q, k, v = (qkv[:, :, j] for j in range(3)) if fused else jnp.transpose(qkv, (2, 0, 3, 1, 4))
        q, k = l2_normalize(q), l2_normalize(k)  # [B, H, T, D] (fused: [B, T, H, D]) each
        scale = p["qk_scale"]  # [H]
        # Transformer-XL: prepend the previous segment's keys and values; no gradient into them.
        cache_k, cache_v = jax.lax.stop_gradient((state.cache_k[:, i], state.cache_v[:, i]))  # [B, H, C, D]
        ks = jnp.concatenate([bhtd(cache_k).astype(dt), k], axis=time_axis)  # [B, H, S, D] (fused: [B, S, H, D])
        vs = jnp.concatenate([bhtd(cache_v).astype(dt), v], axis=time_axis)
        if fused:
            out = fused_local_attention(q, ks, vs, key_valid, p["rel_bias"], scale, c)  # [B, T, H, D]
        else:
            out = local_attention(q, ks, vs, key_valid, p["rel_bias"], scale, c)  # [B, H, T, D]
        if i in c.active_memory_layers:
            j = c.active_memory_layers.index(i)
            mem_out, has_memory, slots, weights = knn_attention(  # in the layer's layout: q, out not transposed
                q, mem_k[:, j], mem_v[:, j], mem_valid, scale, c, layout="bthd" if fused else "bhtd")
            # Eqs. (1)-(2): V_a = V_m * g + V_c * (1 - g), g = sigmoid(b_g) per head. A query
            # with no valid memory (empty memory) keeps its local result.
            gate = jax.nn.sigmoid(p["gate_bias"])  # [H]
            gate = gate[None, None] if fused else gate[None, :, None]  # [1, 1, H] (fused) or [1, H, 1]
            g = (has_memory * gate)[..., None]  # [B, H, T, 1] (fused: [B, T, H, 1])
            out = (mem_out * g + out * (1 - g)).astype(dt)  # [B, H, T, D] (fused: [B, T, H, D])
            # This segment's keys and values go to the memory at the next call (commit_memory).
            pending_k.append(jax.lax.stop_gradient(bhtd(k)))  # [B, H, T, D]
            pending_v.append(jax.lax.stop_gradient(bhtd(v)))
            retrievals.append({"slots": slots, "weights": weights})
        x = x + jnp.einsum("bthd,hde->bte" if fused else "bhtd,hde->bte", out, p["wo"].astype(dt))  # [B, T, E]
        h = rms_norm(x, p["ffn_norm"]).reshape(B * T, -1)  # [B * T, E]
        # dense: the weight gradient of the widest input (a [B * T, F] GELU) as a plain matmul on a
        # CPU; the other matmuls' weight gradients were as fast as they are (JOURNAL.md).
        x = x + dense(jax.nn.gelu(h @ p["w1"].astype(dt)), p["w2"].astype(dt)).reshape(x.shape)  # [B, T, E]
        new_k.append(jax.lax.stop_gradient(bhtd(k)))  # [B, H, T, D]
        new_v.append(jax.lax.stop_gradient(bhtd(v)))

    logits = jnp.einsum("ne,ev->nv", rms_norm(x, params["final_norm"]).reshape(B * T, -1), params["w_out"].astype(dt),
                        preferred_element_type=jnp.float32, precision=matmul_precision(c)).reshape(B, T, -1)  # [B, T, V]
    cdt = state.cache_k.dtype
    if c.xl_cache:
        cache_k = jnp.stack(new_k, axis=1).astype(cdt)  # [B, L, H, T, D]
        cache_v = jnp.stack(new_v, axis=1).astype(cdt)
        cache_valid = mask
    else:
        cache_k, cache_v = state.cache_k, state.cache_v  # zero-length
    if c.active_memory_layers:
        pending = (jnp.stack(pending_k, axis=1).astype(mem_k.dtype),  # [B, Lm, H, T, D]
                   jnp.stack(pending_v, axis=1).astype(mem_v.dtype), mask)
    else:
        pending = (state.pending_k, state.pending_v, state.pending_valid)
    new_state = State(cache_k, cache_v, cache_valid, mem_k, mem_v, mem_valid, mem_pos, *pending)
    if return_retrievals:
        return logits, new_state, retrievals
    return logits, new_state


def check_tokens(tokens, vocab_size):
    """Raise a clear error for token ids outside [0, vocab_size); never clip silently."""
    t = np.asarray(tokens)
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        bad = t[(t < 0) | (t >= vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is out of range for vocab_size {vocab_size}.")


def cross_entropy(logits, targets):
    """Per-token cross-entropy in nats: [B, T, V], [B, T] -> [B, T]."""
    logits = logits.astype(jnp.float32)
    is_target = targets[..., None] == jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)


def loss(logits, targets, mask):
    """Mean cross-entropy over the unmasked tokens."""
    m = mask.astype(jnp.float32)
    return jnp.sum(cross_entropy(logits, targets) * m) / jnp.maximum(jnp.sum(m), 1.0)


def memory_off(params):
    """The memory-off ablation: the same weights with every gate forced to 0 (local only)."""
    layers = [dict(p, gate_bias=jnp.full_like(p["gate_bias"], -1e9)) if "gate_bias" in p else p
              for p in params["layers"]]
    return dict(params, layers=layers)

"""Memorizing Transformers (Wu, Rabe, Hutchins, Szegedy; ICLR 2022): the model, plain, in order.

  params = init_params(config, rng);  state = init_state(config, batch_size)
  logits, state = forward(params, state, tokens, reset, config)   # ops=kernels.FAST: faster
Axes: B rows, T segment, C cache (T or 0), S = C + T local keys, H heads, D head dim, M memory,
K neighbours, L layers (Lm with memory), V vocab, E d_model, F d_ff, N = B * T tokens."""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30  # a finite "minus infinity": masked logits never make NaN gradients


# ----------------------------------------------------------------------------- config
def knob(default, rule, help):
    """Declare a field of Config with its default, the rule its value meets, and its --help
    line. Each field becomes a train.py flag and a config.json entry by itself (cli.py and
    runs.py read these)."""
    return dataclasses.field(default=default, metadata={"rule": rule, "help": help})


def rule(ok, words, choices=None):
    """Make a knob's rule, which returns None where ok(value) holds, else why not."""
    check = lambda x: None if ok(x) else f"must be {words}, got {x!r}"
    check.choices = choices  # a flag with choices shows them
    return check


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x):
    real = isinstance(x, (int, float)) and not isinstance(x, bool)
    return real and math.isfinite(x)


positive = rule(lambda x: is_int(x) and x > 0, "a positive integer")
count = rule(lambda x: is_int(x) and x >= 0, "a non-negative integer")
finite = rule(is_number, "a finite number")
non_negative = rule(lambda x: is_number(x) and x >= 0, "a finite number >= 0")
rate = rule(lambda x: is_number(x) and 0 <= x < 1, "in [0, 1)")
fraction = rule(lambda x: is_number(x) and 0 < x < 1, "in (0, 1)")
switch = rule(lambda x: isinstance(x, bool), "true or false")
indices = rule(lambda x: isinstance(x, tuple) and all(map(is_int, x)), "layer indices")


def one_of(*allowed):
    return rule(lambda x: x in allowed, f"one of {allowed}", allowed)


@dataclasses.dataclass(frozen=True)
class Config:
    """Config holds the model's fields, whose defaults are Sec. 4.2's; presets.RunConfig adds
    training's."""

    vocab_size: int = knob(
        32768, positive, "SentencePiece vocabulary size V")
    d_model: int = knob(
        1024, positive, "model width E (= num heads x head dim)")
    num_layers: int = knob(
        12, positive, "transformer layers L")
    num_heads: int = knob(
        8, positive, "attention heads H")
    head_dim: int = knob(
        128, positive, "dimension D of each head")
    d_ff: int = knob(
        4096, positive, "hidden width F of the feed-forward blocks")
    segment_length: int = knob(
        512, positive, "tokens per segment T (also the XL cache's length)")
    xl_cache: bool = knob(
        True, switch, "Transformer-XL cache of the previous segment")
    memory_layers: tuple = knob(
        (8,), indices, "0-based indices of the kNN layers, e.g. 8 or 1,3")
    memory_size: int = knob(
        8192, count, "memory slots M per row and head; 0 = no memory")
    num_neighbors: int = knob(
        32, positive, "k retrieved memories per query")
    num_buckets: int = knob(
        32, positive, "buckets of the T5 relative position bias")
    max_distance: int = knob(
        128, positive, "the T5 bias's farthest bucket begins at this distance")
    exact_topk: bool = knob(
        False, switch, "the exact top-k instead of Sec. 3.3's binned approximation")
    topk_recall_target: float = knob(
        0.95, fraction, "the binned top-k's expected recall; it sets the bins")
    dtype: str = knob(
        "float32", one_of("float32", "bfloat16"),
        "activations and matmuls (params and the loss stay float32)")
    memory_dtype: str = knob(
        None, one_of(None, "float32", "bfloat16"),
        "storage of the memory and XL cache (default: dtype)")
    init_prev_token_bias: float = knob(
        0.0, finite, "T5 bias at distance 1 in half of layer 0's heads, at the start")
    init_gate_bias: float = knob(
        0.0, finite, "b_g at the start; g = sigmoid(b_g) (0: g = 0.5, the paper's)")
    memory_combine: str = knob(
        "gate", one_of("gate", "add", "joint"),
        "gate (Eqs. 1-2), add (their sum) or joint (one softmax)")
    dropout: float = knob(
        0.0, rate, "in training, the rate at which each block's output is zeroed")
    memory_age_bias: float = knob(
        0.0, non_negative, "beta: each slot's score falls by beta log2(1 + age / T)")
    memory_no_match: bool = knob(
        False, switch, "a learned 'no match' logit in the retrieved softmax")
    memory_position_bias: bool = knob(
        True, switch, "the memory layers' local attention keeps its T5 bias")
    cross_batch: int = knob(
        1, positive, "in training, each row also searches the next d - 1 rows' memories")

    def __post_init__(self):
        object.__setattr__(self, "memory_layers", tuple(self.memory_layers))  # JSON gives a list
        check_config(self)

    @property
    def active_memory_layers(self):
        """Return the kNN-augmented layers, none when memory_size is 0."""
        return tuple(sorted(self.memory_layers)) if self.memory_size else ()

    @property
    def storage_dtype(self):
        return self.memory_dtype or self.dtype

    @property
    def cache_length(self):
        return self.segment_length if self.xl_cache else 0

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def check_config(c):
    """Check each field by its rule, then the fields together; refuse a failure in one
    sentence that names the field."""
    for field in dataclasses.fields(c):
        problem = field.metadata["rule"](getattr(c, field.name))
        check(problem is None, f"{field.name} {problem}.")
    M, T, K = c.memory_size, c.segment_length, c.num_neighbors
    exact = c.num_buckets // 2
    check(c.max_distance > exact, f"max_distance ({c.max_distance}) must exceed num_buckets // 2 "
          f"({exact}), where the T5 log-spaced buckets begin.")
    check(M % T == 0, f"memory_size ({M}) must be a multiple of segment_length ({T}).")
    check(not M or K <= M, f"num_neighbors ({K}) must be <= memory_size ({M}).")
    for i in c.memory_layers:
        check(0 <= i < c.num_layers, f"memory layer index {i} is out of range: num_layers is "
              f"{c.num_layers} and the indices are 0-based.")
    check(len(set(c.memory_layers)) == len(c.memory_layers),
          f"memory_layers has a repeated index: {c.memory_layers}.")
    check(not M or c.memory_layers, f"memory_size is {M} but memory_layers names no layer; "
          "for no memory, set it to 0.")
    check(c.num_heads * c.head_dim == c.d_model, f"num_heads * head_dim ({c.num_heads} * "
          f"{c.head_dim}) must equal d_model ({c.d_model}).")
    check(not (c.memory_no_match and c.memory_combine == "joint"), "memory_no_match goes with "
          "the gate and add combines: joint's local pairs are its way to retrieve nothing.")


def check(ok, message):
    if not ok:
        raise ValueError(message)


# ----------------------------------------------------------------------------- state and parameters
class State(NamedTuple):
    """State carries what one segment passes to the next; every leaf is batch-leading. P = T
    where there is an XL cache or a memory, else 0."""
    prev_k: jax.Array  # [B, L, H, P, D] the last segment's keys: the XL cache, the next append
    prev_v: jax.Array  # [B, L, H, P, D]
    prev_valid: jax.Array  # [B, P] bool: False for padding and before a document start
    mem_k: jax.Array  # [B, Lm, H, M, D] the external memory (Sec. 3.1), a ring buffer
    mem_v: jax.Array  # [B, Lm, H, M, D]
    mem_valid: jax.Array  # [B, M] bool: the slot holds a key of the current document
    mem_pos: jax.Array  # [B] int32: the next slot to write


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_state(config, batch_size):
    B, H, D = batch_size, config.num_heads, config.head_dim
    L, Lm = config.num_layers, len(config.active_memory_layers)
    M = config.memory_size if Lm else 0
    P = config.segment_length if config.xl_cache or Lm else 0
    dt = config.storage_dtype
    return State(
        prev_k=jnp.zeros((B, L, H, P, D), dt),
        prev_v=jnp.zeros((B, L, H, P, D), dt),
        prev_valid=jnp.zeros((B, P), bool),
        mem_k=jnp.zeros((B, Lm, H, M, D), dt),
        mem_v=jnp.zeros((B, Lm, H, M, D), dt),
        mem_valid=jnp.zeros((B, M), bool),
        mem_pos=jnp.zeros(B, jnp.int32),
    )


def init_params(config, rng):
    """Initialize the parameters, nested dicts of float32 arrays; docs/usage.md's
    "Initialization" gives the reasons."""
    c, E, H, D, F = config, config.d_model, config.num_heads, config.head_dim, config.d_ff
    # One key for each normal() below: six matrices a layer, then the embedding and the output.
    keys = iter(jax.random.split(rng, 6 * c.num_layers + 2))

    def normal(shape, std):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    in_std = E**-0.5
    out_std = (H * D * 2 * c.num_layers) ** -0.5  # the residual outputs, also over sqrt(2 L)
    prior = np.zeros((c.num_buckets, H), np.float32)
    prior[1, : H // 2] = c.init_prev_token_bias  # bucket 1 = distance 1: a previous-token head
    layers = []
    for i in range(c.num_layers):
        layer = {
            "attn_norm": np.ones(E, np.float32),
            "wq": normal((E, H, D), in_std),
            "wk": normal((E, H, D), in_std),
            "wv": normal((E, H, D), in_std),
            "wo": normal((H, D, E), out_std),
            "qk_scale": np.full(H, math.sqrt(D), np.float32),  # Sec. 3.2: unit q.k at the start
            "rel_bias": prior if i == 0 else np.zeros((c.num_buckets, H), np.float32),  # T5
            "ffn_norm": np.ones(E, np.float32),
            "w1": normal((E, F), in_std),
            "w2": normal((F, E), (F * 2 * c.num_layers) ** -0.5),
        }
        if i in c.active_memory_layers:
            layer["gate_bias"] = np.full(H, c.init_gate_bias, np.float32)  # Eq. (1)'s b_g
        if i in c.active_memory_layers and c.memory_no_match:
            layer["no_match"] = np.zeros(H, np.float32)  # the logit of retrieving nothing
        layers.append(layer)
    params = {
        "embed": normal((c.vocab_size, E), 1.0),
        "layers": layers,
        "final_norm": np.ones(E, np.float32),
        "w_out": normal((E, c.vocab_size), in_std),
    }
    return jax.tree.map(jnp.asarray, params)


# -------------------------------------------------------------------------- Sec. 3: local attention
def rms_norm(x, w):
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(mean_square + 1e-6) * w[None]).astype(x.dtype)


def l2_normalize(x):
    """Sec. 3.2: make queries and keys unit vectors along D."""
    x32 = x.astype(jnp.float32)
    square = jnp.sum(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(square + 1e-6)).astype(x.dtype)


def scale_queries(q, scale):
    """Sec. 3.2: multiply the unit queries [B, H, T, D] by the learned per-head scale [H]."""
    return q * scale.astype(q.dtype)[None, :, None, None]


def precision(config):
    """Keep bfloat16 matmuls that return float32 in bfloat16 in the backward pass too."""
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if config.dtype == "bfloat16" else None


def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
    """Map key minus query position (<= 0) to T5's causal buckets: one a distance below
    num_buckets // 2, then log-spaced up to max_distance. Computed in numpy: the buckets
    are constants of the compiled step."""
    n = np.maximum(-np.asarray(relative_position), 0)  # distance into the past
    exact = num_buckets // 2
    ratio = np.maximum(n, 1).astype(np.float32) / exact
    log_ratio = np.log(ratio) / np.float32(math.log(max_distance / exact))
    large = exact + (log_ratio * (num_buckets - exact)).astype(np.int32)
    large = np.minimum(large, num_buckets - 1)
    return np.where(n < exact, n, large).astype(np.int32)


def masked_softmax(logits, valid):
    """Take the softmax over the last axis where `valid`; say whether any entry was (else 0s)."""
    any_valid = jnp.any(valid, axis=-1, keepdims=True)
    hidden = jnp.where(valid, logits.astype(jnp.float32), NEG_INF)
    weights = jax.nn.softmax(hidden, axis=-1)
    return weights * any_valid, any_valid[..., 0]


def masked_logsumexp(logits, valid):
    """Return masked_softmax's log normalizer, [..., n] -> [...]; about NEG_INF if none is valid."""
    return jax.nn.logsumexp(jnp.where(valid, logits.astype(jnp.float32), NEG_INF), axis=-1)


def local_logits(q, k, key_valid, rel_bias, scale, config):
    """Compute local_attention's logits [B, H, T, S] and the keys each query sees [B, 1, T, S]."""
    T, S = q.shape[2], k.shape[2]
    dist = (S - T + np.arange(T))[:, None] - np.arange(S)[None, :]  # [T, S] query - key position
    buckets = relative_position_bucket(-dist, config.num_buckets, config.max_distance)  # [T, S]
    bias = jnp.moveaxis(rel_bias[buckets], -1, 0)[None]  # [1, H, T, S]
    qs = scale_queries(q, scale)  # [B, H, T, D]
    logits = jnp.einsum("bhtd,bhsd->bhts", qs, k,
                        preferred_element_type=jnp.float32, precision=precision(config))
    window = (dist >= 0) & (dist <= config.segment_length)  # [T, S]
    visible = window[None, None] & key_valid[:, None, None, :]  # [B, 1, T, S]
    return logits + bias, visible


def local_attention(q, k, v, key_valid, rel_bias, scale, config):
    """Sec. 3: attend causally over [XL cache; segment] with a sliding window and the T5 bias.
    q [B, H, T, D]; k, v [B, H, S, D], the cache first; key_valid [B, S] -> [B, H, T, D]. Query t
    at position C + t sees key s iff 0 <= C + t - s <= T. A padding query gets 0."""
    logits, visible = local_logits(q, k, key_valid, rel_bias, scale, config)  # [B, H, T, S]
    weights, _ = masked_softmax(logits, visible)  # [B, H, T, S]
    out = jnp.einsum("bhts,bhsd->bhtd", weights.astype(v.dtype), v)  # [B, H, T, D]
    query_valid = key_valid[:, None, k.shape[2] - q.shape[2] :, None]  # [B, 1, T, 1]
    return out * query_valid.astype(out.dtype)


# ----------------------------------------------------------------------------- Sec. 3.3: top-k
def num_topk_bins(k, memory_size, recall_target):
    """Choose the fewest bins G (a power of two, at least k, at most M) whose expected
    recall meets the target: (G / k) (1 - (1 - 1/G)^k), with the true top-k spread
    uniformly over G bins and one winner a bin."""
    G = 1
    while G < memory_size and (G < k or (G / k) * (1 - (1 - 1 / G) ** k) < recall_target):
        G *= 2
    return min(G, memory_size)


def bin_layout(k, memory_size, recall_target):
    """Lay the memory out as rows of G bins, slot s in bin s mod G: return (G, rows), rows
    the largest power of two that divides M and leaves at least num_topk_bins bins (M = 768:
    one row of 768)."""
    bins = num_topk_bins(k, memory_size, recall_target)
    rows = 1
    while memory_size % (2 * rows) == 0 and 2 * rows <= memory_size // bins:
        rows *= 2
    return memory_size // rows, rows


def memory_search(q, mem_k, mem_valid, scale, config, bias=None):
    """Find the top-k memory slots of every query: q [B, H, T, D], mem_k [B, H, M, D],
    mem_valid [B, M] -> scores, slots [B, H, T, K]; invalid slots score NEG_INF, and
    bias [B, M], where given, adds to every slot's score. Exact, or binned (Sec. 3.3):
    each bin's best slot (consecutive slots in different bins), then the top-k of the
    winners."""
    B, H, M, D = mem_k.shape
    T, K = q.shape[2], config.num_neighbors
    qs = jax.lax.stop_gradient(scale_queries(q, scale))  # [B, H, T, D]
    keys = mem_k.astype(q.dtype)  # [B, H, M, D]
    scores = jnp.einsum("bhtd,bhmd->bhtm", qs, keys, preferred_element_type=q.dtype)
    if bias is not None:
        scores = scores + bias[:, None, None, :].astype(scores.dtype)  # [B, H, T, M]
    scores = jnp.where(mem_valid[:, None, None, :], scores, NEG_INF)  # [B, H, T, M]
    if config.exact_topk:
        return jax.lax.top_k(scores, K)
    G, rows = bin_layout(K, M, config.topk_recall_target)
    binned = scores.reshape(B, H, T, rows, G)  # slot s = row * G + bin
    best = jnp.max(binned, axis=3)  # [B, H, T, G] each bin's best score
    best_row = jnp.argmax(binned, axis=3)  # [B, H, T, G] and its row
    top, bins = jax.lax.top_k(best, K)  # [B, H, T, K]
    rows_of_top = jnp.take_along_axis(best_row, bins, axis=-1)  # [B, H, T, K]
    return top, rows_of_top * G + bins


# -------------------------------------------------------------------------- Sec. 3.1: kNN attention
def retrieved_logits(q, mem_k, slots, scale, config):
    """Score each query q [B, H, T, D] against its retrieved keys, slots [B, H, T, K]:
    the logits [B, H, T, K]."""
    index = slots[..., None]  # [B, H, T, K, 1]
    keys = jnp.take_along_axis(mem_k[:, :, None], index, axis=3).astype(q.dtype)  # [B, H, T, K, D]
    logits = jnp.einsum("bhtd,bhtkd->bhtk", q, keys,
                        preferred_element_type=jnp.float32, precision=precision(config))
    return logits * scale[None, :, None, None]  # [B, H, T, K]: Sec. 3.2's scale


def attend_to_retrieved(q, mem_k, mem_v, slots, valid, scale, config, bias=None):
    """Attend from each query over its K retrieved pairs with a softmax and no position
    bias but `bias` [B, H, T, K] where given: q [B, H, T, D], slots and valid
    [B, H, T, K] -> out [B, H, T, D], weights [B, H, T, K], has_memory [B, H, T]
    (False where no retrieved slot was valid)."""
    index = slots[..., None]  # [B, H, T, K, 1]
    vals = jnp.take_along_axis(mem_v[:, :, None], index, axis=3).astype(q.dtype)  # [B, H, T, K, D]
    logits = retrieved_logits(q, mem_k, slots, scale, config)  # [B, H, T, K]
    if bias is not None:
        logits = logits + bias  # [B, H, T, K]
    weights, has_memory = masked_softmax(logits, valid)  # [B, H, T, K]
    out = jnp.einsum("bhtk,bhtkd->bhtd", weights.astype(vals.dtype), vals)  # [B, H, T, D]
    return out, weights, has_memory


class Retrieved(NamedTuple):
    """Retrieved holds what knn_attention finds for each query: out [B, H, T, D];
    has_memory [B, H, T] (False where no retrieved slot is valid); the slots, their
    validity and attention weights [B, H, T, K]."""
    out: jax.Array
    has_memory: jax.Array
    slots: jax.Array
    valid: jax.Array
    weights: jax.Array
    bias: object  # [B, H, T, K]: the retrieved slots' age_bias, or None


def knn_attention(q, mem_k, mem_v, mem_valid, scale, config, ops, slot_bias=None):
    """Sec. 3.1: retrieve each query's top-k pairs from the memory and attend to them.
    q [B, H, T, D]; mem_k, mem_v [B, H, M, D]; mem_valid [B, M]; slot_bias [B, M],
    where given, added to each slot's score in the search and the softmax -> Retrieved.
    The memory is a constant: gradients reach q through the keys."""
    mem_k = jax.lax.stop_gradient(mem_k)
    mem_v = jax.lax.stop_gradient(mem_v)
    _, slots = ops.memory_search(q, mem_k, mem_valid, scale, config, bias=slot_bias)
    take = jax.vmap(lambda row, row_slots: row[row_slots])  # [B, M], slots -> [B, H, T, K]
    valid = take(mem_valid, slots)  # [B, H, T, K]
    bias = None if slot_bias is None else take(slot_bias, slots)  # [B, H, T, K]
    attend = ops.attend_to_retrieved
    out, weights, has_memory = attend(q, mem_k, mem_v, slots, valid, scale, config, bias)
    return Retrieved(out=out, has_memory=has_memory, slots=slots, valid=valid, weights=weights,
                     bias=bias)


def combine(out, found, gate_bias, config, lse=None, no_match=None):
    """Mix the local out [B, H, T, D] and the retrieved found.out as
    config.memory_combine says. lse: the retrieved and the local logits' log
    normalizers [B, H, T] (joint's; the first alone with no_match). In add and joint,
    b_g is a constant (its init) that weighs the retrieved side by e^b_g; memory_off
    sets it to -1e9. no_match [H]: the logit of retrieving nothing (deviation 8). A
    query with no valid memory (a document's first segment) keeps its out."""
    b = gate_bias[None, :, None]  # [1, H, 1]
    if config.memory_combine == "gate":  # Eq. (2): V_a = V_m * g + V_c * (1 - g), g = sigmoid(b_g)
        share = jax.nn.sigmoid(b)
    elif config.memory_combine == "add":  # the gateless V_a = V_m + V_c of Sec. 4.6's study
        share = jnp.exp(jax.lax.stop_gradient(b))
    else:  # joint: the retrieved pairs' share of one softmax over [retrieved; local]
        mem_lse, local_lse = lse
        share = jax.nn.sigmoid(mem_lse + jax.lax.stop_gradient(b) - local_lse)  # Z_m / (Z_m + Z_c)
    if no_match is not None:  # of [retrieved; nothing], the retrieved: Z_m / (Z_m + e^b)
        b_nm = no_match[None, :, None]  # [1, H, 1]
        share = share * jax.nn.sigmoid(lse[0] - b_nm)  # [B, H, T]
    share = (share * found.has_memory)[..., None]  # [B, H, T, 1]
    return found.out * share + out * (1 if config.memory_combine == "add" else 1 - share)


# ------------------------------------------------------------------------ Sec. 3.1: the ring buffer
def write_memory(mem, new, pos, write, axis):
    """Append to the FIFO ring buffer: row b writes new[b] at slot pos[b] along `axis`
    (after B) where write[b]. M and pos are multiples of T, so a write never wraps around."""

    def write_row(row, row_new, row_pos, row_write):
        old = jax.lax.dynamic_slice_in_dim(row, row_pos, row_new.shape[axis], axis=axis)
        written = jnp.where(row_write, row_new.astype(row.dtype), old)
        return jax.lax.dynamic_update_slice_in_dim(row, written, row_pos, axis=axis)

    return jax.vmap(write_row)(mem, new, pos, write)


def clear_rows(mem, reset):
    """Ethics section: zero the rows b of mem [B, ...] where reset[b], not only their flags."""
    reset = reset.reshape((-1,) + (1,) * (mem.ndim - 1))  # [B, 1, ...]
    return jnp.where(reset, jnp.zeros((), mem.dtype), mem)


def commit_memory(state, reset, config, clear=clear_rows):
    """Clear the rows that start a document; append the last segment's keys and values,
    state.prev_k, prev_v [B, L, H, T, D], to the others' memories mem_k, mem_v [B, Lm, H, M,
    D], unless all of it was padding (padding never costs a slot). reset [B] -> the State.
    Sec. 3.1 retrieves, then appends; here the append waits for the next call, which searches
    the same memory, so that XLA writes it in place (deviation 3)."""
    keep = ~reset.astype(bool)  # [B]
    append = keep & jnp.any(state.prev_valid, axis=1)  # [B]
    layers = list(config.active_memory_layers)
    new_k, new_v = state.prev_k[:, layers], state.prev_v[:, layers]  # [B, Lm, H, T, D]
    mem_k = write_memory(clear(state.mem_k, ~keep), new_k, state.mem_pos, append, 2)
    mem_v = write_memory(clear(state.mem_v, ~keep), new_v, state.mem_pos, append, 2)
    mem_valid = write_memory(state.mem_valid, state.prev_valid, state.mem_pos, append, 0)
    mem_valid = mem_valid & keep[:, None]  # [B, M]
    T, M = state.prev_valid.shape[1], state.mem_valid.shape[1]
    advanced = jnp.where(append, state.mem_pos + T, state.mem_pos) % max(M, 1)  # [B]
    mem_pos = jnp.where(keep, advanced, 0).astype(jnp.int32)  # [B]
    return state._replace(mem_k=mem_k, mem_v=mem_v, mem_valid=mem_valid, mem_pos=mem_pos)


# ------------------------------------------------------------- beyond the paper: crowded memories
def age_bias(mem_pos, M, config):
    """Compute each slot's score bias, -beta log2(1 + age / T) (deviation 7).
    Its age: the tokens since it was written, counted back from the
    write position mem_pos [B] (slot mem_pos - 1 holds the last token
    written) -> [B, M]. Among look-alikes, the recent ones win."""
    age = (mem_pos[:, None] - 1 - jnp.arange(M)[None, :]) % M + 1  # [B, M]: 1 to M
    return -config.memory_age_bias * jnp.log2(1.0 + age / config.segment_length)  # [B, M]


def with_other_rows(x, d, axis):
    """Follow row b of x [B, ...] by rows b + 1, ..., b + d - 1 (mod B)
    along `axis`: its memory and those of d - 1 other documents
    (deviation 9). M -> d M along `axis`."""
    return jnp.concatenate([jnp.roll(x, -j, axis=0) for j in range(d)], axis=axis)


# ----------------------------------------------------------------------------- the model
class Ops(NamedTuple):
    """Ops names the pieces forward computes with; kernels.py has drop-ins of the same
    signatures."""
    local_attention: Callable
    memory_search: Callable
    attend_to_retrieved: Callable
    clear_rows: Callable


PLAIN = Ops(local_attention, memory_search, attend_to_retrieved, clear_rows)


def dropout(x, rate, rng):
    """Zero each element at `rate` and scale the others by 1 / (1 - rate), keeping the mean."""
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)  # x's shape, bool
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def forward(params, state, tokens, reset, config, mask=None, return_retrievals=False, ops=PLAIN,
            rng=None):
    """Run one segment of every row: tokens int [B, T] (the caller checks their range); reset bool
    [B] (the row starts a document); mask bool [B, T], False on padding, which never enters the
    memory or the cache as valid; rng, given in training only: each block's output is dropped at
    config.dropout, and each row also searches the memories of config.cross_batch - 1 other rows
    (None: evaluation). Returns (logits [B, T, V] float32, new state), and with
    return_retrievals also a list, per memory layer, of {"slots", "weights"} [B, H, T, K]."""
    c, dt = config, config.dtype
    (B, T), E, H, D = tokens.shape, c.d_model, c.num_heads, c.head_dim
    check(T == c.segment_length, f"tokens have {T} positions but segment_length is "
          f"{c.segment_length}.")
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)  # [B, T]
    keep = ~reset.astype(bool)  # [B]: a document start clears the row's cache and memory
    C = c.cache_length
    cache_valid = state.prev_valid[:, :C] & keep[:, None]  # [B, C]
    key_valid = jnp.concatenate([cache_valid, mask], axis=1)  # [B, S]
    if c.active_memory_layers:
        state = commit_memory(state, reset, c, ops.clear_rows)
        M = c.memory_size
        mem_valid = state.mem_valid  # [B, M]
        slot_bias = age_bias(state.mem_pos, M, c) if c.memory_age_bias else None  # [B, M]
        others = c.cross_batch if rng is not None else 1  # rows searched by each

        check(others <= B, f"cross_batch ({others}) must be at most the {B} rows of a step.")
        if others > 1:  # the memories of rows b, ..., b + d - 1 as one: [B, d M]
            mem_valid = with_other_rows(mem_valid, others, axis=1)  # [B, d M]
            if slot_bias is not None:
                slot_bias = with_other_rows(slot_bias, others, axis=1)  # [B, d M]

    def heads(y):  # [N, H * D] -> [B, H, T, D]
        return jnp.swapaxes(y.reshape(B, T, H, D), 1, 2)

    drop = rng is not None and c.dropout > 0
    drop_keys = jax.random.split(rng, 2 * c.num_layers) if drop else None  # a block's output each
    # The residual stream as a matrix, a row a token: each weight's gradient is one plain matmul.
    x = params["embed"][tokens.reshape(B * T)].astype(dt)  # [N, E]
    new_k, new_v, retrievals = [], [], []
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])  # [N, E]
        q = heads(h @ p["wq"].reshape(E, H * D).astype(dt))  # [B, H, T, D]
        k = heads(h @ p["wk"].reshape(E, H * D).astype(dt))  # [B, H, T, D]
        v = heads(h @ p["wv"].reshape(E, H * D).astype(dt))  # [B, H, T, D]
        q = l2_normalize(q)
        k = l2_normalize(k)
        # Transformer-XL: the previous segment's keys and values first, constants (no gradient).
        cache_k = jax.lax.stop_gradient(state.prev_k[:, i, :, :C]).astype(dt)  # [B, H, C, D]
        cache_v = jax.lax.stop_gradient(state.prev_v[:, i, :, :C]).astype(dt)  # [B, H, C, D]
        local_k = jnp.concatenate([cache_k, k], axis=2)  # [B, H, S, D]
        local_v = jnp.concatenate([cache_v, v], axis=2)  # [B, H, S, D]
        scale = p["qk_scale"]  # [H]
        memory_layer = i in c.active_memory_layers
        rel_bias = p["rel_bias"]  # [num_buckets, H]
        if memory_layer and not c.memory_position_bias:  # meliad's 2025 memory configuration
            rel_bias = jnp.zeros_like(rel_bias)
        out = ops.local_attention(q, local_k, local_v, key_valid, rel_bias, scale, c)
        if memory_layer:
            j = c.active_memory_layers.index(i)
            mem_k, mem_v = state.mem_k[:, j], state.mem_v[:, j]  # [B, H, M, D]
            if others > 1:
                mem_k = with_other_rows(mem_k, others, axis=2)  # [B, H, d M, D]
                mem_v = with_other_rows(mem_v, others, axis=2)  # [B, H, d M, D]
            found = knn_attention(q, mem_k, mem_v, mem_valid, scale, c, ops, slot_bias)
            lse = None
            if c.memory_combine == "joint" or c.memory_no_match:  # each side's log normalizer
                retrieved = retrieved_logits(q, mem_k, found.slots, scale, c)  # [B, H, T, K]
                if found.bias is not None:
                    retrieved = retrieved + found.bias  # [B, H, T, K]
                lse = (masked_logsumexp(retrieved, found.valid), None)
            if c.memory_combine == "joint":
                local = local_logits(q, local_k, key_valid, rel_bias, scale, c)  # [B, H, T, S]
                lse = (lse[0], masked_logsumexp(*local))
            out = combine(out, found, p["gate_bias"], c, lse, p.get("no_match")).astype(dt)
            retrievals.append({"slots": found.slots, "weights": found.weights})
        attn = jnp.einsum("bhtd,hde->bte", out, p["wo"].astype(dt)).reshape(B * T, E)  # [N, E]
        if drop:
            attn = dropout(attn, c.dropout, drop_keys[2 * i])
        x = x + attn  # [N, E]
        h = rms_norm(x, p["ffn_norm"])  # [N, E]
        h = jax.nn.gelu(h @ p["w1"].astype(dt))  # [N, F]
        ffn = h @ p["w2"].astype(dt)  # [N, E]
        if drop:
            ffn = dropout(ffn, c.dropout, drop_keys[2 * i + 1])
        x = x + ffn  # [N, E]
        new_k.append(jax.lax.stop_gradient(k))
        new_v.append(jax.lax.stop_gradient(v))

    h = rms_norm(x, params["final_norm"])  # [N, E]
    logits = jnp.einsum("ne,ev->nv", h, params["w_out"].astype(dt),
                        preferred_element_type=jnp.float32, precision=precision(c))  # [N, V]
    logits = logits.reshape(B, T, -1)  # [B, T, V]

    def stack(arrays, like):  # L of [B, H, T, D] -> [B, L, H, T, D]
        return jnp.stack(arrays, axis=1).astype(like.dtype)

    # This segment's keys and values: the next segment's XL cache, and the memory's next append.
    if c.xl_cache or c.active_memory_layers:
        state = state._replace(prev_k=stack(new_k, state.prev_k),
                               prev_v=stack(new_v, state.prev_v), prev_valid=mask)
    return (logits, state, retrievals) if return_retrievals else (logits, state)


def cross_entropy(logits, targets):
    """Return the per-token cross-entropy in nats: [B, T, V], [B, T] -> [B, T]."""
    logits = logits.astype(jnp.float32)
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)  # [B, T, V]
    target_logit = jnp.sum(one_hot * logits, axis=-1)  # [B, T]
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def memory_off(params):
    """Return the memory-off ablation: the same weights with every b_g at -1e9 (local only)."""
    layers = [dict(p, gate_bias=jnp.full_like(p["gate_bias"], -1e9)) if "gate_bias" in p else p
              for p in params["layers"]]
    return dict(params, layers=layers)

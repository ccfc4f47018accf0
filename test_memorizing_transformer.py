"""Executable spec of memorizing_transformer.py: every property against an exact reference.

References are independent of the model code: dense softmax attention in numpy float64, explicit
loops, and a one-shot numpy model over the whole document. The whole model is checked with its
plain pieces and with FAST, which every script runs (test_kernels.py holds each drop-in to
its piece).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import evaluation
import kernels
import memorizing_transformer as mt
import optimizer
import presets

jax.config.update("jax_numpy_rank_promotion", "raise")  # shape mistakes fail loudly
SETTINGS = settings(deadline=None, max_examples=12, derandomize=True)

# A few fixed shapes, so that jit compiles each once.
SMALL = presets.RunConfig(  # a RunConfig: some tests train it
    vocab_size=61,
    d_model=32,
    num_layers=2,
    num_heads=2,
    head_dim=16,
    d_ff=48,
    segment_length=8,
    memory_layers=(1,),
    memory_size=32,
    num_neighbors=8,
    memory_chunk=16,
    batch_size=2,
)
FAST = kernels.fast(memory_chunk=SMALL.memory_chunk)  # the memory in pieces of 16 slots
FUSED = kernels.fast(memory_chunk=SMALL.memory_chunk, attention="fused")
forward = jax.jit(mt.forward, static_argnames=("config", "return_retrievals", "ops"))
OPS = pytest.mark.parametrize("ops", [mt.PLAIN, FAST], ids=["plain", "fast"])


# ----------------------------------------------------------------------------- numpy references
def np_softmax_masked(logits, valid):
    """Dense softmax over valid entries; a row with none valid is all zeros."""
    logits = np.where(valid, logits, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.where(valid, np.exp(logits - top), 0.0)
    total = p.sum(-1, keepdims=True)
    return np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)


def np_t5_bucket(n, num_buckets=32, max_distance=128):
    """T5's formula for a non-negative distance n into the past, one number at a time."""
    exact = num_buckets // 2
    if n < exact:
        return n
    b = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(b, num_buckets - 1)


def np_rms_norm(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * w


def heads_first(x):
    """[B, T, H, D] (the references' layout) <-> [B, H, T, D] (the model's)."""
    return jnp.swapaxes(x, 1, 2)


def np_unit(x):
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def np_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_memory(dots, mask, config, rows=1):
    """Which earlier keys each query attends to in the memory, as the paper's ring buffer holds
    them: dots [B, H, N, B, N] (query row b, position i; key row r, position j), mask [B, N] ->
    chosen bool [B, H, N, B, N], and each pair's age bias [B, N, B, N]. Each segment with a valid
    token takes the next T slots of its row, the oldest dropped once M are full; a padded key is
    never valid. A slot's age is the tokens between it and the query's segment, counted in slots
    written; its bias -beta log2(1 + age / T) adds to its score. Row b searches its own memory,
    then (rows > 1, cross-batch) those of rows b + 1, ..., b + rows - 1, as one of rows * M slots.
    Exact top-k with k >= the held keys takes them all; the binned top-k (slot s in bin s mod G,
    rows of G bins) takes each bin's best held key, then the k best of those; the exact top-k
    the k best held keys."""
    B, H, N = dots.shape[:3]
    T, M, K = config.segment_length, config.memory_size, config.num_neighbors
    G = mt.bin_layout(K, rows * M, config.topk_recall_target)[0]
    held = [[{} for _ in range(N // T)] for _ in range(B)]  # row, segment -> {j: (slot, age)}
    for r in range(B):
        appended = []  # segments in the order they were written to the memory
        for n in range(N // T):
            for m in appended[-(M // T) :]:  # the last M // T appended segments, oldest first
                first = (appended.index(m) * T) % M
                age = (len(appended) - appended.index(m)) * T
                for t in range(T):
                    if mask[r, m * T + t]:
                        held[r][n][m * T + t] = (first + t, age - t)
            if mask[r, n * T : (n + 1) * T].any():
                appended.append(n)
    chosen = np.zeros(dots.shape, bool)
    bias = np.zeros((B, N, B, N))
    beta = config.memory_age_bias
    for b in range(B):
        for n in range(N // T):
            slots = {}  # (key row, key position) -> its slot in the searched memory
            for o in range(rows):
                r = (b + o) % B
                for j, (slot, age) in held[r][n].items():
                    slots[(r, j)] = o * M + slot
                    bias[b, n * T : (n + 1) * T, r, j] = -beta * np.log2(1 + age / T)
            for h in range(H):
                for i in range(n * T, (n + 1) * T):
                    score = lambda rj: dots[b, h, i, rj[0], rj[1]] + bias[b, i, rj[0], rj[1]]
                    if K >= len(slots):
                        picked = list(slots)
                    elif config.exact_topk:
                        picked = sorted(slots, key=lambda rj: -score(rj))[:K]
                    else:
                        best = {}  # bin -> its best key
                        for rj, s in slots.items():
                            if s % G not in best or score(rj) > score(best[s % G]):
                                best[s % G] = rj
                        picked = sorted(best.values(), key=lambda rj: -score(rj))[:K]
                    for r, j in picked:
                        chosen[b, h, i, r, j] = True
    return chosen, bias


def reference_forward(params, tokens, config, gate=None, mask=None, kept=None, rows=1):
    """The whole document in one pass, numpy float64.

    Local attention: a banded causal mask (itself and the previous T tokens) with the XL
    cache, or causal within each segment without it; padded keys (mask False) never seen.
    Memory layers: dense softmax over the keys the memory holds (reference_memory; rows > 1:
    the memories of `rows` rows, as in training with cross_batch), with the age bias and no
    position bias, mixed by the gate; `gate` 'memory' / 'local' forces g = 1 / g = 0. With a
    no-match logit, the softmax has one more entry, of value 0, and the gate mixes in the held
    keys' share of it, the rest going to the local result. A query with no key in the memory
    keeps the local result. Without memory_position_bias the memory layers' local attention
    has no T5 bias. Padded positions' logits are not defined.
    kept: dropout's multipliers of each block's output, [B, N, E] a block, in the model's order.
    """
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    T, N, B, H = config.segment_length, tokens.shape[1], tokens.shape[0], config.num_heads
    mask = np.ones(tokens.shape, bool) if mask is None else np.asarray(mask)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    dist = i - j
    band = (dist >= 0) & ((dist <= T) if config.xl_cache else (i // T == j // T))
    band = band[None, None] & mask[:, None, None, :]  # [B, 1, N, N]
    buckets = np.vectorize(
        lambda n: np_t5_bucket(max(n, 0), config.num_buckets, config.max_distance)
    )(dist)
    x = p["embed"][tokens]
    for layer, lp in enumerate(p["layers"]):
        memory = layer in config.active_memory_layers
        h = np_rms_norm(x, lp["attn_norm"])
        q = np_unit(np.einsum("bte,ehd->bthd", h, lp["wq"]))
        k = np_unit(np.einsum("bte,ehd->bthd", h, lp["wk"]))
        v = np.einsum("bte,ehd->bthd", h, lp["wv"])
        scale = lp["qk_scale"][None, :, None, None]
        dots = np.einsum("bihd,bjhd->bhij", q, k) * scale
        bias = np.transpose(lp["rel_bias"][buckets], (2, 0, 1))[None]
        if memory and not config.memory_position_bias:
            bias = np.zeros_like(bias)
        out = np.einsum("bhij,bjhd->bihd", np_softmax_masked(dots + bias, band), v)
        if memory:
            cross = np.einsum("bihd,rjhd->bhirj", q, k) * scale[..., None]  # [B, H, N, B, N]
            held, age = reference_memory(cross, mask, config, rows)  # [B, H, N, B, N]
            has = np.swapaxes(held.any((-1, -2)), 1, 2)[..., None]  # [B, N, H, 1]
            logits = (cross + age[:, None]).reshape(B, H, N, B * N)  # [B, H, N, B N]
            chosen = held.reshape(B, H, N, B * N)
            values = v.reshape(B * N, H, -1)  # [B N, H, D]: key row r, position j
            b = lp["gate_bias"][None, :, None, None]  # [1, H, 1, 1]
            if config.memory_combine == "joint":  # one softmax: the held keys (+ b_g), the band's
                seen = np.concatenate([chosen, np.broadcast_to(band, dots.shape)], axis=-1)
                weights = np_softmax_masked(np.concatenate([logits + b, dots + bias], -1), seen)
                out = np.einsum("bhij,jhd->bihd", weights[..., : B * N], values)
                out = out + np.einsum("bhij,bjhd->bihd", weights[..., B * N :], v)
            else:
                if config.memory_no_match:  # one more logit, of value 0: the share of nothing
                    sink = np.broadcast_to(lp["no_match"][None, :, None, None], (B, H, N, 1))
                    both = np_softmax_masked(
                        np.concatenate([logits, sink], -1),
                        np.concatenate([chosen, np.ones((B, H, N, 1), bool)], -1),
                    )
                    weights, share = both[..., :-1], 1 - both[..., -1]  # [B, H, N]
                else:
                    weights, share = np_softmax_masked(logits, chosen), np.ones((B, H, N))
                mem = np.einsum("bhij,jhd->bihd", weights, values)  # held keys' part, unnormed
                share = np.swapaxes(share, 1, 2)[..., None] * has  # [B, N, H, 1]
                if config.memory_combine == "add":
                    out = out + mem * np.exp(lp["gate_bias"])[None, None, :, None] * has
                else:
                    g = {"memory": 1.0, "local": 0.0, None: None}[gate]
                    g = (
                        1 / (1 + np.exp(-lp["gate_bias"]))
                        if g is None
                        else np.full(config.num_heads, g)
                    )
                    g = g[None, None, :, None]  # [1, 1, H, 1]
                    out = g * mem * has + out * (1 - g * share)
        keep_attn, keep_ffn = (1.0, 1.0) if kept is None else kept[2 * layer : 2 * layer + 2]
        x = x + np.einsum("bthd,hde->bte", out, lp["wo"]) * keep_attn
        x = x + np_gelu(np_rms_norm(x, lp["ffn_norm"]) @ lp["w1"]) @ lp["w2"] * keep_ffn
    return np_rms_norm(x, p["final_norm"]) @ p["w_out"]


def masked_loss(logits, targets, mask):
    """Mean cross-entropy over the unmasked tokens."""
    m = mask.astype(jnp.float32)
    return jnp.sum(mt.cross_entropy(logits, targets) * m) / jnp.maximum(jnp.sum(m), 1.0)


def stream(params, tokens, config, state=None, reset_first=True, ops=FAST, mask=None, rng=None):
    """Run the model segment by segment over tokens [B, N*T]; returns logits [B, N*T, V]. rng:
    as in training (cross_batch applies)."""
    B, T = tokens.shape[0], config.segment_length
    state = mt.init_state(config, B) if state is None else state
    mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask)
    out = []
    for n in range(tokens.shape[1] // T):
        reset = jnp.full((B,), reset_first and n == 0)
        piece = slice(n * T, (n + 1) * T)
        logits, state = forward(
            params, state, tokens[:, piece], reset, config, mask=mask[:, piece], ops=ops, rng=rng
        )
        out.append(logits)
    return jnp.concatenate(out, axis=1), state


def random_tokens(seed, config, batch, segments):
    rng = np.random.default_rng(seed)
    return jnp.asarray(
        rng.integers(0, config.vocab_size, (batch, segments * config.segment_length))
    )


# ----------------------------------------------------------------------------- the session
def test_the_session_runs_float32_matmuls_at_full_precision():
    """conftest.py asks for it: on a GPU the default is a TF32-class pass (~1e-3 relative),
    and every comparison with an exact reference below would fail for that reason alone."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 256, 256))
    got = np.asarray(jax.jit(jnp.matmul)(a.astype(np.float32), b.astype(np.float32)), np.float64)
    want = a.astype(np.float32).astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    assert np.max(np.abs(got - want)) < 1e-4 * np.max(np.abs(want))


# ----------------------------------------------------------------------------- T5 buckets
def test_t5_buckets_match_hand_computed_values():
    # num_buckets 32, max_distance 128: distances < 16 exact, then 16 + floor(log(n/16)/log(8)*16).
    distances = np.array([0, 1, 15, 16, 20, 32, 64, 127, 128, 1000])
    expected = np.array([0, 1, 15, 16, 17, 21, 26, 31, 31, 31])
    np.testing.assert_array_equal(mt.relative_position_bucket(-distances), expected)
    # The future (positive relative position) falls in bucket 0 in a causal model.
    np.testing.assert_array_equal(mt.relative_position_bucket(np.array([1, 5])), [0, 0])


@SETTINGS
@given(nb=st.sampled_from([8, 16, 32]), md=st.sampled_from([24, 64, 128]))
def test_t5_buckets_are_monotone_and_saturate(nb, md):
    n = np.arange(0, 4 * md)
    b = np.asarray(mt.relative_position_bucket(-n, nb, md))
    assert np.all(np.diff(b) >= 0)
    assert b[-1] == nb - 1 and b.max() == nb - 1
    np.testing.assert_array_equal(b, [np_t5_bucket(int(d), nb, md) for d in n])


# ----------------------------------------------------------------------------- local attention
def local_attention_loops(q, k, v, key_valid, bias, scale, T):
    """Sec. 3's local attention one query at a time, numpy float64: q [B, T, H, D], k, v
    [B, C + T, H, D] (the cache first), key_valid [B, C + T]; query t sees key s iff both are
    valid and 0 <= C + t - s <= T. A padding query gets 0."""
    B, _, H, D = q.shape
    C = k.shape[1] - T
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [s for s in range(C + T) if key_valid[b, s] and 0 <= C + t - s <= T]
                if not key_valid[b, C + t]:
                    continue
                logits = [
                    scale[h] * q[b, t, h] @ k[b, s, h] + bias[np_t5_bucket(C + t - s), h]
                    for s in keys
                ]
                w = np.exp(np.array(logits) - max(logits))
                out[b, t, h] = sum(wi * v[b, s, h] for wi, s in zip(w / w.sum(), keys))
    return out


@SETTINGS
@given(seed=st.integers(0, 2**16), xl=st.booleans(), reset=st.booleans())
def test_local_attention_equals_explicit_loops(seed, xl, reset):
    rng = np.random.default_rng(seed)
    cfg = SMALL.replace(xl_cache=xl)
    B, T, H, D, C = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.cache_length
    q, k, v = (rng.standard_normal((B, n, H, D)).astype(np.float32) for n in (T, C + T, C + T))
    key_valid = rng.random((B, C + T)) < 0.8
    key_valid[0, C:] = True  # row 0 has no padding, row 1 has some
    if reset:
        key_valid[:, :C] = False
    bias = rng.standard_normal((cfg.num_buckets, H)).astype(np.float32)
    scale = rng.uniform(1, 5, H).astype(np.float32)
    got = heads_first(
        jax.jit(mt.local_attention, static_argnums=6)(
            *map(heads_first, (q, k, v)), key_valid, bias, scale, cfg
        )
    )
    np.testing.assert_allclose(
        got, local_attention_loops(q, k, v, key_valid, bias, scale, T), atol=1e-5, rtol=1e-5
    )


def dense_local_attention(q, k, v, key_valid, bias, scale, T):
    """Sec. 3's local attention as one masked softmax over [B, H, T, C + T], for any dtype (the
    gradients' reference): q [B, T, H, D], k, v [B, C + T, H, D]."""
    C = k.shape[1] - T
    dist = (np.arange(T)[:, None] + C) - np.arange(C + T)[None, :]
    buckets = np.vectorize(lambda n: np_t5_bucket(max(n, 0)))(dist)
    visible = (dist >= 0) & (dist <= T)
    logits = (
        jnp.einsum("bthd,bshd->bhts", q, k) * scale[None, :, None, None]
        + jnp.transpose(bias[buckets], (2, 0, 1))[None]
    )
    logits = jnp.where(visible[None, None] & key_valid[:, None, None, :], logits, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)


def local_attention_gradients(f, key_valid, cfg, seed=7):
    """The gradients of sum(f(q, k, v, bias, scale) * r) in q, k, v [B, T or C + T, H, D], the bias
    table and the scale, for f in the references' layout; those of dense_local_attention in float64
    (exact for a float32 model); and, per gradient, how far dense_local_attention's own float32
    gradient is from its float64 one (the rounding a float32 formulation cannot avoid). No padding
    query: key_valid's segment is all valid."""
    rng = np.random.default_rng(seed)
    B, T, H, D, C = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.cache_length
    args = [rng.standard_normal((B, n, H, D)) for n in (T, C + T, C + T)]
    args += [
        rng.standard_normal((cfg.num_buckets, H)),
        rng.uniform(1, 5, H),
        rng.standard_normal((B, T, H, D)),
    ]
    grad = lambda f, args: jax.jit(
        jax.grad(lambda *a: jnp.sum(f(*a[:-1]) * a[-1]), argnums=(0, 1, 2, 3, 4))
    )(*args)
    reference = lambda q, k, v, bias, scale: dense_local_attention(
        q, k, v, key_valid, bias, scale, T
    )
    got, ref32 = (grad(f, [jnp.asarray(x, jnp.float32) for x in args]) for f in (f, reference))
    with jax.enable_x64(True):
        want = [np.asarray(g) for g in grad(reference, [jnp.asarray(x, jnp.float64) for x in args])]
    return got, want, [np.abs(np.asarray(r, np.float64) - w).max() for r, w in zip(ref32, want)]


def test_local_attention_gradients_equal_those_of_a_dense_softmax():
    """The gradients of every input (queries, keys and values of the cache and the segment, the T5
    bias table, the scale) are those of one dense masked softmax in float64, within float32
    rounding: the larger of 5e-6 of the gradient's largest entry and 4x the dense softmax's own
    float32 error (the scale's gradient is a sum that cancels)."""
    cfg = SMALL
    C, T = cfg.cache_length, cfg.segment_length
    key_valid = jnp.asarray(np.random.default_rng(8).random((2, C + T)) < 0.8).at[:, C:].set(True)
    model = lambda q, k, v, bias, scale: heads_first(
        mt.local_attention(*map(heads_first, (q, k, v)), key_valid, bias, scale, cfg)
    )
    got, want, rounding = local_attention_gradients(model, key_valid, cfg)
    for g, w, r, name in zip(got, want, rounding, ("q", "k", "v", "rel_bias", "scale")):
        np.testing.assert_allclose(
            g, w, rtol=1e-4, atol=max(5e-6 * np.abs(w).max(), 4 * r), err_msg=name
        )


# ----------------------------------------------------------------------------- kNN attention
def knn_pieces(name):
    """The pieces knn_attention retrieves and attends with: the plain ones, or the kernels'."""
    search, attend = {
        "plain": (mt.memory_search, mt.attend_to_retrieved),
        "kernels": (FAST.memory_search, kernels.attend_to_retrieved),
        "in terms": (FAST.memory_search, kernels.attend_in_terms),
    }[name]
    return mt.PLAIN._replace(memory_search=search, attend_to_retrieved=attend)


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    fill=st.sampled_from([0, 1, 5, 8, 32]),
    pieces=st.sampled_from(["plain", "kernels", "in terms"]),
)
def test_knn_attention_with_k_equal_to_valid_entries_equals_dense_attention(seed, fill, pieces):
    """Exact top-k with k = number of valid entries retrieves them all: dense softmax over them.
    With the plain pieces, and with the kernels' (the attention over the retrieved pairs in either
    form: einsums, or K terms as on a GPU)."""
    rng = np.random.default_rng(seed)
    cfg = SMALL.replace(exact_topk=True, num_neighbors=max(fill, 1))
    B, T, H, D, M = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.memory_size
    q = np_unit(rng.standard_normal((B, T, H, D))).astype(np.float32)
    mk = np_unit(rng.standard_normal((B, H, M, D))).astype(np.float32)
    mv = rng.standard_normal((B, H, M, D)).astype(np.float32)
    valid = np.zeros((B, M), bool)
    for b in range(B):
        valid[b, rng.choice(M, fill, replace=False)] = True
    scale = rng.uniform(1, 5, H).astype(np.float32)
    found = jax.jit(mt.knn_attention, static_argnums=(5, 6))(
        heads_first(q), mk, mv, valid, scale, cfg, knn_pieces(pieces)
    )
    out, has = found.out, found.has_memory
    lse = mt.masked_logsumexp(
        mt.retrieved_logits(heads_first(q), mk, found.slots, scale, cfg), found.valid
    )  # [B, H, T]: the joint combine's
    logits = np.einsum("bthd,bhmd->bhtm", q, mk) * scale[None, :, None, None]  # [B, H, T, M]
    w = np_softmax_masked(logits, valid[:, None, None, :])
    np.testing.assert_allclose(heads_first(out), np.einsum("bhtm,bhmd->bthd", w, mv), atol=1e-5)
    assert np.all(np.asarray(has) == (fill > 0))
    if fill:  # the log normalizer of the softmax over the valid slots (the joint combine's)
        held = np.where(valid[:, None, None, :], np.exp(logits.astype(np.float64)), 0)
        np.testing.assert_allclose(lse, np.log(held.sum(-1)), rtol=1e-5)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("pieces", ["plain", "kernels", "in terms"])
def test_knn_attention_gradients_equal_those_of_dense_attention(pieces):
    """With every valid slot retrieved, the gradients (queries, scale) are those of a dense softmax
    over the valid slots; none reach the memory (it is constant)."""
    rng = np.random.default_rng(11)
    cfg = SMALL.replace(exact_topk=True, num_neighbors=8)
    B, T, H, D, M = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.memory_size
    q = jnp.asarray(np_unit(rng.standard_normal((B, H, T, D))), jnp.float32)
    mk = jnp.asarray(np_unit(rng.standard_normal((B, H, M, D))), jnp.float32)
    mv = jnp.asarray(rng.standard_normal((B, H, M, D)), jnp.float32)
    valid = np.zeros((B, M), bool)
    valid[:, rng.choice(M, 8, replace=False)] = True
    scale = jnp.asarray(rng.uniform(1, 5, H), jnp.float32)
    r = jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)

    def dense(q, scale):
        logits = jnp.einsum("bhtd,bhmd->bhtm", q, mk) * scale[None, :, None, None]
        w = jax.nn.softmax(jnp.where(valid[:, None, None, :], logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhtm,bhmd->bhtd", w, mv)

    model = lambda q, scale: mt.knn_attention(q, mk, mv, valid, scale, cfg, knn_pieces(pieces)).out
    grads = [
        jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * r), argnums=(0, 1)))(q, scale)
        for f in (model, dense)
    ]
    for got, want, name in zip(*grads, ("q", "scale")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("pieces", ["plain", "kernels", "in terms"])
def test_the_joint_combine_is_one_softmax_over_retrieved_and_local_pairs_with_its_gradients(pieces):
    """memory_combine "joint": local attention, kNN attention and combine give what one softmax
    over [the retrieved pairs, logits + b_g; the local window's, with the T5 bias] gives, and the
    same gradients for q and the local keys and values. k = the valid slots: all retrieved."""
    rng = np.random.default_rng(12)
    cfg = SMALL.replace(exact_topk=True, num_neighbors=8, memory_combine="joint")
    B, T, H, D, M = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.memory_size
    unit = lambda *shape: jnp.asarray(np_unit(rng.standard_normal(shape)), jnp.float32)
    q, k, v, mk = unit(B, H, T, D), unit(B, H, 2 * T, D), unit(B, H, 2 * T, D), unit(B, H, M, D)
    mv = jnp.asarray(rng.standard_normal((B, H, M, D)), jnp.float32)
    mem_valid = np.zeros((B, M), bool)
    mem_valid[:, rng.choice(M, 8, replace=False)] = True
    key_valid = np.ones((B, 2 * T), bool)
    key_valid[1, :T] = False  # row 1 starts a document: no XL cache
    rel_bias = jnp.asarray(rng.standard_normal((cfg.num_buckets, H)), jnp.float32)
    scale = jnp.asarray(rng.uniform(1, 5, H), jnp.float32)
    gate_bias = jnp.asarray(rng.standard_normal(H), jnp.float32)
    r = jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)

    def model(q, k, v):
        out = mt.local_attention(q, k, v, key_valid, rel_bias, scale, cfg)
        found = mt.knn_attention(q, mk, mv, mem_valid, scale, cfg, knn_pieces(pieces))
        retrieved = mt.retrieved_logits(q, mk, found.slots, scale, cfg)  # [B, H, T, K]
        mem_lse = mt.masked_logsumexp(retrieved, found.valid)
        local_lse = mt.masked_logsumexp(*mt.local_logits(q, k, key_valid, rel_bias, scale, cfg))
        return mt.combine(out, found, gate_bias, cfg, (mem_lse, local_lse))

    def one_softmax(q, k, v):
        local, visible = mt.local_logits(q, k, key_valid, rel_bias, scale, cfg)  # [B, H, T, 2T]
        retrieved = jnp.einsum("bhtd,bhmd->bhtm", q, mk) * scale[None, :, None, None]
        logits = jnp.concatenate([retrieved + gate_bias[None, :, None, None], local], -1)
        seen = jnp.concatenate(
            [
                jnp.broadcast_to(mem_valid[:, None, None, :], retrieved.shape),
                jnp.broadcast_to(visible, local.shape),
            ],
            -1,
        )
        w = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhtm,bhmd->bhtd", w[..., :M], mv) + jnp.einsum(
            "bhts,bhsd->bhtd", w[..., M:], v
        )

    np.testing.assert_allclose(model(q, k, v), one_softmax(q, k, v), atol=1e-5, rtol=1e-5)
    grads = [
        jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * r), argnums=(0, 1, 2)))(q, k, v)
        for f in (model, one_softmax)
    ]
    for got, want, name in zip(*grads, ("q", "k", "v")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("pieces", ["plain", "kernels", "in terms"])
def test_knn_attention_on_empty_memory_is_finite_with_finite_gradients(pieces):
    cfg = SMALL
    B, T, H, D, M = 1, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.memory_size
    q = jnp.ones((B, H, T, D)) / math.sqrt(D)
    zeros = jnp.zeros((B, H, M, D))
    f = lambda q: mt.knn_attention(
        q, zeros, zeros, jnp.zeros((B, M), bool), jnp.ones(H), cfg, knn_pieces(pieces)
    ).out.sum()
    value, g = jax.jit(jax.value_and_grad(f))(q)
    assert np.isfinite(value) and np.all(np.isfinite(g))


# ----------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def params():
    return mt.init_params(SMALL, jax.random.PRNGKey(0))


def randomize(params, seed):
    """Non-trivial biases and gates, so that the tests see them."""
    rng = np.random.default_rng(seed)
    layers = [
        dict(
            p,
            rel_bias=jnp.asarray(rng.standard_normal(p["rel_bias"].shape), jnp.float32),
            **(
                {"gate_bias": jnp.asarray(rng.standard_normal(p["gate_bias"].shape), jnp.float32)}
                if "gate_bias" in p
                else {}
            ),
        )
        for p in params["layers"]
    ]
    return dict(params, layers=layers)


@pytest.mark.parametrize("ops", [mt.PLAIN, FAST, FUSED], ids=["plain", "fast", "fast-fused"])
@pytest.mark.parametrize("xl", [True, False])
def test_streaming_without_memory_equals_one_pass_with_banded_mask(xl, ops):
    cfg = SMALL.replace(memory_size=0, xl_cache=xl)
    params = randomize(mt.init_params(cfg, jax.random.PRNGKey(1)), 1)
    tokens = random_tokens(0, cfg, 2, 4)
    got, _ = stream(params, tokens, cfg, ops=ops)
    np.testing.assert_allclose(
        got, reference_forward(params, np.asarray(tokens), cfg), atol=2e-4, rtol=2e-4
    )


@OPS
@pytest.mark.parametrize("gate", [None, "memory", "local"])
@pytest.mark.parametrize("xl", [True, False])
def test_memory_streaming_equals_dense_attention_to_earlier_segments(params, gate, xl, ops):
    """The memory holds the whole document and k = M: the memory layer is dense block-causal."""
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size, xl_cache=xl)
    params = randomize(params, 2)
    if gate:  # b_g -> +inf gives memory-only attention, b_g -> -inf local-only
        layers = [
            dict(p, gate_bias=jnp.full_like(p["gate_bias"], 1e4 if gate == "memory" else -1e4))
            if "gate_bias" in p
            else p
            for p in params["layers"]
        ]
        params = dict(params, layers=layers)
    tokens = random_tokens(1, cfg, 2, cfg.memory_size // cfg.segment_length + 1)
    got, _ = stream(params, tokens, cfg, ops=ops)
    want = reference_forward(params, np.asarray(tokens), cfg, gate=gate)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)


@OPS
@pytest.mark.parametrize("combine", ["add", "joint"])
def test_the_add_and_joint_combines_equal_their_dense_references(params, combine, ops):
    """add: V_c + e^b_g V_m; joint: one softmax over the held keys (their logits + b_g) and the
    local window's (with the T5 bias). Twice the memory's length, with padding and eviction, k = M;
    b_g random."""
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size, memory_combine=combine)
    params = randomize(params, 7)
    tokens, mask, want = streamed_with_padding_and_eviction(params, cfg, ops, 14)
    gate = reference_forward(
        params, np.asarray(tokens), cfg.replace(memory_combine="gate"), mask=mask
    )
    assert np.max(np.abs(want[mask] - gate[mask])) > 1e-2  # another model than the gate's


def test_memory_streaming_with_fused_local_attention_equals_dense_attention(params):
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size)
    params = randomize(params, 3)
    tokens = random_tokens(4, cfg, 2, cfg.memory_size // cfg.segment_length + 1)
    got, _ = stream(params, tokens, cfg, ops=FUSED)
    np.testing.assert_allclose(
        got, reference_forward(params, np.asarray(tokens), cfg), atol=2e-4, rtol=2e-4
    )


@OPS
def test_two_memory_layers_each_equal_dense_attention_to_earlier_segments(ops):
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size, memory_layers=(0, 1))
    params = randomize(mt.init_params(cfg, jax.random.PRNGKey(5)), 5)
    tokens = random_tokens(2, cfg, 2, cfg.memory_size // cfg.segment_length + 1)
    got, state = stream(params, tokens, cfg, ops=ops)
    assert state.mem_k.shape[1] == 2
    np.testing.assert_allclose(
        got, reference_forward(params, np.asarray(tokens), cfg), atol=2e-4, rtol=2e-4
    )


def streamed_with_padding_and_eviction(params, cfg, ops, seed):
    """Twice the memory's length plus two segments of random tokens, padded as padded_document_mask
    says, streamed through forward and held to reference_forward on the valid positions. Returns
    the tokens, the mask and the reference's logits."""
    segments = 2 * cfg.memory_size // cfg.segment_length + 2
    tokens = random_tokens(seed, cfg, 2, segments)
    mask = padded_document_mask(cfg, segments)
    got, _ = stream(params, tokens, cfg, ops=ops, mask=mask)
    want = reference_forward(params, np.asarray(tokens), cfg, mask=mask)
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=2e-4, rtol=2e-4)
    return tokens, mask, want


def padded_document_mask(config, segments):
    """Row 0: a full memory, then an all-padding segment, then a partly padded one, then more;
    row 1: a partly padded segment early. [2, segments * T] bool."""
    T = config.segment_length
    mask = np.ones((2, segments * T), bool)
    full = config.memory_size // T
    mask[0, (full + 1) * T : (full + 2) * T] = False  # all padding, with the memory full
    mask[0, (full + 3) * T + 5 : (full + 4) * T] = False  # the tail of a segment
    mask[1, 2 * T + 3 : 3 * T] = False
    return mask


@OPS
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "binned"])
def test_memory_streaming_with_padding_and_eviction_equals_the_reference(params, ops, exact):
    """Twice the memory's length streamed through forward, so that the ring buffer drops its
    oldest segments, with padding (an all-padding segment while the memory is full). Exact:
    k = M, dense attention over what the memory holds. Binned: k = 2 of 32 slots in 16 bins of
    2 rows, the search's picks held to the reference's own binned top-k."""
    K = SMALL.memory_size if exact else 2
    cfg = SMALL.replace(exact_topk=exact, num_neighbors=K)
    assert exact or mt.bin_layout(K, cfg.memory_size, cfg.topk_recall_target)[1] > 1
    streamed_with_padding_and_eviction(randomize(params, 6), cfg, ops, 12)


# ------------------------------------------------------------- beyond the paper: crowded memories
def with_no_match(params, seed):
    """params with a random 'no match' logit in each memory layer (memory_no_match)."""
    rng = np.random.default_rng(seed)
    layers = [
        dict(p, no_match=jnp.asarray(rng.uniform(-1, 3, p["gate_bias"].shape), jnp.float32))
        if "gate_bias" in p
        else p
        for p in params["layers"]
    ]
    return dict(params, layers=layers)


@OPS
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "binned"])
def test_the_age_bias_ranks_and_weighs_each_slot_by_the_tokens_since_it_was_written(
    params, ops, exact
):
    """memory_age_bias beta: a slot's score, in the search and in the softmax over the retrieved
    pairs, is lowered by beta log2(1 + age / T), its age counted in slots written back from the
    query's segment (reference_memory). Twice the memory's length, with padding and eviction;
    exact with k = M, or binned with k = 2, whose picks the bias changes."""
    K = SMALL.memory_size if exact else 2
    cfg = SMALL.replace(exact_topk=exact, num_neighbors=K, memory_age_bias=0.8)
    params = randomize(params, 16)
    tokens, mask, want = streamed_with_padding_and_eviction(params, cfg, ops, 17)
    without = reference_forward(params, np.asarray(tokens), cfg.replace(memory_age_bias=0.0),
                                mask=mask)
    assert np.max(np.abs(want[mask] - without[mask])) > 1e-2  # the bias changes the model


@OPS
@pytest.mark.parametrize("combine", ["gate", "add"])
def test_the_no_match_logit_gives_its_share_of_the_retrieved_softmax_to_the_local_result(
    params, ops, combine
):
    """memory_no_match: one more logit, b_nm per head, in the softmax over the retrieved pairs,
    whose value is nothing: the retrieved result keeps the held pairs' share of it, and with the
    gate the rest goes back to the local result (reference_forward). k = M, with eviction."""
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size, memory_no_match=True,
                        memory_combine=combine)
    params = with_no_match(randomize(mt.init_params(cfg, jax.random.PRNGKey(8)), 8), 9)
    memory_layers = [p for p in params["layers"] if "gate_bias" in p]
    assert all(p["no_match"].shape == (cfg.num_heads,) for p in memory_layers)
    tokens, mask, want = streamed_with_padding_and_eviction(params, cfg, ops, 18)
    plain = cfg.replace(memory_no_match=False)
    assert np.max(np.abs(want - reference_forward(params, np.asarray(tokens), plain))) > 1e-2


@OPS
def test_without_the_memory_position_bias_the_memory_layer_attends_locally_without_t5(params, ops):
    """memory_position_bias False (meliad's 2025 memory configuration): the memory layer's local
    attention has no T5 bias; the other layers keep theirs."""
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size,
                        memory_position_bias=False)
    params = randomize(params, 19)
    tokens, mask, want = streamed_with_padding_and_eviction(params, cfg, ops, 20)
    kept = reference_forward(params, np.asarray(tokens), cfg.replace(memory_position_bias=True))
    assert np.max(np.abs(want - kept)) > 1e-2


@OPS
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "binned"])
def test_in_training_cross_batch_searches_the_next_rows_memories_as_one_memory(params, ops, exact):
    """cross_batch 2 (the Focused Transformer's cross-batch), in training (rng given): each row's
    search covers its memory and the next row's, which holds another document, as one memory of
    2 M slots, with the age bias; evaluation (rng None) searches the row's own. Exact:
    each held pair ranked exactly, k = M of them; binned: k = 2 of the 2 M slots, the
    reference's binned top-k."""
    K = SMALL.memory_size if exact else 2
    cfg = SMALL.replace(exact_topk=exact, num_neighbors=K, cross_batch=2, memory_age_bias=0.5)
    params = randomize(params, 21)
    segments = 2 * cfg.memory_size // cfg.segment_length + 2
    tokens = random_tokens(22, cfg, 2, segments)
    mask = padded_document_mask(cfg, segments)
    got, _ = stream(params, tokens, cfg, ops=ops, mask=mask, rng=jax.random.PRNGKey(0))
    want = reference_forward(params, np.asarray(tokens), cfg, mask=mask, rows=2)
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=2e-4, rtol=2e-4)
    own, _ = stream(params, tokens, cfg, ops=ops, mask=mask)
    alone = reference_forward(params, np.asarray(tokens), cfg, mask=mask)
    np.testing.assert_allclose(np.asarray(own)[mask], alone[mask], atol=2e-4, rtol=2e-4)
    assert np.max(np.abs(want[mask] - alone[mask])) > 1e-2  # the other row's memory counts


def test_with_other_rows_concatenates_each_rows_memory_with_the_next_ones_in_order():
    """Row b of the result holds rows b, b + 1, ..., b + d - 1 (mod B) along the slot axis."""
    x = np.arange(4 * 3 * 2).reshape(4, 3, 2)  # [B, M, 2]
    got = np.asarray(mt.with_other_rows(jnp.asarray(x), 3, axis=1))  # [B, 3 M, 2]
    for b in range(4):
        np.testing.assert_array_equal(got[b], np.concatenate([x[(b + o) % 4] for o in range(3)]))


def test_the_age_bias_is_minus_beta_log2_of_one_plus_the_age_over_t_from_the_write_position():
    """Explicit loops: slot s, with the write position p, was written (p - 1 - s) mod M + 1
    tokens before the segment that searches it."""
    cfg = SMALL.replace(memory_age_bias=0.7)
    M, T = cfg.memory_size, cfg.segment_length
    pos = jnp.asarray([0, T, 3 * T])
    got = np.asarray(mt.age_bias(pos, M, cfg))
    for b, p in enumerate([0, T, 3 * T]):
        for slot in range(M):
            age = (p - 1 - slot) % M + 1
            assert abs(got[b, slot] + 0.7 * math.log2(1 + age / T)) < 1e-5


@OPS
def test_an_all_padding_segment_costs_the_memory_nothing(params, ops):
    """A row that gets a segment with no valid token, and no reset, keeps every slot: the next
    call appends nothing and the write position stays."""
    cfg, T, M = SMALL, SMALL.segment_length, SMALL.memory_size
    segments = M // T + 1
    _, state = stream(params, random_tokens(13, cfg, 2, segments), cfg, ops=ops)
    full = mt.commit_memory(state, jnp.zeros(2, bool), cfg)
    assert np.asarray(full.mem_valid).sum(1).tolist() == [M, M]
    padding = jnp.asarray([[False] * T, [True] * T])
    _, state = forward(
        params, state, random_tokens(14, cfg, 2, 1), jnp.zeros(2, bool), cfg, mask=padding, ops=ops
    )
    _, state = forward(
        params, state, random_tokens(15, cfg, 2, 1), jnp.zeros(2, bool), cfg, ops=ops
    )
    assert np.asarray(state.mem_valid).sum(1).tolist() == [M, M]
    # Row 0's memory is the one it had when full: the padded segment took no slot.
    np.testing.assert_array_equal(state.mem_k[0], full.mem_k[0])
    assert np.asarray(state.mem_pos).tolist() == [
        int(full.mem_pos[0]),
        (int(full.mem_pos[1]) + T) % M,
    ]


@SETTINGS
@given(pos=st.integers(0, 4 * SMALL.segment_length - 1), seed=st.integers(0, 100))
def test_changing_a_later_token_never_changes_an_earlier_logit(params, pos, seed):
    # Bit-identical on purpose: a masked key weighs exactly 0 and adds exactly 0, so the same
    # program gives the same bits for the earlier positions on any deterministic backend.
    tokens = np.asarray(random_tokens(seed, SMALL, 2, 4))
    changed = tokens.copy()
    changed[:, pos] = (changed[:, pos] + 1) % SMALL.vocab_size
    a, _ = stream(params, jnp.asarray(tokens), SMALL, ops=FAST)
    b, _ = stream(params, jnp.asarray(changed), SMALL, ops=FAST)
    np.testing.assert_array_equal(a[:, :pos], b[:, :pos])
    assert not np.allclose(a[:, pos:], b[:, pos:])


@SETTINGS
@given(n=st.integers(1, 2 * SMALL.memory_size // SMALL.segment_length + 1))
def test_ring_buffer_keeps_the_last_m_entries_in_fifo_order(params, n):
    cfg, T, M = SMALL, SMALL.segment_length, SMALL.memory_size
    state = mt.init_state(cfg, 2)
    written = []  # the keys of each segment, read off the XL cache of the memory layer
    for i in range(n):
        tokens = random_tokens(100 + i, cfg, 2, 1)
        _, state = forward(params, state, tokens, jnp.full((2,), i == 0), cfg)
        written.append(np.asarray(state.prev_k[:, cfg.memory_layers[0]]))  # [B, H, T, D]
    # The last segment is pending until the next call appends it; commit it to see the memory.
    committed = mt.commit_memory(state, jnp.zeros(2, bool), cfg)
    mem_k, valid, pos = map(np.asarray, (committed.mem_k, committed.mem_valid, committed.mem_pos))
    assert valid.sum(1).tolist() == [min(n * T, M)] * 2
    slots_per_segment = M // T
    for age, keys in enumerate(reversed(written[-slots_per_segment:])):  # newest first
        start = ((n - 1 - age) * T) % M
        np.testing.assert_array_equal(mem_k[:, 0, :, start : start + T], keys)
        assert valid[:, start : start + T].all()
    assert pos.tolist() == [(n * T) % M] * 2
    # A reset clears only the flagged rows.
    _, state = forward(params, state, random_tokens(7, cfg, 2, 1), jnp.array([True, False]), cfg)
    valid = np.asarray(mt.commit_memory(state, jnp.zeros(2, bool), cfg).mem_valid)
    assert valid.sum(1).tolist() == [T, min((n + 1) * T, M)]


@pytest.mark.parametrize(
    "reset", [[False] * 4, [True, False, True, False], [False, False, False, True], [True] * 4]
)
def test_commit_memory_zeroes_exactly_the_reset_rows_and_appends_to_the_others(reset):
    """Ethics section: a reset row's memory is zeros, not only flagged invalid; the other rows
    keep every slot and get the last segment's memory-layer keys at their write position. Numpy
    reference."""
    cfg, T, M = SMALL, SMALL.segment_length, SMALL.memory_size
    rng = np.random.default_rng(5)
    state = mt.init_state(cfg, 4)
    draw = lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    pos = np.array([0, T, M - T, 2 * T]) % M
    state = state._replace(
        mem_k=draw(state.mem_k),
        mem_v=draw(state.mem_v),
        prev_k=draw(state.prev_k),
        prev_v=draw(state.prev_v),
        mem_valid=jnp.ones((4, M), bool),
        prev_valid=jnp.ones((4, T), bool),
        mem_pos=jnp.asarray(pos, jnp.int32),
    )
    got = jax.jit(mt.commit_memory, static_argnums=2)(state, jnp.asarray(reset), cfg)
    layer = cfg.memory_layers[0]
    for mem, prev, new in (
        (state.mem_k, state.prev_k, got.mem_k),
        (state.mem_v, state.prev_v, got.mem_v),
    ):
        want = np.array(mem)
        for b in range(4):
            if reset[b]:
                want[b] = 0
            else:
                want[b, 0, :, pos[b] : pos[b] + T] = prev[b, layer]
        np.testing.assert_array_equal(new, want)
    assert np.asarray(got.mem_pos).tolist() == [0 if r else (p + T) % M for r, p in zip(reset, pos)]


def test_the_train_step_updates_the_memory_where_it_lies_and_copies_none_of_it():
    """The compiled train step reads and writes the memory in place: its buffers are donated and
    aliased to the new state, and no copy of them (the keys in another layout for the search,
    say) is made. XLA's buffer assignment says so: the step's temporaries at M = 1024 are
    within 1/8 of the memory's growth in storage of those at M = 64, where one copy of the keys
    alone would add 1/2 of it. On a GPU this checks the GPU's program."""
    import train

    def compiled(M):
        c = SMALL.replace(num_layers=1, memory_layers=(0,), memory_size=M)
        params = jax.eval_shape(lambda: mt.init_params(c, jax.random.PRNGKey(0)))
        opt_state = jax.eval_shape(optimizer.make_optimizer(c)[0], params)
        state = jax.eval_shape(lambda: mt.init_state(c, c.batch_size))
        tokens = jax.ShapeDtypeStruct((c.batch_size, c.segment_length), jnp.int32)
        batch = {
            "tokens": tokens,
            "targets": tokens,
            "mask": jax.ShapeDtypeStruct(tokens.shape, bool),
            "reset": jax.ShapeDtypeStruct((c.batch_size,), bool),
        }
        # On a GPU, XLA then picks each matmul's kernel by its defaults, not by timing candidates
        # on the card, which could give one size a library matmul with its own workspace.
        step = (
            train.make_train_step(evaluation.step_config(c))
            .lower(params, opt_state, state, batch)
            .compile(compiler_options={"xla_gpu_autotune_level": 0})
        )
        storage = sum(
            x.size * x.dtype.itemsize for x in (state.mem_k, state.mem_v)
        )  # [B, Lm, H, M, D] each
        return step.memory_analysis(), storage

    (small, small_storage), (big, big_storage) = compiled(64), compiled(1024)
    assert big.alias_size_in_bytes >= big_storage  # donated: the new memory is the old one's buffer
    assert big.temp_size_in_bytes - small.temp_size_in_bytes < (big_storage - small_storage) / 8


def test_padding_is_never_stored_as_a_valid_entry(params):
    cfg = SMALL
    mask = np.ones((2, cfg.segment_length), bool)
    mask[0, 5:] = False
    _, state = forward(
        params,
        mt.init_state(cfg, 2),
        random_tokens(0, cfg, 2, 1),
        jnp.ones(2, bool),
        cfg,
        mask=jnp.asarray(mask),
    )
    valid = np.asarray(mt.commit_memory(state, jnp.zeros(2, bool), cfg).mem_valid)
    assert valid.sum(1).tolist() == [5, cfg.segment_length]
    assert np.asarray(state.prev_valid).sum(1).tolist() == [5, cfg.segment_length]


def test_a_reset_row_equals_a_fresh_state_and_rows_never_affect_each_other(params):
    # A batch of 2 against a batch of 1 are different programs (other matmul shapes, other
    # summation orders on a GPU): their agreement is a property of the math, so it is checked
    # to float32 precision, not bit for bit.
    cfg = SMALL
    history = random_tokens(3, cfg, 2, 5)  # fills the memory past wrap-around
    doc = random_tokens(4, cfg, 2, 3)
    _, state = stream(params, history, cfg, ops=FAST)
    # Row 0 starts a new document; row 1 continues its old one.
    logits, out = [], state
    for n in range(3):
        seg = doc[:, n * cfg.segment_length : (n + 1) * cfg.segment_length]
        lg, out = forward(params, out, seg, jnp.array([n == 0, False]), cfg, ops=FAST)
        logits.append(lg)
    logits = jnp.concatenate(logits, axis=1)
    fresh, _ = stream(params, doc[:1], cfg, ops=FAST)
    np.testing.assert_allclose(logits[0], fresh[0], atol=1e-5, rtol=1e-5)
    # Row 1 alone, with the same history, gives the same numbers as in the batch.
    alone, _ = stream(params, jnp.concatenate([history[1:], doc[1:]], axis=1), cfg, ops=FAST)
    np.testing.assert_allclose(logits[1], alone[0, history.shape[1] :], atol=1e-5, rtol=1e-5)


def test_no_gradient_flows_into_memory_or_cache_but_reaches_queries_gate_and_local_path(params):
    cfg = SMALL
    params = randomize(params, 3)
    tokens = random_tokens(5, cfg, 2, 3)
    _, state = stream(params, tokens[:, : 2 * cfg.segment_length], cfg, ops=FAST)
    seg = tokens[:, 2 * cfg.segment_length :]

    names = ("prev_k", "prev_v", "mem_k", "mem_v")

    def f(params, arrays):
        logits, _ = mt.forward(
            params, state._replace(**arrays), seg, jnp.zeros(2, bool), cfg, ops=FAST
        )
        return masked_loss(logits, seg, jnp.ones(seg.shape, bool))

    gp, gs = jax.jit(jax.grad(f, argnums=(0, 1)))(params, {n: getattr(state, n) for n in names})
    for name in names:
        assert not np.any(np.asarray(gs[name])), name
    mem_layer = gp["layers"][cfg.memory_layers[0]]
    for name in ("wq", "gate_bias", "rel_bias", "wk", "wv", "qk_scale"):
        assert np.any(np.asarray(mem_layer[name]) != 0), name


@pytest.mark.parametrize("combine", ["gate", "add", "joint"])
def test_memory_off_ablation_equals_local_only_reference(params, combine):
    cfg = SMALL.replace(exact_topk=True, num_neighbors=SMALL.memory_size, memory_combine=combine)
    params = randomize(params, 4)
    tokens = random_tokens(6, cfg, 2, 3)
    got, _ = stream(mt.memory_off(params), tokens, cfg, ops=FAST)
    local = reference_forward(params, np.asarray(tokens), SMALL.replace(memory_size=0))
    np.testing.assert_allclose(got, local, atol=2e-4, rtol=2e-4)


def test_dropout_zeroes_elements_at_its_rate_and_scales_the_others_to_keep_the_mean():
    x = np.random.default_rng(0).standard_normal((200, 500)).astype(np.float32)
    rate, n = 0.25, x.size
    out = np.asarray(jax.jit(mt.dropout, static_argnums=1)(x, rate, jax.random.PRNGKey(3)))
    zeroed = out == 0
    np.testing.assert_allclose(out[~zeroed], x[~zeroed] / np.float32(1 - rate), rtol=1e-6)
    assert abs(zeroed.sum() - rate * n) < 5 * math.sqrt(n * rate * (1 - rate))  # 5 sigma
    other = np.asarray(mt.dropout(x, rate, jax.random.PRNGKey(4))) == 0
    assert 0.1 < np.mean(zeroed != other) < 0.5  # another key, another mask (2 r (1 - r) apart)


@OPS
def test_dropout_drops_each_blocks_output_as_a_reference_that_multiplies_it_by_its_mask(ops):
    """One segment of a memory model (its memory empty, so the memory layer is local): with an
    rng, each block's output times 0 or 1 / (1 - rate), the masks from split(rng, 2 L) in the
    order attention, FFN of layer 0, then layer 1; without one, or at rate 0, nothing dropped."""
    cfg = SMALL.replace(dropout=0.3)
    params = randomize(mt.init_params(cfg, jax.random.PRNGKey(5)), 5)
    B, T, E = 2, cfg.segment_length, cfg.d_model
    tokens = random_tokens(1, cfg, B, 1)
    rng = jax.random.PRNGKey(9)
    state, reset = mt.init_state(cfg, B), jnp.ones(B, bool)
    dropped, _ = forward(params, state, tokens, reset, cfg, ops=ops, rng=rng)
    keys = jax.random.split(rng, 2 * cfg.num_layers)
    kept = [np.asarray(jax.random.bernoulli(k, 0.7, (B * T, E))).reshape(B, T, E) / 0.7
            for k in keys]
    want = reference_forward(params, np.asarray(tokens), cfg, kept=kept)
    np.testing.assert_allclose(dropped, want, atol=2e-4, rtol=2e-4)
    plain = reference_forward(params, np.asarray(tokens), cfg)
    assert np.abs(want - plain).max() > 0.1  # the masks matter
    for c, r in ((cfg, None), (cfg.replace(dropout=0.0), rng)):
        got, _ = forward(params, state, tokens, reset, c, ops=ops, rng=r)
        np.testing.assert_allclose(got, plain, atol=2e-4, rtol=2e-4)


def test_the_train_steps_dropout_draws_from_its_seed_and_step_count():
    """Dropout's masks are a function of (seed, the optimizer's step count): a step taken
    again from the same checkpoint draws the same masks (exact resume), another seed others;
    at rate 0 the seed changes nothing."""
    import train

    tokens = random_tokens(2, SMALL, SMALL.batch_size, 1)
    batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, 1),
             "mask": jnp.ones(tokens.shape, bool), "reset": jnp.ones(SMALL.batch_size, bool)}

    drop = SMALL.replace(dropout=0.5)
    steps = {c: train.make_train_step(evaluation.step_config(c)) for c in (SMALL, drop)}

    def loss(config, seed, count=0):  # one step from the same start; its buffers are donated
        params = mt.init_params(config, jax.random.PRNGKey(0))
        opt_state = optimizer.make_optimizer(config)[0](params)
        opt_state = dict(opt_state, count=opt_state["count"] + count)  # read before the update
        state = mt.init_state(config, config.batch_size)
        return float(steps[config](params, opt_state, state, batch, seed)[3]["loss"])

    assert loss(drop, 1) == loss(drop, 1) != loss(drop, 2)
    assert loss(drop, 1, count=1) != loss(drop, 1)  # the next step draws other masks
    assert loss(SMALL, 1) == loss(SMALL, 2) == loss(SMALL, 1, count=1) != loss(drop, 1)


def test_return_retrievals_gives_valid_slots_of_the_current_document(params):
    cfg = SMALL
    state = mt.init_state(cfg, 2)
    tokens = random_tokens(8, cfg, 2, 2)
    T = cfg.segment_length
    _, state = forward(params, state, tokens[:, :T], jnp.ones(2, bool), cfg)
    _, _, ret = forward(
        params, state, tokens[:, T:], jnp.zeros(2, bool), cfg, return_retrievals=True
    )
    (r,) = ret
    assert r["slots"].shape == (2, cfg.num_heads, T, cfg.num_neighbors)
    w = np.asarray(r["weights"])
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    # Only the first T slots are filled: a weight on any other slot would be a bug.
    assert np.all(np.where(w > 0, np.asarray(r["slots"]) < T, True))


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"memory_size": 100}, "multiple of segment_length"),
        ({"num_neighbors": 64, "memory_size": 32}, "num_neighbors"),
        ({"memory_layers": (2,)}, "out of range"),
        ({"memory_layers": ()}, "names no layer"),
        ({"d_model": 30, "num_heads": 4, "head_dim": 8}, "head_dim"),
        ({"segment_length": 0}, "segment_length"),
        ({"memory_size": -8}, "memory_size"),
        ({"dtype": "float16"}, "dtype"),
        ({"max_distance": 16}, "max_distance"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_config_rejects_bad_fields_with_a_clear_sentence(changes, field):
    with pytest.raises(ValueError, match=field):
        SMALL.replace(**changes)


def test_presets_are_valid_and_paper_matches_section_4_2():
    p = presets.PRESETS["paper"]
    assert (p.num_layers, p.d_model, p.num_heads, p.head_dim, p.d_ff, p.vocab_size) == (
        12,
        1024,
        8,
        128,
        4096,
        32768,
    )
    assert (p.segment_length, p.xl_cache, p.memory_layers, p.memory_size, p.num_neighbors) == (
        512,
        True,
        (8,),
        8192,
        32,
    )
    assert p.batch_size * p.segment_length == 2**17


def test_bfloat16_compute_and_memory_stay_close_to_float32(params):
    """Mixed precision: bf16 matmuls, activations and memory; fp32 params and softmax statistics."""
    params = randomize(params, 9)  # T5 tables and gates away from 0 and 0.5: their paths in bf16
    tokens = random_tokens(9, SMALL, 2, 3)
    want, _ = stream(params, tokens, SMALL)
    got, state = stream(params, tokens, SMALL.replace(dtype="bfloat16"))
    assert (
        got.dtype == jnp.float32 and state.mem_k.dtype == state.prev_k.dtype == jnp.bfloat16
    )  # as dtype
    assert (
        mt.init_state(SMALL.replace(dtype="bfloat16", memory_dtype="float32"), 1).mem_k.dtype
        == jnp.float32
    )
    assert np.all(np.isfinite(got))
    # bf16 keeps 8 bits of mantissa: logits agree to a few hundredths of their spread.
    assert (
        np.max(np.abs(np.asarray(got) - np.asarray(want))) < 0.1 * np.std(np.asarray(want)) + 0.05
    )


@functools.partial(jax.jit, static_argnames="ops")
@functools.partial(jax.value_and_grad, has_aux=True)
def loss_and_grad(params, state, tokens, reset, mask, ops):
    logits, _ = mt.forward(params, state, tokens, reset, SMALL, mask=mask, ops=ops)
    return masked_loss(logits, tokens, mask), logits


@SETTINGS
@given(
    history=st.integers(0, 3),
    reset=st.lists(st.booleans(), min_size=2, max_size=2),
    valid=st.lists(st.integers(0, SMALL.segment_length), min_size=2, max_size=2),
)
def test_fully_masked_rows_stay_finite_forward_and_backward(params, history, reset, valid):
    """A document's first token with an empty memory and cache, all-padding segments, any fill."""
    cfg = SMALL
    state = mt.init_state(cfg, 2)
    if history:
        _, state = stream(params, random_tokens(history, cfg, 2, history), cfg, ops=FAST)
    mask = jnp.arange(cfg.segment_length)[None, :] < jnp.asarray(valid)[:, None]  # [B, T]
    seg = random_tokens(11, cfg, 2, 1)

    (value, logits), grads = loss_and_grad(params, state, seg, jnp.asarray(reset), mask, ops=FAST)
    assert np.isfinite(value) and np.all(np.isfinite(logits))
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_a_secret_document_leaves_no_trace_in_the_next_documents_logits_or_retrievals(params):
    """Ethics section: the memory is cleared at each document. A then B in one row, or B alone."""
    cfg = SMALL
    T = cfg.segment_length
    secret, doc = random_tokens(20, cfg, 2, 5), random_tokens(21, cfg, 2, 3)

    def run_b(state):
        out = []
        for n in range(3):
            logits, state, (r,) = forward(
                params,
                state,
                doc[:, n * T : (n + 1) * T],
                jnp.full((2,), n == 0),
                cfg,
                return_retrievals=True,
                ops=FAST,
            )
            out.append((np.asarray(logits), np.asarray(r["slots"]), np.asarray(r["weights"])))
        return out

    _, after_secret = stream(params, secret, cfg, ops=FAST)
    with_a, without_a = run_b(after_secret), run_b(mt.init_state(cfg, 2))
    for n, ((la, sa, wa), (lb, sb, wb)) in enumerate(zip(with_a, without_a)):
        np.testing.assert_allclose(la, lb, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(wa, wb, atol=1e-6)
        # Every slot with weight holds an entry of B: B's first n segments fill slots [0, n T).
        assert np.all(np.where(wa > 0, sa < n * T, True))
        np.testing.assert_array_equal(np.where(wa > 0, sa, -1), np.where(wb > 0, sb, -1))

"""kernels.py: each drop-in equals the plain piece of memorizing_transformer.py it replaces, in
values and gradients (the memory search's kernel: test_memory_search.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import kernels
import memorizing_transformer as mt
from test_memorizing_transformer import (
    SETTINGS,
    SMALL,
    heads_first,
    local_attention_gradients,
    local_attention_loops,
    masked_loss,
    np_unit,
    random_tokens,
    randomize,
)

jax.config.update("jax_numpy_rank_promotion", "raise")  # shape mistakes fail loudly


# ----------------------------------------------------------------------------- local attention
def prefix_valid(rng, B, C, T):
    """key_valid [B, C + T] as data.py makes it, the fused attention's condition: in each row a
    random prefix of the cache and a random prefix of the segment are valid."""
    cache, segment = rng.integers(0, C + 1, (B, 1)), rng.integers(0, T + 1, (B, 1))
    return np.concatenate([np.arange(C) < cache, np.arange(T) < segment], axis=1)


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    xl=st.booleans(),
    reset=st.booleans(),
    attention=st.sampled_from(["explicit", "fused"]),
    blocks=st.sampled_from([1, 2, 4]),
)
def test_the_local_attention_kernel_equals_the_plain_one_and_explicit_loops(
    seed, xl, reset, attention, blocks
):
    """The queries in 1, 2 or 4 blocks (whichever a backend uses), or the fused call (with the
    masks it takes: prefixes of the cache and of the segment)."""
    rng = np.random.default_rng(seed)
    cfg = SMALL.replace(xl_cache=xl)
    B, T, H, D, C = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.cache_length
    q, k, v = (rng.standard_normal((B, n, H, D)).astype(np.float32) for n in (T, C + T, C + T))
    key_valid = prefix_valid(rng, B, C, T) if attention == "fused" else rng.random((B, C + T)) < 0.8
    key_valid[0, C:] = True
    if reset:
        key_valid[:, :C] = False
    bias = rng.standard_normal((cfg.num_buckets, H)).astype(np.float32)
    scale = rng.uniform(1, 5, H).astype(np.float32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "query_block", lambda T: T // blocks)
        local = kernels.fast(attention=attention).local_attention
        f = jax.jit(lambda *a: local(*a), static_argnums=6)  # traced anew: with this patch
        got = heads_first(f(*map(heads_first, (q, k, v)), key_valid, bias, scale, cfg))
    plain = heads_first(
        mt.local_attention(*map(heads_first, (q, k, v)), key_valid, bias, scale, cfg)
    )
    np.testing.assert_allclose(got, plain, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(
        got, local_attention_loops(q, k, v, key_valid, bias, scale, T), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize(
    "attention,blocks", [("explicit", 1), ("explicit", 2), ("explicit", 4), ("fused", None)]
)
def test_the_local_attention_kernels_gradients_are_the_plain_ones_and_none_for_the_cache(
    attention, blocks, monkeypatch
):
    """Against one dense masked softmax in float64, as the plain local attention's are: the
    queries, the segment's keys and values, the bias table and the scale. The cache is a constant
    (forward stops its gradient): the kernel computes none for it, exactly 0."""
    if blocks:
        monkeypatch.setattr(kernels, "query_block", lambda T: T // blocks)
    cfg, local = SMALL, kernels.fast(attention=attention).local_attention
    C, T = cfg.cache_length, cfg.segment_length
    key_valid = (
        prefix_valid(np.random.default_rng(7), 2, C, T)
        if attention == "fused"
        else np.random.default_rng(8).random((2, C + T)) < 0.8
    )
    key_valid = jnp.asarray(key_valid).at[:, C:].set(True)
    model = lambda q, k, v, bias, scale: heads_first(
        local(*map(heads_first, (q, k, v)), key_valid, bias, scale, cfg)
    )
    got, want, rounding = local_attention_gradients(model, key_valid, cfg)
    for g, w, r, name in zip(got, want, rounding, ("q", "k", "v", "rel_bias", "scale")):
        if name in ("k", "v"):
            assert np.all(np.asarray(g)[:, :C] == 0) and np.abs(w[:, :C]).max() > 0.1, name
            g, w = g[:, C:], w[:, C:]
        np.testing.assert_allclose(
            g, w, rtol=1e-4, atol=max(5e-6 * np.abs(w).max(), 4 * r), err_msg=name
        )


@pytest.mark.parametrize(
    "shapes", [((3, 5, 7), (3, 5, 2)), ((3, 5, 2), (3, 5, 7)), ((6, 4), (6, 4))]
)
def test_transpose_product_equals_a_transposed_times_b(shapes):
    """a^T b for a batch of [K, M] and [K, N]: either operand the smaller (the two ways it is
    computed on a CPU) or both the same size."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    got = jax.jit(kernels.transpose_product)(a, b)
    np.testing.assert_allclose(
        got, np.swapaxes(a, -1, -2).astype(np.float64) @ b, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "name,constant", [("product_qk", 0), ("product_qk", 3), ("product_pv", 0), ("product_pv", 3)]
)
def test_the_attention_products_with_their_own_gradients_equal_numpy_products_and_gradients(
    name, constant
):
    """The local attention kernel's two products have hand-written gradients (the transposed
    products as transpose_products): the values and both gradients of sum(f(a, b) * r) against
    numpy's, with a, b of distinct sizes so that a swapped or transposed operand cannot pass; the
    first `constant` rows of b (the cache's keys, values) get 0, numpy's gradient elsewhere."""
    rng = np.random.default_rng(1)
    Q, W, D = 5, 7, 3
    shapes, f, ref, grads = {
        "product_qk": (
            ((2, Q, D), (2, W, D)),
            lambda a, b: kernels.product_qk(a, b, None, constant),
            lambda a, b: a @ np.swapaxes(b, -1, -2),
            lambda a, b, r: (r @ b, np.swapaxes(r, -1, -2) @ a),
        ),
        "product_pv": (
            ((2, Q, W), (2, W, D)),
            lambda a, b: kernels.product_pv(a, b, None, constant),
            lambda a, b: a @ b,
            lambda a, b, r: (r @ np.swapaxes(b, -1, -2), np.swapaxes(a, -1, -2) @ r),
        ),
    }[name]
    a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    r = rng.standard_normal(ref(a, b).shape)
    value, (da, db) = jax.jit(
        jax.value_and_grad(lambda a, b: jnp.sum(f(a, b) * r), argnums=(0, 1))
    )(a, b)
    np.testing.assert_allclose(value, np.sum(ref(a64, b64) * r), rtol=1e-5)
    want_a, want_b = grads(a64, b64, r)
    want_b[..., :constant, :] = 0
    for got, want in zip((da, db), (want_a, want_b)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("one_hot", [False, True])
def test_position_bias_and_its_gradient_equal_a_lookup_and_a_sum_per_bucket(one_hot):
    """Both forms of the T5 bias lookup (a gather; a one-hot product, a GPU's): the values are the
    table's entries, the gradient of each entry the sum over its pairs."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((32, 4)).astype(np.float32)  # [num_buckets, H]
    buckets = rng.integers(0, 32, (3, 16, 24))  # e.g. [n, Q, W]; bucket 31 may be absent
    upstream = rng.standard_normal((4, 3, 16, 24)).astype(np.float32)  # [H, ...]
    lookup = lambda t: kernels.position_bias(t, buckets, one_hot)
    got, grad = jax.jit(
        lambda t: (lookup(t), jax.grad(lambda t: jnp.sum(lookup(t) * upstream))(t))
    )(jnp.asarray(table))
    np.testing.assert_array_equal(got, np.moveaxis(table[buckets], -1, 0))
    want = np.zeros((32, 4))
    for idx in np.ndindex(buckets.shape):
        want[buckets[idx]] += upstream[(slice(None),) + idx]
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind",
    [
        "prefixes",
        "hole in the segment",
        "hole in the cache",
        "cache valid only at its end",
        "random",
    ],
)
def test_the_fused_attention_equals_the_plain_one_under_jit_for_any_mask(kind):
    """Its key lengths are exact only when the segment's and the cache's valid keys are prefixes;
    under jit, with a mask of any other kind, it still gives the plain attention's values and
    gradients (it takes the plain form for such a batch)."""
    cfg = SMALL
    B, T, H, D, C = 3, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.cache_length
    rng = np.random.default_rng(13)
    q, k, v = (
        jnp.asarray(rng.standard_normal((B, H, n, D)), jnp.float32) for n in (T, C + T, C + T)
    )
    rel_bias = jnp.asarray(rng.standard_normal((cfg.num_buckets, H)), jnp.float32)
    scale = jnp.asarray(rng.uniform(1, 3, H), jnp.float32)
    cache = np.arange(C)[None] < np.array([[C], [5], [0]])  # [B, C] prefixes
    segment = np.arange(T)[None] < np.array([[T], [3], [6]])  # [B, T] prefixes
    if kind == "hole in the segment":
        segment[0, 2] = False
    elif kind == "hole in the cache":
        cache[0, 1] = False
    elif kind == "cache valid only at its end":
        cache[1] = np.arange(C) >= C - 3
    elif kind == "random":
        cache, segment = rng.random((B, C)) < 0.6, rng.random((B, T)) < 0.6
    key_valid = jnp.asarray(np.concatenate([cache, segment], axis=1))
    r = jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)

    def value_and_grads(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v, key_valid, rel_bias, scale, cfg) * r)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (got, got_grads), (want, want_grads) = map(
        value_and_grads, (kernels.fused_local_attention, mt.local_attention)
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(
            g[:, :, C:] if g.shape[2] > T else g,
            w[:, :, C:] if w.shape[2] > T else w,
            rtol=1e-4,
            atol=1e-5,
        )


@pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="cuDNN's fused attention needs an NVIDIA GPU"
)
def test_cudnn_fused_attention_in_bfloat16_stays_close_to_the_plain_one_in_float32():
    """On a GPU, --attention fused with bfloat16 runs cuDNN's kernel (bf16 inputs and bias): its
    output and gradients stay within bf16 rounding of the plain float32 math."""
    rng = np.random.default_rng(3)
    cfg = SMALL.replace(segment_length=64, head_dim=64, num_heads=2, d_model=128, memory_size=0)
    B, T, H, D, C = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.cache_length
    q, k, v = (
        mt.l2_normalize(jnp.asarray(rng.standard_normal((B, H, n, D)), jnp.float32))
        for n in (T, C + T, C + T)
    )
    # Row 0: a part of its cache; row 1: no cache (a reset) and padding at its end.
    key_valid = jnp.asarray(
        np.concatenate([np.arange(C) < [[C - 5], [0]], np.arange(T) < [[T], [T - 7]]], 1)
    )
    bias = jnp.asarray(rng.standard_normal((cfg.num_buckets, H)), jnp.float32)
    scale = jnp.asarray(rng.uniform(1, 5, H), jnp.float32)
    r = jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)
    assert kernels.fused_implementation(jnp.bfloat16, T, C + T, D) == "cudnn"
    assert kernels.fused_implementation(jnp.bfloat16, T + 1, C + T + 1, D) == "xla"
    assert kernels.fused_implementation(jnp.float32, T, C + T, D) == "xla"

    def run(attention, dt):
        f = lambda q, k, v, bias: jnp.sum(
            attention(q.astype(dt), k.astype(dt), v.astype(dt), key_valid, bias, scale, cfg).astype(
                jnp.float32
            )
            * r
        )
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(q, k, v, bias)

    (want, want_grads), (got, got_grads) = (
        run(mt.local_attention, jnp.float32),
        run(kernels.fused_local_attention, jnp.bfloat16),
    )
    np.testing.assert_allclose(
        got, want, rtol=0.02, atol=0.02 * float(jnp.sum(jnp.abs(r))) / r.size**0.5
    )
    for g, w, name in zip(got_grads, want_grads, ("q", "k", "v", "rel_bias")):
        if name in ("k", "v"):  # the cache is a constant: the kernel computes no gradient for it
            g, w = g[:, :, C:], w[:, :, C:]
        err = float(jnp.linalg.norm(g.astype(jnp.float32) - w)) / float(jnp.linalg.norm(w))
        assert err < 0.03, (name, err)  # bf16 keeps 8 bits of mantissa: ~0.4% per rounding


# --------------------------------------------------------------- attention over the retrieved pairs
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_attention_over_retrieved_pairs_in_terms_equals_the_plain_one_with_its_gradients(dtype):
    """K terms, each a product with one gathered row of the memory (a GPU's form), against the
    plain gathers and einsums: the output, the weights, has_memory, and the gradients of the
    queries and the scale; some queries with no valid slot, some slots retrieved twice."""
    rng = np.random.default_rng(4)
    cfg = SMALL.replace(dtype=dtype)
    B, T, H, D, M, K = (
        2,
        cfg.segment_length,
        cfg.num_heads,
        cfg.head_dim,
        cfg.memory_size,
        cfg.num_neighbors,
    )
    q = jnp.asarray(np_unit(rng.standard_normal((B, H, T, D))), dtype)
    mk = jnp.asarray(np_unit(rng.standard_normal((B, H, M, D))), dtype)
    mv = jnp.asarray(rng.standard_normal((B, H, M, D)), dtype)
    slots = jnp.asarray(rng.integers(0, M, (B, H, T, K)))
    valid = rng.random((B, H, T, K)) < 0.7
    valid[0, 0, :3] = False
    scale = jnp.asarray(rng.uniform(1, 5, H), jnp.float32)
    r = jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.float32)

    def run(attend):
        f = lambda q, scale: attend(q, mk, mv, slots, jnp.asarray(valid), scale, cfg)
        loss = lambda q, scale: jnp.sum(f(q, scale)[0].astype(jnp.float32) * r)
        return jax.jit(f)(q, scale), jax.jit(jax.grad(loss, argnums=(0, 1)))(q, scale)

    (want, want_grads), (got, got_grads) = run(mt.attend_to_retrieved), run(kernels.attend_in_terms)
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]  # a bf16 output rounds to 8 bits either way
    for g, w, name in zip(
        got + got_grads, want + want_grads, ("out", "weights", "has_memory", "q", "scale")
    ):
        np.testing.assert_allclose(
            np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol, err_msg=name
        )
    assert not np.any(np.asarray(got[0])[0, 0, :3]) and not np.any(np.asarray(got[2])[0, 0, :3])


# ----------------------------------------------------------------------------- the whole model
@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_the_kernels_in_bfloat16_stay_within_bfloat16_rounding_of_the_plain_pieces(attention):
    """--dtype bfloat16 with kernels.fast against mt.PLAIN in bfloat16, on a CPU as anywhere:
    random T5 tables and gates, so that the bias and gate paths are used, a reset and padding.
    Each computes in its own order, so they agree to bf16's 8 bits, not bit for bit."""
    cfg = SMALL.replace(exact_topk=True, dtype="bfloat16")
    fast = kernels.fast(cfg.memory_chunk, attention)
    params = randomize(mt.init_params(cfg, jax.random.PRNGKey(4)), 4)
    tokens, T = random_tokens(5, cfg, 2, 4), cfg.segment_length
    mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [T - 3]]))

    @jax.jit
    def segment(params, state, tokens, reset):
        def loss(params, ops):
            logits, new = mt.forward(params, state, tokens, reset, cfg, mask=mask, ops=ops)
            return masked_loss(logits, tokens, mask), (logits, new)

        grad = jax.value_and_grad(loss, has_aux=True)
        return [grad(params, ops) for ops in (mt.PLAIN, fast)]

    state = mt.init_state(cfg, 2)
    for n in range(4):
        reset = jnp.asarray([n == 0, n == 2])
        ((_, (want, state)), want_grads), ((_, (got, _)), got_grads) = segment(
            params, state, tokens[:, n * T : (n + 1) * T], reset
        )
        spread = float(np.std(np.asarray(want)))
        assert np.max(np.abs(np.asarray(got) - np.asarray(want))) < 0.05 * spread
        # Each leaf's gradient to a few bf16 roundings of its norm; a vector's (a scale's, a
        # gate's: a sum over every token of products of bf16 values) is the noisiest.
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            error = float(jnp.linalg.norm(g - w) / (jnp.linalg.norm(w) + 1e-12))
            assert error < (0.25 if w.ndim == 1 else 0.05), (w.shape, error)


@pytest.mark.parametrize("attention", ["explicit", "fused"])
def test_forward_with_the_kernels_equals_forward_with_the_plain_pieces_and_so_do_its_gradients(
    attention,
):
    """kernels.fast against mt.PLAIN over a document of several segments (exact top-k, so that both
    retrieve the same pairs), a reset and padding: the logits, the state, and the loss's
    gradients."""
    cfg = SMALL.replace(exact_topk=True)
    fast = kernels.fast(cfg.memory_chunk, attention)
    params = randomize(mt.init_params(cfg, jax.random.PRNGKey(2)), 2)
    tokens, T = random_tokens(3, cfg, 2, 5), cfg.segment_length
    mask = np.ones((2, T), bool)
    mask[1, T - 3 :] = False  # padding at a segment's end, as data.py makes it

    @jax.jit
    def segment(params, state, tokens, reset):
        def loss(params, ops):
            logits, new = mt.forward(
                params, state, tokens, reset, cfg, mask=jnp.asarray(mask), ops=ops
            )
            return masked_loss(logits, tokens, jnp.asarray(mask)), (logits, new)

        return [jax.value_and_grad(loss, has_aux=True)(params, ops) for ops in (mt.PLAIN, fast)]

    state = mt.init_state(cfg, 2)
    for n in range(5):
        reset = jnp.asarray([n == 0, n == 3])
        ((l1, (logits1, state1)), g1), ((l2, (logits2, state2)), g2) = segment(
            params, state, tokens[:, n * T : (n + 1) * T], reset
        )
        np.testing.assert_allclose(logits2, logits1, atol=2e-5, rtol=2e-5)
        for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state1)):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
        for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
            np.testing.assert_allclose(a, b, atol=2e-5 * float(jnp.abs(b).max()) + 1e-7, rtol=1e-3)
        state = state1

"""Sec. 3.3, the memory search: the plain mt.memory_search (exact, and binned: each bin's best slot,
then the top-k of the bins' winners) and kernels.memory_search (in pieces, each bin's best score
packed with its row in one int32, the top-k in passes on a CPU), each against numpy: a sort,
explicit loops over the slots; and the binned search's recall against the exact one.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import kernels
import memorizing_transformer as mt
import presets
from test_memorizing_transformer import SETTINGS, SMALL, heads_first, np_unit

jax.config.update("jax_numpy_rank_promotion", "raise")  # shape mistakes fail loudly
SEARCHES = {
    "plain": mt.memory_search,
    "kernel": kernels.memory_search,
    "kernel_by_row": functools.partial(kernels.memory_search, batch_block=1),  # batch row by row
}


def search(name, q, mk, valid, cfg, bias=None):
    """SEARCHES[name] of q [B, T, H, D] (the references' layout), jitted: numpy scores and slots.
    bias [B, M]: added to every slot's score."""
    f = SEARCHES[name]
    f = f if name == "plain" else functools.partial(f, chunk=cfg.memory_chunk)  # cfg's pieces
    f = jax.jit(f, static_argnums=4)
    scale = jnp.ones(q.shape[2])
    return tuple(map(np.asarray, f(heads_first(q), mk, valid, scale, cfg, bias=bias)))


# ----------------------------------------------------------------------------- exact search
@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    fill=st.sampled_from([8, 20, 64]),
    name=st.sampled_from(sorted(SEARCHES)),
)
def test_exact_memory_search_equals_numpy_top_k(seed, fill, name):
    """The kernel's in pieces of 16 slots: each piece's top-k are candidates for the top-k of
    all. Each slot's score has its bias added (the age bias)."""
    rng = np.random.default_rng(seed)
    cfg = SMALL.replace(exact_topk=True, memory_size=64, memory_chunk=16)
    B, T, H, D, M, K = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, 64, cfg.num_neighbors
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    mk = rng.standard_normal((B, H, M, D)).astype(np.float32)
    valid = np.zeros((B, M), bool)
    valid[:, rng.choice(M, fill, replace=False)] = True
    bias = rng.uniform(-2, 0, (B, M)).astype(np.float32)
    scores, slots = search(name, q, mk, valid, cfg, bias)
    s = np.einsum("bthd,bhmd->bhtm", q, mk) + bias[:, None, None, :]
    s = np.where(valid[:, None, None, :], s, -np.inf)
    want = np.sort(s, axis=-1)[..., ::-1][..., :K]
    got = np.where(
        np.take_along_axis(np.broadcast_to(valid[:, None, None, :], s.shape), slots, -1),
        scores,
        -np.inf,
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The slots are the ones holding those scores.
    np.testing.assert_allclose(
        np.take_along_axis(s, slots, -1)[..., : min(K, fill)],
        want[..., : min(K, fill)],
        rtol=1e-5,
        atol=1e-5,
    )


# ----------------------------------------------------------------------------- approximate top-k
def integer_search(rng, cfg, fill, name, biased=False):
    """The binned search of two batch rows with `fill` valid slots (the same in both), on small
    integer queries and keys: integer scores, many of them equal, which no key rounds; biased: a
    small integer bias for each slot. Returns its scores and slots [B, H, T, K], and numpy's
    scores [B, H, T, M] (-inf where invalid)."""
    B, T, H, D, M = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, cfg.memory_size
    q = rng.integers(-2, 3, (B, T, H, D)).astype(np.float32)
    mk = rng.integers(-2, 3, (B, H, M, D)).astype(np.float32)
    valid = np.zeros((B, M), bool)
    valid[:, rng.choice(M, fill, replace=False)] = True
    bias = rng.integers(-3, 1, (B, M)).astype(np.float32) if biased else None
    scores, slots = search(name, q, mk, valid, cfg, bias)
    s = np.einsum("bthd,bhmd->bhtm", q, mk) + (0 if bias is None else bias[:, None, None, :])
    return scores, slots, np.where(valid[:, None, None, :], s, -np.inf)


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    fill=st.sampled_from([8, 20, 64]),
    name=st.sampled_from(sorted(SEARCHES)),
)
def test_binned_memory_search_with_one_slot_per_bin_is_the_exact_top_k(seed, fill, name):
    """M = 64 <= num_topk_bins: every slot is a bin of its own. Integer scores, many of them equal:
    the exact top-k, the lower slot first among equal scores (as a stable sort)."""
    cfg = SMALL.replace(memory_size=64, memory_chunk=16)
    M, K = cfg.memory_size, cfg.num_neighbors
    assert mt.num_topk_bins(K, M, cfg.topk_recall_target) == M
    scores, slots, s = integer_search(np.random.default_rng(seed), cfg, fill, name)
    n = min(K, fill)
    np.testing.assert_array_equal(slots[..., :n], np.argsort(-s, axis=-1, kind="stable")[..., :n])
    np.testing.assert_array_equal(scores[..., :n], np.sort(s, axis=-1)[..., ::-1][..., :n])


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    fill=st.sampled_from([5, 40, 300, 1024]),
    chunk=st.sampled_from([4, 32, 512]),
    name=st.sampled_from(sorted(SEARCHES)),
    biased=st.booleans(),
)
@example(seed=2, fill=1024, chunk=512, name="kernel", biased=False)  # pieces of 4 whole rows
@example(seed=3, fill=300, chunk=32, name="kernel", biased=True)
def test_binned_memory_search_equals_numpy_top_k_of_interleaved_bin_maxima(
    seed, fill, chunk, name, biased
):
    """Slot s is in bin s mod G; the answer is the exact top-k of the G bins' best valid slots, the
    lower bin first among equal maxima, and of a bin's equal best slots the lowest (integer scores,
    many of them equal, which no key rounds). The memory is 8 rows of G = 128 slots; the kernel
    scores it in pieces of 4 or 32 slots of one row, or of 4 whole rows. biased: each slot's score
    has its bias added (the age bias), in the search and in the scores returned."""
    cfg = SMALL.replace(memory_size=1024, memory_chunk=chunk)
    B, T, H, M, K = 2, cfg.segment_length, cfg.num_heads, cfg.memory_size, cfg.num_neighbors
    G = mt.num_topk_bins(K, M, cfg.topk_recall_target)
    assert G == 128  # bins of 8 slots
    scores, slots, s = integer_search(np.random.default_rng(seed), cfg, fill, name, biased)
    valid = np.isfinite(s[:, 0, 0])  # [B, M]
    best, best_slot = np.full((B, H, T, G), -np.inf), np.zeros((B, H, T, G), int)
    for slot in range(
        M
    ):  # the bins' maxima, one slot at a time: the first slot of a bin's best score
        better = s[..., slot] > best[..., slot % G]
        best[..., slot % G] = np.where(better, s[..., slot], best[..., slot % G])
        best_slot[..., slot % G] = np.where(better, slot, best_slot[..., slot % G])
    found = min([K] + [len(set(np.flatnonzero(v) % G)) for v in valid])  # bins holding a valid slot
    want = np.argsort(-best, axis=-1, kind="stable")[
        ..., :found
    ]  # the best bins, the lower one first among equals
    np.testing.assert_array_equal(slots[..., :found], np.take_along_axis(best_slot, want, -1))
    np.testing.assert_array_equal(scores[..., :found], np.take_along_axis(best, want, -1))


def test_the_kernels_binned_search_ranks_float32_scores_to_their_leading_mantissa_bits():
    """The kernel's top-k ranks keys whose low log2(G) bits hold the bin (6 bits for G = 64), so
    float32 scores are ranked to their leading 17 mantissa bits. Every query sees the same scores
    (q = e_0, scores = the keys' first entries): random ones, some slots with a twin 1.5 * 2^-17 or
    2^-22 of its score above it. Any two slots, kept and ranked after it or left out, are in order
    up to 2^-16 of their scores, and the 1.5 * 2^-17 twins always (one bit fewer would tie some)."""
    rng = np.random.default_rng(0)
    cfg = SMALL.replace(memory_size=64, memory_chunk=16)
    B, T, H, D, M, K = 2, cfg.segment_length, cfg.num_heads, cfg.head_dim, 64, cfg.num_neighbors
    first = rng.standard_normal((B, H, M)) + 1.0
    first[..., :39] += 3 * (np.arange(39) % 3 < 2)  # the pairs that get twins: near the top
    first[..., 1:40:3] = first[..., 0:39:3] * (1 + 1.5 * 2.0**-17)  # twins above their neighbour
    first[..., 41:64:2] = first[..., 40:63:2] * (1 + 2.0**-22)
    mk = rng.standard_normal((B, H, M, D)).astype(np.float32)
    mk[..., 0] = first
    q = np.zeros((B, T, H, D), np.float32)
    q[..., 0] = 1.0
    scores, slots = search("kernel", q, mk, np.ones((B, M), bool), cfg)
    s = np.einsum("bthd,bhmd->bhtm", q, mk)  # [B, H, T, M], exact in float32
    np.testing.assert_array_equal(
        scores, np.take_along_axis(s, slots, -1)
    )  # one slot a bin: no bits lost
    tol = lambda a, b: 2.0**-16 * np.maximum(abs(a), abs(b))
    pairs = 0
    for row_s, row_slots in zip(s.reshape(-1, M), slots.reshape(-1, K)):
        assert len(set(row_slots.tolist())) == K
        kept = row_s[row_slots]
        assert np.all(kept[:-1] >= kept[1:] - tol(kept[:-1], kept[1:]))  # in order
        left = np.delete(row_s, row_slots)
        assert left.max() <= kept[-1] + tol(left.max(), kept[-1])  # none left out was better
        rank = {slot: r for r, slot in enumerate(row_slots.tolist())}
        twins = [i for i in range(0, 39, 3) if i in rank and i + 1 in rank]
        assert all(rank[i + 1] < rank[i] for i in twins)  # the upper one first
        pairs += len(twins)
    assert pairs >= B * H * T  # a few pairs in every row


@SETTINGS
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(3, 5, 16), (7, 16), (2, 40), (4, 3, 96), (2, 3, 512), (2, 600)]),
    k=st.sampled_from([1, 5, 16]),
)
@example(seed=0, shape=(7, 16), k=5)  # 7 rows in blocks of 4: the last block padded
def test_top_k_of_distinct_keys_equals_a_numpy_sort(seed, shape, k):
    """The top-k of the bins' winners: the k largest of each row's distinct int32 keys, largest
    first. In passes (a CPU's way) for rows of any length, in blocks of one row, of a few rows (the
    last one padded where they do not divide) or all rows; and by top_k, the backend's way. The
    keys of the largest and smallest floats among them."""
    rng = np.random.default_rng(seed)
    x = (
        np.stack(
            [
                rng.choice(
                    np.arange(-(2**20), 2**20), shape[-1], replace=False
                )  # distinct within a row
                for _ in range(int(np.prod(shape[:-1])))
            ]
        )
        .reshape(shape)
        .astype(np.int32)
    )
    x[..., 0] -= 2**30  # far below the rest, as the keys of invalid slots' scores are
    x.reshape(-1, shape[-1])[0, :2] = kernels._pack(
        jnp.asarray([-3.4e38, 3.4e38], jnp.float32), 0, 0
    )
    want = -np.sort(-x.astype(np.int64), axis=-1)[..., :k]
    for block in [16, 64, 2**21]:
        got = jax.jit(kernels.top_k_in_passes, static_argnums=(1, 2))(jnp.asarray(x), k, block)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jax.jit(kernels.top_k, static_argnums=1)(jnp.asarray(x), k), want)
    with pytest.raises(ValueError, match="exceeds"):
        kernels.top_k_in_passes(jnp.asarray(x), shape[-1] + 1)


def test_the_bin_layout_has_rows_of_a_power_of_two_the_largest_that_leaves_enough_bins():
    """bin_layout: M = rows * G, rows a power of two dividing M, G at least num_topk_bins, and no
    larger power of two would do; G = num_topk_bins where M is a power of two."""
    for k, m in [
        (8, 64),
        (32, 512),
        (32, 768),
        (32, 1024),
        (32, 8192),
        (32, 3 * 2**12),
        (32, 65536),
        (4, 40),
    ]:
        need = mt.num_topk_bins(k, m, 0.95)
        G, rows = mt.bin_layout(k, m, 0.95)
        assert G * rows == m and rows & (rows - 1) == 0 and G >= need
        assert m % (2 * rows) or m // (2 * rows) < need  # the largest such rows
        if m & (m - 1) == 0:
            assert G == need
    assert mt.bin_layout(32, 768, 0.95) == (768, 1) and mt.bin_layout(32, 3 * 2**12, 0.95) == (
        768,
        16,
    )


@pytest.mark.parametrize("name", sorted(SEARCHES))
@pytest.mark.parametrize("target", [0.05, 0.3, 0.95])
def test_a_low_recall_target_still_leaves_k_bins_and_finds_each_bins_best_slot(target, name):
    """Fewer bins than neighbours would leave fewer winners than k: num_topk_bins never goes below
    k, and with every slot valid the answer is the k best bins' maxima."""
    for k, m in [(1, 8), (8, 32), (32, 512), (32, 65536), (24, 40)]:
        assert min(k, m) <= mt.num_topk_bins(k, m, target) <= m
    cfg = SMALL.replace(topk_recall_target=target)
    B, T, H, D, M, K = (
        2,
        cfg.segment_length,
        cfg.num_heads,
        cfg.head_dim,
        cfg.memory_size,
        cfg.num_neighbors,
    )
    G = mt.num_topk_bins(K, M, target)
    rng = np.random.default_rng(0)
    q = rng.integers(-2, 3, (B, T, H, D)).astype(np.float32)  # integer scores: exact keys
    mk = rng.integers(-2, 3, (B, H, M, D)).astype(np.float32)
    scores, slots = search(name, q, mk, np.ones((B, M), bool), cfg)
    s = np.einsum("bthd,bhmd->bhtm", q, mk)  # [B, H, T, M]
    best = s.reshape(B, H, T, M // G, G).max(axis=3)  # bin of slot s: s mod G
    want = np.argsort(-best, axis=-1, kind="stable")[..., :K]
    np.testing.assert_array_equal(slots % G, want)
    np.testing.assert_array_equal(scores, np.take_along_axis(best, want, -1))
    np.testing.assert_array_equal(np.take_along_axis(s, slots, -1), scores)


def recall(slots, exact_slots):
    hits = [
        len(set(a) & set(b))
        for a, b in zip(
            slots.reshape(-1, slots.shape[-1]).tolist(),
            exact_slots.reshape(-1, slots.shape[-1]).tolist(),
        )
    ]
    return sum(hits) / exact_slots.size


@pytest.mark.parametrize("name", sorted(SEARCHES))
@pytest.mark.parametrize("memory_size", [8192, 65536])
def test_approx_top_k_recall_on_random_unit_vectors_is_at_least_090(memory_size, name):
    cfg = presets.RunConfig(
        memory_size=memory_size,
        segment_length=64,
        num_neighbors=32,
        head_dim=32,
        num_heads=1,
        d_model=32,
    )
    rng = np.random.default_rng(0)
    q = np_unit(rng.standard_normal((1, 64, 1, 32))).astype(np.float32)
    mk = np_unit(rng.standard_normal((1, 1, memory_size, 32))).astype(np.float32)
    _, approx = search(name, q, mk, np.ones((1, memory_size), bool), cfg)
    _, exact = jax.lax.top_k(jnp.einsum("bthd,bhmd->bhtm", q, mk), 32)
    r = recall(approx, np.asarray(exact))
    G = mt.num_topk_bins(32, memory_size, cfg.topk_recall_target)
    assert r >= 0.9, r
    assert abs(r - (G / 32) * (1 - (1 - 1 / G) ** 32)) < 0.03  # the documented formula predicts it


@pytest.mark.parametrize("bits", [2, 7, 12])
def test_packed_scores_sort_like_the_scores_and_carry_their_row(bits):
    """kernels._pack: an int32 key per score, in the scores' order, with the row in its low bits.
    bfloat16 scores (16 zero low bits once widened) come back exactly; float32 ones lose the low
    `bits` bits of their mantissa and nothing more."""
    rng = np.random.default_rng(bits)
    row = rng.integers(0, 2**bits, (3, 4096)).astype(np.int32)
    x16 = np.asarray(jnp.asarray(rng.standard_normal((3, 4096)), jnp.bfloat16), np.float32)
    value, got_row = kernels._unpack(kernels._pack(jnp.asarray(x16), jnp.asarray(row), bits), bits)
    np.testing.assert_array_equal(value, x16)
    np.testing.assert_array_equal(got_row, row)
    x32 = rng.standard_normal((3, 4096)).astype(np.float32)
    key = np.asarray(kernels._pack(jnp.asarray(x32), jnp.zeros_like(row), bits))
    assert np.all(
        np.diff(np.take_along_axis(key, np.argsort(x32, axis=-1), -1), axis=-1) >= 0
    )  # monotone
    value, got_row = kernels._unpack(jnp.asarray(key), bits)
    np.testing.assert_allclose(value, x32, rtol=2.0 ** (bits - 23), atol=0)
    assert np.all(np.asarray(got_row) == 0)


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_approx_top_k_recall_with_bfloat16_queries_keys_and_scores_is_at_least_095(name):
    """Mixed precision searches bf16 keys with bf16 scores; against float32 exact top-k."""
    cfg = presets.RunConfig(
        memory_size=8192,
        segment_length=64,
        num_neighbors=32,
        head_dim=128,
        num_heads=1,
        d_model=128,
    )
    rng = np.random.default_rng(1)
    q = np_unit(rng.standard_normal((1, 64, 1, 128))).astype(np.float32)
    mk = np_unit(rng.standard_normal((1, 1, 8192, 128))).astype(np.float32)
    _, approx = SEARCHES[name](
        heads_first(jnp.asarray(q, jnp.bfloat16)),
        jnp.asarray(mk, jnp.bfloat16),
        np.ones((1, 8192), bool),
        jnp.full(1, math.sqrt(128)),
        cfg,
    )
    _, exact = jax.lax.top_k(jnp.einsum("bthd,bhmd->bhtm", q, mk), 32)
    assert recall(np.asarray(approx), np.asarray(exact)) >= 0.95

"""Faster ways to compute four of the model's pieces, each a drop-in with the plain piece's
signature and result (the tests hold them equal in values and gradients):

  ops = fast(memory_chunk=1024, attention="explicit")   # FAST: fast() with its defaults
  logits, state = mt.forward(params, state, tokens, reset, config, ops=ops)

What each buys, and on which backend, is in docs/performance.md's table "What
the kernels buy".
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import memorizing_transformer as mt
from memorizing_transformer import NEG_INF


def backend():
    return jax.default_backend()


# ----------------------------------------------------------------------------- local attention
def query_block(T):
    """Queries per block of the local attention: half the segment on a CPU, a
    quarter elsewhere."""
    n = 2 if backend() == "cpu" else 4
    return T // n if T % n == 0 else T


def position_bias(rel_bias, buckets, one_hot=None):
    """The T5 bias of each (query, key) pair, rel_bias [num_buckets, H], buckets
    int [...] -> [H, ...]. A gather on a CPU. On a GPU (one_hot None) a product
    with the buckets' one-hot matrix, so that its gradient is a matmul, not a
    scatter-add of every pair into num_buckets slots."""
    if not (backend() == "gpu" if one_hot is None else one_hot):
        return jnp.moveaxis(rel_bias[buckets], -1, 0)
    hot = jax.nn.one_hot(buckets, rel_bias.shape[0], dtype=rel_bias.dtype)  # [..., num_buckets]
    return jnp.einsum("...n,nh->h...", hot, rel_bias, precision=jax.lax.Precision.HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast_rows(x, rows):
    """x repeated along a new leading axis of `rows`, whose gradient (a sum over
    that axis) is a product with a vector of ones: XLA's CPU backend sums over a
    leading axis alone slowly."""
    return jnp.broadcast_to(x, (rows,) + x.shape)


broadcast_rows.defvjp(
    lambda x, rows: (broadcast_rows(x, rows), None),
    lambda rows, _, g: (jnp.einsum("b,b...->...", jnp.ones((rows,), g.dtype), g),),
)


def transpose_product(a, b, precision=None):
    """a^T b in float32 for a [..., K, M], b [..., K, N], contracting the
    leading axis of both. On a CPU the smaller operand is transposed first, as a
    copy of its own (an optimization barrier keeps XLA from folding the
    transpose back into the product): XLA's CPU backend runs a product that
    contracts the leading axis of both as a generic dot, slower than the library
    matmul."""
    apart = jax.lax.optimization_barrier if backend() == "cpu" else (lambda x: x)
    swap = lambda x: jnp.swapaxes(x, -1, -2)
    product = functools.partial(jnp.matmul, preferred_element_type=jnp.float32, precision=precision)
    if a.size <= b.size:
        return product(apart(swap(a)), b)
    return swap(apart(product(apart(swap(b)), a)))


def _pad_rows(x, rows):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(rows, 0), (0, 0)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def product_qk(q, k, precision, constant_rows=0):
    """q k^T in float32: q [..., Q, D], k [..., W, D] -> [..., Q, W]. Its
    gradient's k side is a transpose_product, and the first constant_rows keys
    (the XL cache's) get 0, not computed."""
    return jnp.einsum(
        "...qd,...wd->...qw", q, k, preferred_element_type=jnp.float32, precision=precision
    )


def _product_qk_bwd(precision, constant_rows, saved, g):
    q, k = saved
    g = g.astype(q.dtype)
    dq = jnp.matmul(g, k, preferred_element_type=jnp.float32, precision=precision)  # [..., Q, D]
    dk = transpose_product(g[..., constant_rows:], q, precision)  # [..., W - constant_rows, D]
    return dq.astype(q.dtype), _pad_rows(dk, constant_rows).astype(k.dtype)


product_qk.defvjp(
    lambda q, k, precision, rows: (product_qk(q, k, precision, rows), (q, k)), _product_qk_bwd
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def product_pv(p, v, precision, constant_rows=0):
    """p v in float32: p [..., Q, W], v [..., W, D] -> [..., Q, D], its gradient
    as product_qk's."""
    return jnp.matmul(p, v, preferred_element_type=jnp.float32, precision=precision)


def _product_pv_bwd(precision, constant_rows, saved, g):
    p, v = saved
    g = g.astype(v.dtype)
    dp = jnp.einsum(
        "...qd,...wd->...qw", g, v, preferred_element_type=jnp.float32, precision=precision
    )
    dv = transpose_product(p[..., constant_rows:], g, precision)  # [..., W - constant_rows, D]
    return dp.astype(p.dtype), _pad_rows(dv, constant_rows).astype(v.dtype)


product_pv.defvjp(
    lambda p, v, precision, rows: (product_pv(p, v, precision, rows), (p, v)), _product_pv_bwd
)


def local_attention(q, k, v, key_valid, rel_bias, scale, config):
    """mt.local_attention with the queries in blocks: a query sees at most T + 1
    of the S keys, so each block of Q queries meets only the W = T + Q keys its
    windows reach. The mask is a bias, the T5 bias is broadcast over rows with a
    matmul gradient, and the softmax is normalized after the value product."""
    B, H, T, D = q.shape
    S = k.shape[2]
    # The cache is a constant (forward stops its gradient): none is computed for it here.
    k, v = (
        jnp.concatenate([jax.lax.stop_gradient(x[:, :, : S - T]), x[:, :, S - T :]], axis=2)
        for x in (k, v)
    )
    Q = query_block(T)
    n, W = T // Q, min(T + Q, S)
    q_pos = (S - T) + np.arange(T).reshape(n, Q)  # [n, Q]
    starts = np.clip(q_pos[:, -1] + 1 - W, 0, S - W)  # [n]: each block's first key
    dist = (
        q_pos[:, :, None] - (starts[:, None] + np.arange(W))[:, None, :]
    )  # [n, Q, W] query minus key
    buckets = mt.relative_position_bucket(
        -dist, config.num_buckets, config.max_distance
    )  # [n, Q, W]
    blocks = lambda x, axis: jnp.stack(
        [jax.lax.slice_in_dim(x, s, s + W, axis=axis) for s in starts], axis=axis
    )
    valid = ((dist >= 0) & (dist <= config.segment_length))[None] & blocks(key_valid, 1)[
        :, :, None, :
    ]  # [B, n, Q, W]
    bias = (
        broadcast_rows(position_bias(rel_bias, buckets), B)
        + jnp.where(valid, 0.0, NEG_INF)[:, None]
    )  # [B, H, n, Q, W]
    qs = mt.scale_queries(q, scale).reshape(B, H, n, Q, D)
    cached = int(
        np.clip(S - T - starts, 0, W).min()
    )  # leading keys of every block that are the cache's
    logits = product_qk(qs, blocks(k, 2), mt.precision(config), cached) + bias  # [B, H, n, Q, W]
    # The softmax normalized after the value product: the division is over D, not W. The max only
    # keeps exp() in range; it cancels, so it needs no gradient. Every valid query sees itself.
    e = jnp.exp(
        logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    )  # [B, H, n, Q, W]
    out = product_pv(
        e.astype(v.dtype), blocks(v, 2), mt.precision(config), cached
    )  # [B, H, n, Q, D]
    q_valid = key_valid[:, S - T :].reshape(B, 1, n, Q, 1)  # a padding query gets 0
    return (out / jnp.sum(e, axis=-1, keepdims=True) * q_valid).astype(v.dtype).reshape(B, H, T, D)


def fused_implementation(dtype, T, S, D):
    """cuDNN's flash attention where it applies (a GPU, bfloat16, even T and S,
    D a multiple of 8 up to 128), else JAX's XLA version of the same call, which
    the tests hold equal to the plain one."""
    cudnn = (
        backend() == "gpu"
        and dtype == jnp.bfloat16
        and T % 2 == 0
        and S % 2 == 0
        and D % 8 == 0
        and D <= 128
    )
    return "cudnn" if cudnn else "xla"


def fused_local_attention(q, k, v, key_valid, rel_bias, scale, config):
    """mt.local_attention as one call of jax.nn.dot_product_attention. Its
    per-row masks are key lengths, so the keys go in as [segment; cache] and a
    row's length is T + its cache's valid count: exact when the valid keys are a
    prefix of the segment and of the cache, as data.py makes them (padding only
    at a segment's end). One bias [1, H, T, S] holds the window and the T5 bias
    for all rows. A batch whose mask is of any other kind takes
    mt.local_attention."""
    C = k.shape[2] - q.shape[2]
    prefixes = is_prefix(key_valid[:, :C]) & is_prefix(key_valid[:, C:])
    operands = (q, k, v, key_valid, rel_bias, scale)
    return jax.lax.cond(
        prefixes,
        functools.partial(_fused, config=config),
        functools.partial(mt.local_attention, config=config),
        *operands,
    )


def is_prefix(mask):
    """Whether each row's valid positions [B, n] come first: no valid one after
    a padded one."""
    return ~jnp.any(mask[:, 1:] & ~mask[:, :-1])


def _fused(q, k, v, key_valid, rel_bias, scale, config):
    """fused_local_attention's call, for masks whose two parts are prefixes."""
    qs = mt.scale_queries(q, scale)  # [B, H, T, D]
    qs, k, v = (jnp.swapaxes(x, 1, 2) for x in (qs, k, v))  # the call's layout: [B, T, H, D]
    B, T, H, D = qs.shape
    S = k.shape[1]
    C = S - T
    order = np.concatenate([np.arange(C, S), np.arange(C)])  # positions of [segment; cache]
    k = jnp.concatenate([k[:, C:], jax.lax.stop_gradient(k[:, :C])], axis=1)  # [B, S, H, D]
    v = jnp.concatenate([v[:, C:], jax.lax.stop_gradient(v[:, :C])], axis=1)  # [B, S, H, D]
    dist = (C + np.arange(T))[:, None] - order[None, :]  # [T, S] query minus key position
    buckets = mt.relative_position_bucket(-dist, config.num_buckets, config.max_distance)
    impl = fused_implementation(qs.dtype, T, S, D)
    dt = qs.dtype if impl == "cudnn" else jnp.float32  # cuDNN takes a bias in the logits' dtype
    hidden = -(2.0**41) if impl == "cudnn" else NEG_INF  # JAX's cuDNN path masks bf16 with it
    window = (dist >= 0) & (dist <= config.segment_length)  # [T, S]
    bias = position_bias(rel_bias, buckets).astype(dt)  # [H, T, S]
    bias = jnp.where(window, bias, jnp.asarray(hidden, dt))[None]  # [1, H, T, S]
    lengths = (T + jnp.sum(key_valid[:, :C], axis=1)).astype(jnp.int32)  # [B]
    out = jax.nn.dot_product_attention(
        qs, k, v, bias=bias, key_value_seq_lengths=lengths, scale=1.0, implementation=impl
    )  # [B, T, H, D]
    out = out * key_valid[:, C:, None, None].astype(out.dtype)  # [B, T, H, D]
    return jnp.swapaxes(out, 1, 2)  # [B, H, T, D]


# ----------------------------------------------------------------------------- memory search
def _pack(scores, row, bits):
    """Scores as int32 keys that sort like them, their low `bits` bits replaced
    by `row`: one integer max then finds a bin's best score and its row. A
    float's bits read as an int32, the negative ones negated, sort like the
    float. float32 scores lose `bits` low mantissa bits; bfloat16 scores,
    widened to float32, lose nothing."""
    raw = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32)
    key = jnp.where(raw < 0, -(raw & 0x7FFFFFFF), raw)  # monotone in the float value
    return (key & ~((1 << bits) - 1)) | row


def _unpack(key, bits):
    """_pack's inverse: keys -> (the scores, truncated), rows."""
    low = (1 << bits) - 1
    value = key & ~low
    value = jnp.where(value < 0, -value | jnp.iinfo(jnp.int32).min, value)
    return jax.lax.bitcast_convert_type(value, jnp.float32), key & low


def _bin_keys(best):
    """The bins' winners' keys [..., G] with the low log2(G) bits replaced by
    the bin, reversed, so that a row's keys are distinct, each names its bin
    (_key_bin), and of equal scores the lower bin ranks first (as in lax.top_k).
    """
    low = (1 << (best.shape[-1] - 1).bit_length()) - 1
    return (best & ~low) | (low - jax.lax.broadcasted_iota(jnp.int32, best.shape, best.ndim - 1))


def _key_bin(key, G):
    low = (1 << (G - 1).bit_length()) - 1
    return low - (key & low)


def _max_by_halves(x):
    """The maximum over the last axis, [..., G] -> [..., 1], as a tree of
    elementwise maxima."""
    while x.shape[-1] > 1:
        n, h = x.shape[-1], x.shape[-1] // 2
        y = jnp.maximum(x[..., :h], x[..., n - h :])
        x = (
            y if n % 2 == 0 else jnp.concatenate([y, x[..., h : h + 1]], axis=-1)
        )  # an odd middle waits
    return x


def top_k_in_passes(x, k, block=2**20):
    """lax.top_k(x, k)[0] for integer x whose entries in each row are distinct,
    in k passes over the last axis, each taking the largest entry below the last
    one taken. The rows go in blocks of at most `block` entries, which take
    their k passes while they are in the cache."""
    *lead, G = x.shape
    if k > G:
        raise ValueError(f"k ({k}) exceeds the {G} entries of a row.")
    rows = x.size // G
    nb = -(-rows // max(1, block // G))  # blocks
    n = -(-rows // nb)  # rows a block; the last block is padded

    def passes(xb):  # [n, G] -> [n, k]
        def next_largest(last, _):
            m = _max_by_halves(jnp.where(xb < last, xb, jnp.iinfo(x.dtype).min))  # [n, 1]
            return m, m

        first = _max_by_halves(xb)
        _, rest = jax.lax.scan(next_largest, first, None, length=k - 1)  # [k - 1, n, 1]
        return jnp.concatenate([first, jnp.moveaxis(rest[..., 0], 0, 1)], -1)

    xr = jnp.pad(x.reshape(rows, G), ((0, nb * n - rows), (0, 0)))
    return jax.lax.map(passes, xr.reshape(nb, n, G)).reshape(nb * n, k)[:rows].reshape(*lead, k)


def top_k(keys, k):
    """The k largest of each row's distinct int32 keys, largest first: in passes
    on a CPU, where XLA's top-k runs on one core; lax.top_k elsewhere."""
    return top_k_in_passes(keys, k) if backend() == "cpu" else jax.lax.top_k(keys, k)[0]


def _largest_divisor_at_most(n, cap):
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


# The binned search's batch rows go in blocks whose winners fit in this many bytes: on a CPU, so
# that the winners, read and written by every piece, stay in the caches; elsewhere all at once.
WINNERS_BYTES = {"cpu": 2**21}


def memory_search(q, mem_k, mem_valid, scale, config, bias=None, chunk=1024, batch_block=None):
    """mt.memory_search with the memory scored a piece of at most `chunk` slots
    at a time. Exact: each piece's top-k are candidates for the top-k of all.
    Binned: the memory seen as [rows, G], a piece is whole rows (or part of
    one), scored as keys x queries [slots, T] (the keys read as stored), and
    each bin's best score so far is kept with its row packed in one int32
    (_pack); then the top-k of the G winners, ranked with the bin in their low
    log2(G) bits: float32 scores to 23 - log2(G) mantissa bits (equal beyond
    that: the lower bin first), bfloat16 ones to all. The scores returned are
    the packed ones. batch_block: the batch rows searched at a time (None: as
    WINNERS_BYTES allows); the answer does not depend on it. bias [B, M], where
    given, is added to each slot's score, as in mt.memory_search."""
    B, H, M, D = mem_k.shape
    T, K = q.shape[2], config.num_neighbors
    qs = jax.lax.stop_gradient(mt.scale_queries(q, scale))  # [B, H, T, D]
    bias = None if bias is None else bias.astype(qs.dtype)  # [B, M]

    if config.exact_topk:
        size = _largest_divisor_at_most(M, chunk)

        def candidates(_, c):
            s = jnp.einsum(
                "bhtd,bhmd->bhtm",
                qs,
                jax.lax.dynamic_slice_in_dim(mem_k, c * size, size, 2).astype(qs.dtype),
                preferred_element_type=qs.dtype,
            )
            if bias is not None:
                s = s + jax.lax.dynamic_slice_in_dim(bias, c * size, size, 1)[:, None, None]
            s = jnp.where(
                jax.lax.dynamic_slice_in_dim(mem_valid, c * size, size, 1)[:, None, None],
                s,
                NEG_INF,
            )
            vals, idx = jax.lax.top_k(s, min(K, size))  # [B, H, T, K]
            return None, (vals, idx + c * size)

        _, (vals, idx) = jax.lax.scan(candidates, None, jnp.arange(M // size))  # [n, B, H, T, K]
        vals, idx = (jnp.moveaxis(x, 0, 3).reshape(B, H, T, -1) for x in (vals, idx))
        top, pos = jax.lax.top_k(vals, K)
        return top, jnp.take_along_axis(idx, pos, axis=-1)

    G, rows = mt.bin_layout(K, M, config.topk_recall_target)  # slot s = row * G + bin
    bits = rows.bit_length() - 1
    W = _largest_divisor_at_most(G, chunk)  # bins a piece
    R = _largest_divisor_at_most(rows, chunk // W)  # rows a piece
    keys = mem_k.reshape(B, H, rows, G, D)
    valid = mem_valid.reshape(B, rows, G)
    slot_bias = None if bias is None else bias.reshape(B, rows, G)
    if batch_block is None:
        budget = WINNERS_BYTES.get(backend())
        batch_block = B if budget is None else max(1, budget // (H * G * T * 4))
    n = _largest_divisor_at_most(B, batch_block)  # batch rows a block

    def search_rows(b):  # batch rows b .. b + n - 1
        qb = jax.lax.dynamic_slice_in_dim(qs, b, n)  # [n, H, T, D]

        def best_so_far(best, c):  # best [n, H, G, T]: each bin's best packed key so far
            r = (c % (rows // R)) * R  # the piece's first row
            w = (c // (rows // R)) * W  # and its first bin
            piece = jax.lax.dynamic_slice(keys, (b, 0, r, w, 0), (n, H, R, W, D))
            piece = piece.astype(qs.dtype)  # [n, H, R, W, D]
            s = jnp.einsum("bhrwd,bhtd->bhrwt", piece, qb, preferred_element_type=qs.dtype)
            piece_valid = jax.lax.dynamic_slice(valid, (b, r, w), (n, R, W))  # [n, R, W]
            if slot_bias is not None:
                piece_bias = jax.lax.dynamic_slice(slot_bias, (b, r, w), (n, R, W))  # [n, R, W]
                s = s + piece_bias[:, None, :, :, None]  # [n, H, R, W, T]
            s = jnp.where(piece_valid[:, None, :, :, None], s, NEG_INF)  # [n, H, R, W, T]
            row = r + jax.lax.broadcasted_iota(jnp.int32, s.shape, 2)
            code = rows - 1 - row  # of equal scores the lower row wins
            new = jnp.max(_pack(s, code, bits), axis=2)  # [n, H, W, T]
            old = jax.lax.dynamic_slice_in_dim(best, w, W, axis=2)
            best = jax.lax.dynamic_update_slice_in_dim(best, jnp.maximum(old, new), w, axis=2)
            return best, None

        start = jnp.full((n, H, G, T), jnp.iinfo(jnp.int32).min, jnp.int32)
        best, _ = jax.lax.scan(best_so_far, start, jnp.arange(M // (R * W)))
        best = jnp.swapaxes(best, 2, 3)  # [n, H, T, G]
        pos = _key_bin(top_k(_bin_keys(best), K), G)  # [n, H, T, K] the winners' bins
        vals, code = _unpack(jnp.take_along_axis(best, pos, axis=-1), bits)
        return vals, (rows - 1 - code) * G + pos

    if n == B:
        return search_rows(0)
    vals, slots = jax.lax.map(search_rows, jnp.arange(0, B, n))  # [B // n, n, H, T, K] each
    return vals.reshape(B, H, T, K), slots.reshape(B, H, T, K)


# --------------------------------------------------------------- attention over the retrieved pairs
def attend_to_retrieved(q, mem_k, mem_v, slots, valid, scale, config, bias=None):
    """mt.attend_to_retrieved; on a GPU (for K <= 64, whose program grows with
    K) as K terms."""
    if backend() == "gpu" and slots.shape[-1] <= 64:
        return attend_in_terms(q, mem_k, mem_v, slots, valid, scale, config, bias)
    return mt.attend_to_retrieved(q, mem_k, mem_v, slots, valid, scale, config, bias)


def attend_in_terms(q, mem_k, mem_v, slots, valid, scale, config, bias=None):
    """The attention over the K retrieved pairs written one pair at a time, in
    float32: on a GPU XLA fuses each term's gather, product and sum, so no [B,
    H, T, K, D] tensor of the retrieved keys or values is stored, nor kept for
    the backward pass."""
    take = jax.vmap(jax.vmap(lambda m, i: m[i]))  # per (b, h): [M, D], [T, K] -> [T, K, D]
    keys, vals = (
        take(mem_k, slots).astype(q.dtype),
        take(mem_v, slots).astype(q.dtype),
    )  # [B, H, T, K, D]
    f32 = lambda x: x.astype(jnp.float32)
    K = slots.shape[-1]
    logits = jnp.stack(
        [jnp.sum(f32(q) * f32(keys[..., k, :]), axis=-1) for k in range(K)], axis=-1
    )  # [B, H, T, K]
    logits = logits * scale[None, :, None, None]  # [B, H, T, K]
    logits = logits if bias is None else logits + bias  # [B, H, T, K]
    weights, has_memory = mt.masked_softmax(logits, valid)
    w = weights.astype(q.dtype)
    out = sum(f32(w[..., k, None]) * f32(vals[..., k, :]) for k in range(K)).astype(
        q.dtype
    )  # [B, H, T, D]
    return out, weights, has_memory


# ----------------------------------------------------------------------------- the memory's reset
def clear_rows(mem, reset):
    """mt.clear_rows in place, one reset row at a time: a step where no row
    starts a document writes nothing, where a select would rewrite all M slots
    of every row."""
    order = jnp.argsort(~reset)  # [B]: the reset rows first
    zeros = jnp.zeros((1,) + mem.shape[1:], mem.dtype)

    def clear(i, m):
        return jax.lax.dynamic_update_slice_in_dim(m, zeros, order[i], axis=0)

    return jax.lax.fori_loop(0, jnp.sum(reset), clear, mem)


@functools.lru_cache(maxsize=None)  # one Ops a setting: the steps compiled for it are reused
def fast(memory_chunk=1024, attention="explicit"):
    """The faster pieces, with their knobs: the memory scored memory_chunk slots
    at a time, and the local attention "explicit" (local_attention) or "fused"
    (fused_local_attention)."""
    local = fused_local_attention if attention == "fused" else local_attention
    search = functools.partial(memory_search, chunk=memory_chunk)
    return mt.Ops(local, search, attend_to_retrieved, clear_rows)


FAST = fast()


def of(config):
    """The pieces a run computes with: the model file's own (config.ops
    "plain"), or these, with the run's knobs."""
    return mt.PLAIN if config.ops == "plain" else fast(config.memory_chunk, config.attention)

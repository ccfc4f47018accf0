"""Adafactor (Shazeer & Stern, 2018) and the schedule of Sec. 4.2: linear
warmup, then square-root decay. The T5 bias tables and vectors take the plain
step (docs/usage.md, "Initialization").

  init, update = make_optimizer(config)       # optax's (init, update) convention
  updates, opt_state = update(grads, opt_state, params)
"""

import jax
import jax.numpy as jnp
import numpy as np

import memorizing_transformer as mt


def adafactor(
    learning_rate,
    decay_rate=0.8,
    eps1=1e-30,
    eps2=1e-3,
    clip_threshold=1.0,
    beta1=None,
    multiply_by_parameter_scale=True,
    min_dim_size_to_factor=32,
    plain=None,
):
    """Adafactor (Shazeer & Stern, 2018) with optax's (init, update) convention.

    For a gradient G at step t (from 1), with beta2_t = 1 - t^(-decay_rate):
      factored (rank >= 2, the two largest axes r, c both >= min_dim_size_to_factor):
        R = beta2 R + (1 - beta2) mean_c(G^2 + eps1);  C = beta2 C + (1 - beta2) mean_r(G^2 + eps1)
        V = R C / mean_r(R)
      otherwise V = beta2 V + (1 - beta2) (G^2 + eps1)
      U = G / sqrt(V);  U = U / max(1, RMS(U) / clip_threshold)          (update clipping)
      with beta1: M = beta1 M + (1 - beta1) U, and U = M
      update = -lr_t * max(eps2, RMS(X)) * U    (relative to the parameter's scale, rank >= 2)
    Vectors (norm weights, gate biases, q/k scales), and the leaves that `plain` (a pytree
    of bools shaped like the params) marks, take the plain step -lr_t * U: their scale
    says nothing about a good step. learning_rate is a number or a function of the step t.
    """
    lr_fn = learning_rate if callable(learning_rate) else (lambda t: learning_rate)

    def axes(x):
        if x.ndim < 2:
            return None
        r, c = sorted(np.argsort(x.shape, kind="stable")[-2:])
        return (int(r), int(c)) if min(x.shape[r], x.shape[c]) >= min_dim_size_to_factor else None

    @jax.jit  # zeros only: one compiled program makes them all
    def init(params):
        leaves = jax.tree.leaves(params)
        v = []
        for x in leaves:
            ax = axes(x)
            if ax is None:
                v.append({"v": jnp.zeros_like(x)})
            else:
                v.append(
                    {
                        "r": jnp.zeros_like(jnp.mean(x, axis=ax[1], keepdims=True)),
                        "c": jnp.zeros_like(jnp.mean(x, axis=ax[0], keepdims=True)),
                    }
                )
        m = [jnp.zeros_like(x) for x in leaves] if beta1 is not None else None
        return {"count": jnp.zeros((), jnp.int32), "v": v, "m": m}

    def update(grads, state, params):
        t = state["count"] + 1
        beta2 = 1.0 - t.astype(jnp.float32) ** -decay_rate
        lr = lr_fn(t)
        g_leaves, treedef = jax.tree.flatten(grads)
        p_leaves = jax.tree.leaves(params)
        plain_leaves = jax.tree.leaves(plain) if plain is not None else [False] * len(p_leaves)
        new_v, new_m, updates = [], [], []
        for i, (g, x) in enumerate(zip(g_leaves, p_leaves)):
            g2 = g * g + eps1
            ax = axes(x)
            if ax is None:
                v = beta2 * state["v"][i]["v"] + (1 - beta2) * g2
                new_v.append({"v": v})
            else:
                r = beta2 * state["v"][i]["r"] + (1 - beta2) * jnp.mean(
                    g2, axis=ax[1], keepdims=True
                )
                c = beta2 * state["v"][i]["c"] + (1 - beta2) * jnp.mean(
                    g2, axis=ax[0], keepdims=True
                )
                new_v.append({"r": r, "c": c})
                v = (r / jnp.mean(r, axis=ax[0], keepdims=True)) * c  # this order never underflows
            u = g * jax.lax.rsqrt(v)
            u = u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(u * u)) / clip_threshold)
            if beta1 is not None:
                u = beta1 * state["m"][i] + (1 - beta1) * u
                new_m.append(u)
            scale = lr
            if multiply_by_parameter_scale and x.ndim >= 2 and not plain_leaves[i]:
                scale = lr * jnp.maximum(eps2, jnp.sqrt(jnp.mean(x * x)))
            updates.append(-scale * u)
        return jax.tree.unflatten(treedef, updates), {
            "count": t,
            "v": new_v,
            "m": new_m if beta1 is not None else None,
        }

    return init, update


def learning_rate(step, base_lr, warmup_steps):
    """Sec. 4.2: linear warmup, then square-root decay: base * min(1, t/W) /
    sqrt(max(t, W))."""
    t = jnp.asarray(step, jnp.float32)
    w = max(warmup_steps, 1)
    return base_lr * jnp.minimum(1.0, t / w) * jax.lax.rsqrt(jnp.maximum(t, float(w)))


def make_optimizer(config):
    """Adafactor on the schedule. The T5 bias tables take the plain step: they
    start at 0, where a step relative to their scale would leave them, and the
    model's only position signal, frozen."""
    shapes = jax.eval_shape(lambda: mt.init_params(config, jax.random.PRNGKey(0)))
    plain = jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) == "rel_bias" for k in path), shapes
    )
    return adafactor(lambda t: learning_rate(t, config.lr, config.warmup_steps), plain=plain)

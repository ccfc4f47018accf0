"""Scoring a model on documents, for train.py's evaluations and evaluate.py: the
forward step, the loss over whole documents from a fresh memory, the repeat
bands, the memory-off ablation.

  step = make_forward_step(step_config(config))
  result = full_evaluation(params, config, docs, distances, step)   # eval.json's fields
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import corpora
import data
import kernels
import memorizing_transformer as mt
import startup


def step_config(config):
    """The fields a compiled step depends on: runs that differ only in steps or
    seed share it."""
    return config.replace(steps=1, seed=0)


MODEL_INPUTS = ("tokens", "targets", "mask", "reset")


def model_inputs(batch):
    """The arrays of a batch that the steps take (data.py adds doc and offset,
    to read by)."""
    return {k: batch[k] for k in MODEL_INPUTS}


class Scored(NamedTuple):
    """What a forward step gives: the new state; the cross-entropy [B, T] (0 on
    padding); the logits [B, T, V] and the retrievals (mt.forward's), where
    asked for, else None."""

    state: mt.State
    loss: jax.Array
    logits: object
    retrievals: object


@functools.lru_cache(maxsize=16)
def make_forward_step(config, donate=True, logits=False, retrievals=False, ops=None):
    """forward over a segment of every row, jitted once per config, for
    training's evaluation, evaluate.py, sample.py and memorize.py: (params,
    state, batch) -> Scored. donate=False keeps the state given. ops:
    kernels.fast with the config's knobs, unless given."""
    ops = ops or kernels.of(config)

    def step(params, state, batch):
        tokens, reset, mask = batch["tokens"], batch["reset"], batch["mask"]
        out, state, found = mt.forward(
            params, state, tokens, reset, config, mask=mask, return_retrievals=True, ops=ops
        )
        ce = mt.cross_entropy(out, batch["targets"]) * mask  # [B, T]
        return Scored(state, ce, out if logits else None, found if retrievals else None)

    return jax.jit(step, donate_argnums=(1,) if donate else ())


# ----------------------------------------------------------------------------- evaluation
# How far back a reference's value last appeared, in segments: within the local window,
# beyond it but within 2 segments, or more than 2 back (only the memory reaches it).
DISTANCE_BANDS = {"near": (0, 1), "mid": (1, 2), "far": (2, float("inf"))}  # (lo, hi]


def start_documents(state, reset, start):
    """Rows that start a document begin from `start`'s memory (a loaded one, one
    row) instead of an empty one, and without an XL cache; forward then takes
    them as going on (reset False), so that nothing clears or appends. Returns
    (state, reset)."""
    r = reset.astype(bool)  # [B]

    def pick(new, old):  # new [1, ...] where r, else old [B, ...]
        return jnp.where(r.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)

    state = state._replace(
        mem_k=pick(start.mem_k, state.mem_k),
        mem_v=pick(start.mem_v, state.mem_v),
        mem_valid=pick(start.mem_valid, state.mem_valid),
        mem_pos=pick(start.mem_pos, state.mem_pos),
        prev_valid=state.prev_valid & ~r[:, None],
    )
    return state, jnp.zeros_like(r)


restore = jax.jit(start_documents, donate_argnums=(0,))


def memorized_band(doc, held, position, size, T, n=3):
    """For each target doc[i], i >= 1: whether its context (the n tokens ending
    at it) occurs in the memorized tokens still held when it is scored, and not
    earlier in doc. held: the loaded memory's tokens, slot 0 on, in the order
    streamed (memorize.py's); the document's own segments then overwrite slots
    from `position` on, T at a time."""
    held, doc = np.asarray(held, np.int64), np.asarray(doc, np.int64)
    V = int(max(held.max(initial=0), doc.max(initial=0))) + 1
    if V**n >= 2**63:
        raise ValueError(f"token ids up to {V - 1} do not fit {n}-token contexts in an int64.")
    code = lambda t: sum(t[k : len(t) - n + 1 + k] * V ** (n - 1 - k) for k in range(n))
    evicted = (np.arange(len(held)) - position) % size // T + 1  # the call it is gone from
    alive = evicted[: len(held) - n + 1].copy()  # [contexts]: the call its last slot goes
    for k in range(1, n):
        alive = np.minimum(alive, evicted[k : len(held) - n + 1 + k])
    keys = code(held)  # [contexts]
    order = np.argsort(keys, kind="stable")
    uniq, first = np.unique(keys[order], return_index=True)
    last = np.maximum.reduceat(alive[order], first) if len(uniq) else alive  # [unique]
    ctx = code(doc)  # [len(doc) - n + 1]: the context ending at doc[i], i >= n - 1
    at = np.minimum(np.searchsorted(uniq, ctx), max(len(uniq) - 1, 0))
    found = np.zeros(len(ctx), np.int64)
    if len(uniq):
        found = np.where(uniq[at] == ctx, last[at], 0)
    band = np.zeros(len(doc) - 1, bool)
    i = np.arange(n - 1, len(doc))  # targets i: prediction i - 1, scored by call (i - 1) // T
    new = data.context_distance(doc, n) == 0  # [len(doc) - 1]
    band[i - 1] = new[i - 1] & (found > (i - 1) // T)
    return band


def evaluate(params, config, docs, batch_size, eval_step=None, distances=None, band_memory=None,
             start=None, memorized=None, per_token=False):
    """Token-level validation loss, each document from its start with a fresh
    memory, and the loss in each of data.BANDS (far_repeat_loss,
    far_repeat_tokens, ..., far_span_loss), by the reach of a memory of
    band_memory slots (default: the config's). start: a loaded memory's one-row
    state (memory_file.start_state), which each document starts from, one row at
    a time; memorized: per document, memorized_band's mask, whose loss and count
    become memorized_loss and memorized_tokens. per_token: the result's
    "per_token" holds each document's losses, [len(doc) - 1] each. distances
    (synthetic data, per document): how far back each reference token's value
    last appeared; the result then also has the loss on the references in each
    band, e.g. reference_loss_far."""
    eval_step = eval_step or make_forward_step(step_config(config))
    rows = 1 if start is not None else max(1, min(batch_size, len(docs)))
    state = mt.init_state(config, rows)
    window = config.segment_length + config.cache_length
    memory = config.memory_size if band_memory is None else band_memory
    bands = [data.repeat_bands(doc, window, memory) for doc in docs]  # per target
    spans = [data.span_band(d, window, memory, bands=b) for d, b in zip(docs, bands)]  # per target
    total, count, full, ref_ce, ref_dist, band_ce, band_of = 0.0, 0, 0, [], [], [], []
    span_of = []
    batches = data.SegmentBatches(docs, rows, config.segment_length, epochs=1)
    mem_ce, each = [], [np.zeros(len(d) - 1) for d in docs] if per_token else None
    for i, batch in enumerate(batches):
        inputs = model_inputs(batch)
        if start is not None and batch["reset"].any():
            state, inputs["reset"] = restore(state, batch["reset"], start)
        out = eval_step(params, state, inputs)
        state, ce = out.state, np.asarray(out.loss, np.float64)
        if i == 0:  # the step is compiled (if it was not before): take the compiler's holes
            startup.fill_heap_holes()
        total, count = total + float(ce.sum()), count + int(batch["mask"].sum())
        for b in range(rows):
            n = int(batch["mask"][b].sum())
            if not n:
                continue
            d, off = batch["doc"][b], batch["offset"][b]  # target j here: doc token off + 1 + j
            full += n if off >= config.memory_size else 0  # the memory holds tokens [0, off)
            band_ce.append(ce[b, :n])
            band_of.append(bands[d][off : off + n])
            span_of.append(spans[d][off : off + n])
            if per_token:
                each[d][off : off + n] = ce[b, :n]
            if memorized is not None:
                mem_ce.append(ce[b, :n][memorized[d][off : off + n]])
            if distances is not None:
                ref_ce.append(ce[b, :n])
                ref_dist.append(distances[d][off + 1 : off + 1 + n])
    loss = total / max(count, 1)
    result = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
    if config.active_memory_layers:
        result["tokens_memory_full"] = full  # scored after the memory's M slots had filled
    if band_ce:
        ce, band = np.concatenate(band_ce), np.concatenate(band_of)
        for name in data.REPEAT_BANDS:
            if np.any(band == name):
                result[f"{name}_loss"] = float(ce[band == name].mean())
            result[f"{name}_tokens"] = int(np.sum(band == name))
        span = np.concatenate(span_of)
        if span.any():
            result["far_span_loss"] = float(ce[span].mean())
        result["far_span_tokens"] = int(span.sum())
    if memorized is not None:
        ce = np.concatenate(mem_ce)
        result["memorized_tokens"] = int(ce.size)
        if ce.size:  # (a band without a token has no loss: the field is left out)
            result["memorized_loss"] = float(ce.mean())
    if per_token:
        result["per_token"] = each
    if ref_ce:
        ce, dist = np.concatenate(ref_ce), np.concatenate(ref_dist)
        result.update(
            reference_loss=float(ce[dist != 0].mean()), reference_tokens=int((dist != 0).sum())
        )
        for band, (lo, hi) in DISTANCE_BANDS.items():
            sel = (dist > lo * config.segment_length) & (dist <= hi * config.segment_length)
            if sel.any():
                result[f"reference_loss_{band}"] = float(ce[sel].mean())
                result[f"reference_tokens_{band}"] = int(sel.sum())
    return result


def full_evaluation(params, config, docs, distances, eval_step, band_memory=None):
    """evaluate(), and for a memory model the memory-off ablation's loss,
    perplexity, band and reference losses under the same names with a
    _memory_off suffix."""
    B = config.batch_size
    result = evaluate(params, config, docs, B, eval_step, distances, band_memory)
    if config.active_memory_layers:
        off = evaluate(mt.memory_off(params), config, docs, B, eval_step, distances, band_memory)
        for k, v in off.items():
            if k in ("loss", "perplexity") or k.endswith("_loss") or k.startswith("reference_loss"):
                result[f"{k}_memory_off"] = v
    return result


def format_eval(step, r):
    """The printed line of an evaluation: loss, perplexity, memory off, the
    far-repeat tokens' loss (only the memory reaches them), reference losses;
    each with the memory off beside it."""
    off = f" (memory off {r['perplexity_memory_off']:.2f})" if "perplexity_memory_off" in r else ""
    line = f"eval {step:6d} | loss {r['loss']:.4f} | ppl {r['perplexity']:9.2f}{off}"
    parts = [("far-repeat", "far_repeat_loss")]
    parts += [(f"ref {b}", f"reference_loss_{b}") for b in DISTANCE_BANDS]
    for label, key in parts:
        if key in r:
            line += f" | {label} {r[key]:.3f}"
            line += f" (off {r[key + '_memory_off']:.3f})" if key + "_memory_off" in r else ""
    return f"{line} | {scored(r)}"


def scored(r):
    """How many tokens an evaluation scored, and how many after the memory was
    full."""
    full = r.get("tokens_memory_full")
    tokens = corpora.plural(r["tokens"], "token")
    return tokens + ("" if full is None else f" ({full} after the memory filled)")


def eval_record(step, r):
    """An evaluation as one metrics.jsonl record."""
    return {
        "step": step,
        "eval_loss": r["loss"],
        "eval_perplexity": r["perplexity"],
        **{
            k: v
            for k, v in r.items()
            if k.startswith(("reference_loss", "perplexity_memory_off", *data.BANDS))
        },
    }


def per_token_loss(params, config, doc, start=None):
    """Cross-entropy of every prediction of one document, from its start with a
    fresh memory (or a loaded one, `start`): a float array of len(doc) - 1, and
    the retrievals of each segment."""
    step = make_forward_step(step_config(config), retrievals=True)
    state = mt.init_state(config, 1)
    losses, retrievals = [], []
    for batch in data.SegmentBatches([doc], 1, config.segment_length, epochs=1):
        inputs = model_inputs(batch)
        if start is not None and batch["reset"].any():
            state, inputs["reset"] = restore(state, batch["reset"], start)
        out = step(params, state, inputs)
        n = int(batch["mask"].sum())
        state = out.state
        losses.append(np.asarray(out.loss[0, :n]))
        retrievals.append(jax.tree.map(np.asarray, out.retrievals))
    return np.concatenate(losses), retrievals

"""Does the memory help, and what does it retrieve? (Sec. 4.3-4.6, Table 1, Appendix B)

  python evaluate.py perplexity RUN_DIR [--memory-size M] [--json FILE]
  python evaluate.py compare RUN_DIR --memory-sizes A,B [--doc N] --csv FILE [--plot FILE.png]
  python evaluate.py inspect RUN_DIR [--doc N] [--top 10]
  python evaluate.py explore RUN_DIR [--doc N] --html page.html
  python evaluate.py recall RUN_DIR [--memory-size M] [--dtype bfloat16]
  python evaluate.py reach RUN_DIR [--distances 1024,61440] [--memory-sizes 512,65536]
  python evaluate.py finetune [--pretrain-steps 1500] [--finetune-steps 500] [--out-root DIR]
  python evaluate.py table [--data ...] [--steps N] [--seeds N] [--out-root DIR]

Every perplexity of a memory model comes with its memory-off ablation: the same weights with
every gate forced to 0 (local attention only). Memory that is present but unused looks
like memory that works; the ablation tells them apart.
"""

import startup  # first: before JAX loads (malloc on a CPU; an early Ctrl-C leaves in one line)

if __name__ == "__main__":
    startup.leave_on_early_signals()

import argparse
import csv
import dataclasses
import io
import json
import keyword
import math
import os
import re
import time

import jax
import numpy as np

import cli
import corpora
import data
import evaluation
import memorizing_transformer as mt
import memory_file
import presets
import runs
import train


# ----------------------------------------------------------------------------- loading a run
# The fields a run may be evaluated with other than its own: they change no parameter.
EVAL_FIELDS = ("exact_topk", "num_neighbors", "memory_age_bias", "ops")


def eval_changes(args):
    """The EVAL_FIELDS that the command line gives: {field: value}."""
    return {k: getattr(args, k) for k in EVAL_FIELDS if getattr(args, k, None) is not None}


def load_run(run_dir, memory_size=None, changes=None):
    """(config, params, tokenizer, saved args) of a run; memory_size overrides
    the config's (Sec. 4.4: a model trained with a small memory evaluated with a
    larger one), and so do `changes` (EVAL_FIELDS: {field: value}). The args
    carry the checkpoint's fingerprints of its documents and tokenizer,
    "documents" and "tokenizer" (None where it has none); a tokenizer other than
    the checkpoint's is refused."""
    saved = runs.read_run_config(run_dir)
    config = saved["config"]
    changes = dict(changes or {})
    if memory_size is not None:
        changes["memory_size"] = memory_size
    try:
        config = config.replace(**changes)
    except ValueError as e:  # the flag named: the config's words alone are the run's
        flag = lambda k: "memory size" if k == "memory_size" else "--" + k.replace("_", "-")
        given = ", ".join(f"{flag(k)} {v}" for k, v in changes.items())
        raise cli.UsageError(f"{given} does not fit the run in {run_dir}: {e}") from None
    runs.check_fits(config, 1)
    tokenizer = os.path.join(run_dir, "tokenizer.model")
    sp = data.load_tokenizer(tokenizer)
    if sp.get_piece_size() > config.vocab_size:
        raise cli.UsageError(
            f"{tokenizer} has {sp.get_piece_size()} pieces, more than the run's vocab_size "
            f"{config.vocab_size}: it is not the run's tokenizer."
        )
    ckpt = os.path.join(run_dir, "checkpoint.npz")
    meta, arrays = runs.load_checkpoint(ckpt)
    if meta.get("tokenizer") not in (
        None,
        data.file_hash(tokenizer),
    ):  # (a checkpoint from before has none)
        raise cli.UsageError(
            f"{tokenizer} is not the tokenizer the run in {run_dir} was trained with (its "
            "checkpoint records another): its ids would mean other words; restore the run's own."
        )
    # A run trained without memory, evaluated with one, gets fresh gates (g = 0.5): only then
    # are parameters initialized; otherwise their shapes are the template (no compile, no work).
    fresh_gates = bool(config.active_memory_layers) and not any("gate_bias" in k for k in arrays)
    init = lambda: mt.init_params(config, jax.random.PRNGKey(0))
    if fresh_gates:  # then only the gates may be missing (strict=False below)
        runs.check_same_model(jax.eval_shape(init), arrays, ckpt)
    params = runs.restore_tree(
        init() if fresh_gates else jax.eval_shape(init),
        arrays,
        "params",
        ckpt,
        strict=not fresh_gates,
    )
    return (
        config,
        params,
        sp,
        dict(saved["args"], documents=meta.get("documents"), tokenizer=meta.get("tokenizer")),
    )


def validation_docs(args, run_args, sp, config):
    """The run's validation documents as training scored them, as token arrays:
    the same split, the run's --suffixes (for its own corpus) and its
    --min-doc-tokens filter."""
    if not args.data:
        runs.check_run_data_here(run_args["data"])
    source = args.data or run_args["data"]
    own = corpora.same_source(source, run_args["data"])
    fmt = args.data_format or (run_args["data_format"] if own else "auto")
    suffixes = corpora.parse_suffixes(run_args.get("suffixes")) if own else None
    docs = corpora.load_documents(source, fmt, seed=0, verbose=False, suffixes=suffixes)
    _, valid = data.split_documents(docs, run_args["valid_fraction"], seed=0)
    tokens, refs = data.tokenize(valid, sp)
    shortest = run_args.get("min_doc_tokens") or 0
    kept = [(t, r) for t, r in zip(tokens, refs) if len(t) >= shortest]
    if not kept:
        raise cli.UsageError(
            f"no validation document of {source!r} has the run's --min-doc-tokens {shortest}."
        )
    for t, _ in kept:
        data.check_tokens(t, config.vocab_size)
    known = (
        (run_args.get("documents") or {}).get("validation")
        if own and fmt == run_args["data_format"]
        else None
    )
    if known and data.fingerprint([t for t, _ in kept]) != known:
        cli.say(
            f"note: the validation documents of {source} are not those of the run's checkpoint "
            "(the corpus, or the run's tokenizer, changed since): these numbers are for the "
            "documents as they are now."
        )
    return [t for t, _ in kept], [r for _, r in kept]


# ----------------------------------------------------------------------------- subcommands
def read_memory(args, config, params):
    """--load-memory's file, checked against the run (memory_file.read)."""
    path = os.path.join(args.run_dir, "tokenizer.model")
    pieces = data.load_tokenizer(path).get_piece_size()
    return memory_file.read(args.load_memory, config, memory_file.params_hash(params),
                            data.file_hash(path), pieces)


def load_memory(args, config, params, memory_size=None):
    """(config, start state, memory_file.Memory) of --load-memory, or (config,
    None, None) without; memory_size adds free slots to the file's, or keeps its
    last ones (FIFO)."""
    if not args.load_memory:
        return config, None, None
    memory = read_memory(args, config, params)
    return fifo_start(memory, config, memory_size)


def fifo_start(memory, config, size=None):
    """(config, start state, memory) of a memory of `size` slots (default: the
    file's): the file's and free ones, or its last ones
    (memory_file.last_slots), the memory they hold."""
    if size is not None and size < 1:
        raise cli.UsageError(f"--memory-size {size} leaves no slot for --load-memory's pairs.")
    if size is not None and size < memory.header["slots"]:
        try:
            config.replace(memory_size=size)
        except ValueError as e:
            raise cli.UsageError(f"--memory-size {size} does not fit the run: {e}") from None
        memory = memory_file.last_slots(memory, size)
    return memory_file.start_state(memory, config, size) + (memory,)


def score_documents(args, sp, config):
    """--score PATH: every file under it whole, each its own document, in sorted
    order, read as memorize.py reads a code base."""
    if not os.path.exists(args.score):
        raise cli.UsageError(f"--score {args.score} does not exist.")
    files = corpora.read_tree(args.score, corpora.parse_suffixes(args.suffixes))
    texts = [corpora.tree_text(name, text) for name, text in files]
    docs = [t for t in data.encode_texts(sp, texts) if len(t) >= 2]
    if not docs:
        raise cli.UsageError(f"--score {args.score} holds no readable text to score.")
    for d in docs:
        data.check_tokens(d, config.vocab_size)
    return docs


def cmd_score(args):
    """perplexity with --load-memory or --score: the files of --score (or the
    validation documents), each from the loaded memory and from a memory as
    large with no valid slot; the memorized band's loss both ways."""
    # --memory-size: the run's M, or with --load-memory the slots to grow the file's to
    size = None if args.load_memory else args.memory_size
    changes = eval_changes(args)
    config, params, sp, run_args = load_run(args.run_dir, size, changes)
    config, start, memory = load_memory(args, config, params, args.memory_size)
    docs = documents_to_score(args, run_args, sp, config)
    T, M = config.segment_length, config.memory_size
    memorized = None
    if memory:
        held = memory_file.held_tokens(memory)
        pos = int(start.mem_pos[0])
        memorized = [evaluation.memorized_band(d, held, pos, M, T) for d in docs]
    step = evaluation.make_forward_step(evaluation.step_config(config))
    result = evaluation.evaluate(params, config, docs, 1, step, None, args.band_memory, start,
                                 memorized, per_token=True)
    result["memory_size"] = M
    losses = {"loss": result.pop("per_token")}
    line = f"perplexity {result['perplexity']:.3f} (loss {result['loss']:.4f}"
    if memory:
        del start  # (its slots are not needed beside the empty memory's)
        empty = evaluation.evaluate(params, config, docs, 1, step, None, args.band_memory,
                                    None, memorized, per_token=True)
        losses["loss_empty"] = empty.pop("per_token")
        result.update(loss_empty=empty["loss"], perplexity_empty=empty["perplexity"])
        if "memorized_loss" in empty:
            result["memorized_loss_empty"] = empty["memorized_loss"]
        line += f"; empty memory {result['loss_empty']:.4f}"
    documents = corpora.plural(len(docs), "document")
    print(f"memory {M}: {line}, {documents}, {evaluation.scored(result)})")
    for band in data.BANDS + ("memorized",):
        if f"{band}_loss" in result:
            empty = result.get(f"{band}_loss_empty")
            print(f"{band.replace('_', '-')} tokens: loss {result[f'{band}_loss']:.4f} over "
                  f"{result[f'{band}_tokens']}"
                  + ("" if empty is None else f" (empty memory: {empty:.4f})"))
    if args.json:
        runs.write_output(args.json, runs.json_text(result))
    if args.csv:
        runs.write_output(args.csv, token_table(sp, docs, losses, memorized))
    return 0


def token_table(sp, docs, losses, memorized):
    """--csv of a scored memory: a row per target (document, index, id, piece),
    its loss (and with the empty memory), and whether it is in the memorized
    band."""
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(["document", "index", "target", "target_piece", *losses, "memorized"])
    for d, doc in enumerate(docs):
        for i, t in enumerate(doc[1:]):
            band = "" if memorized is None else int(memorized[d][i])
            values = [f"{losses[k][d][i]:.6f}" for k in losses]
            w.writerow([d, i + 1, int(t), sp.id_to_piece(int(t)), *values, band])
    return table.getvalue()


def documents_to_score(args, run_args, sp, config):
    """The documents a command scores: --score's files whole, or the run's
    held-out documents as --eval-docs and --eval-tokens cut them (default: as
    the run did)."""
    if args.score:
        return score_documents(args, sp, config)
    docs = validation_docs(args, run_args, sp, config)[0]
    eval_docs = args.eval_docs or run_args["eval_docs"]
    eval_tokens = run_args["eval_tokens"] if args.eval_tokens is None else args.eval_tokens
    return data.first_tokens(docs[:eval_docs], eval_tokens)


def refuse_unused(args):
    """A flag that the command does not use with the options given is refused,
    not ignored: --suffixes reads --score's files, and --eval-docs and
    --eval-tokens cut the held-out documents, which --score replaces."""
    if getattr(args, "suffixes", None) and not getattr(args, "score", None):
        raise cli.UsageError("--suffixes chooses --score's files; without --score it does nothing.")
    for flag in ("eval_docs", "eval_tokens"):
        if getattr(args, flag, None) is not None and getattr(args, "score", None):
            raise cli.UsageError(f"--{flag.replace('_', '-')} cuts the run's held-out documents, "
                                 "and --score scores its files whole instead; drop one.")


def cmd_perplexity(args):
    if args.load_memory or args.score:
        return cmd_score(args)
    if args.csv:
        raise cli.UsageError("--csv (a row per target) goes with --load-memory or --score.")
    changes = eval_changes(args)
    config, params, sp, run_args = load_run(args.run_dir, args.memory_size, changes)
    docs, refs = validation_docs(args, run_args, sp, config)
    eval_docs = args.eval_docs or run_args["eval_docs"]
    eval_tokens = run_args["eval_tokens"] if args.eval_tokens is None else args.eval_tokens
    docs = data.first_tokens(docs[:eval_docs], eval_tokens)
    refs = [r[: len(d)] for d, r in zip(docs, refs)]
    # Synthetic data marks the referenced values: their loss is reported apart, by distance.
    distances = (
        [data.reference_distances(d, r) for d, r in zip(docs, refs)]
        if any(r.any() for r in refs)
        else None
    )
    result = {
        "memory_size": config.memory_size,
        "exact_topk": config.exact_topk,
        **evaluation.full_evaluation(
            params,
            config,
            docs,
            distances,
            evaluation.make_forward_step(evaluation.step_config(config)),
            args.band_memory,
        ),
    }
    scored = evaluation.scored(result)
    line = f"perplexity {result['perplexity']:.3f} (loss {result['loss']:.4f}, {scored})"
    if config.active_memory_layers:
        line += f" | memory off: {result['perplexity_memory_off']:.3f}"
    print(f"memory {config.memory_size}{', exact top-k' if config.exact_topk else ''}: {line}")
    # the loss in each band of data.repeat_bands, then on the synthetic data's references
    bands = [
        (f"{b.replace('_', '-')} tokens", f"{b}_loss", f"{b}_tokens") for b in data.BANDS
    ]
    bands += [("reference tokens (all)", "reference_loss", "reference_tokens")]
    for b in evaluation.DISTANCE_BANDS:
        bands += [(f"reference tokens {b}", f"reference_loss_{b}", f"reference_tokens_{b}")]
    for label, loss, tokens in bands:
        if loss in result:
            off = result.get(f"{loss}_memory_off")
            print(
                f"{label}: loss {result[loss]:.4f} over {result[tokens]}"
                + ("" if off is None else f" (memory off: {off:.4f})")
            )
    if args.json:
        runs.write_output(args.json, runs.json_text(result))
    return 0


def _doc(args, run_args, sp, config):
    """The --doc'th document, of --score's files where given, else of the
    validation set."""
    if getattr(args, "score", None):
        docs = score_documents(args, sp, config)
        refs, where = [np.zeros(len(d), bool) for d in docs], f"--score {args.score}"
    else:
        docs, refs = validation_docs(args, run_args, sp, config)
        where = "the validation set"
    if not 0 <= args.doc < len(docs):
        raise cli.UsageError(
            f"--doc {args.doc} is out of range: {where} has "
            f"{corpora.plural(len(docs), 'document')}."
        )
    doc = docs[args.doc][: args.max_tokens + 1] if args.max_tokens else docs[args.doc]
    return doc, refs[args.doc][: len(doc)]


def token_kind(sp, token):
    """Appendix B's classes of a target token: a number, a Python keyword or
    punctuation, an identifier (any other word-like piece), or other
    (whitespace, bytes, mixed pieces)."""
    text = token_text(sp, token).strip()
    if re.fullmatch(r"\d[\w.]*", text):
        return "number"
    if keyword.iskeyword(text) or re.fullmatch(r"[^\w\s]+", text):
        return "keyword/punct"
    return "identifier" if re.fullmatch(r"\w+", text) else "other"


def cmd_compare(args):
    if len(args.memory_sizes) != 2:
        sizes = ",".join(map(str, args.memory_sizes))
        raise cli.UsageError(f"--memory-sizes takes two sizes A,B for compare, got {sizes}.")
    a, b = args.memory_sizes
    # Each size has its own parameters: a memory size of 0 has no gates, a memory one needs them.
    config_a, params_a, sp, run_args = load_run(args.run_dir, a, eval_changes(args))
    config_b, params_b, _, _ = load_run(args.run_dir, b, eval_changes(args))
    doc, _ = _doc(args, run_args, sp, config_a)
    print(
        f"memory {a} vs {b}: evaluating validation document {args.doc} ({len(doc) - 1} tokens) "
        "twice...",
        flush=True,
    )
    ce_a, _ = evaluation.per_token_loss(params_a, config_a, doc)
    ce_b, _ = evaluation.per_token_loss(params_b, config_b, doc)
    delta = ce_a - ce_b  # Sec. 4.6: positive = the memory of size B helped
    kinds = [token_kind(sp, t) for t in doc[1:]]
    window = config_b.segment_length + config_b.cache_length
    reaches = [data.reach(int(d), window, max(a, b)) for d in data.context_distance(doc)]
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(
        ["index", "target", "target_piece", "ce_a", "ce_b", "delta", "kind", "context_reach"]
    )
    for i, (t, x, y, d) in enumerate(zip(doc[1:], ce_a, ce_b, delta)):
        w.writerow(
            [
                i + 1,
                int(t),
                sp.id_to_piece(int(t)),
                f"{x:.6f}",
                f"{y:.6f}",
                f"{d:.6f}",
                kinds[i],
                reaches[i],
            ]
        )
    runs.write_output(args.csv, table.getvalue())
    print(
        f"memory {a} vs {b} on validation document {args.doc} ({len(delta)} tokens): mean delta "
        f"{delta.mean():+.4f} nats, {np.mean(delta > 0):.1%} of tokens improved"
    )
    for i in np.argsort(-delta)[:10]:
        print(f"  token {i + 1:6d} {sp.id_to_piece(int(doc[i + 1]))!r:>16}  delta {delta[i]:+.3f}")
    # Appendix B: which tokens gain. By kind, and by where the token's 3-token context was last
    # seen: in the local window (T + XL cache), in the memory beyond it, farther, or never.
    for title, groups in (
        ("kind", kinds),
        (f"context last seen (window {window}, memory {max(a, b)})", reaches),
    ):
        print(f"by {title}:")
        for g in sorted(set(groups)):
            sel = np.array([x == g for x in groups])
            print(
                f"  {g:<14} {sel.sum():7d} tokens ({sel.mean():6.1%})  mean delta "
                f"{delta[sel].mean():+.4f}  improved {np.mean(delta[sel] > 0):6.1%}"
            )
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            cli.say("matplotlib is not installed: no plot (the CSV and the summary are written).")
        else:
            fig, ax = plt.subplots(figsize=(12, 3))
            ax.bar(np.arange(1, len(delta) + 1), delta, width=1.0)
            ax.set_xlabel("token index")
            ax.set_ylabel(f"CE(M={a}) - CE(M={b})")
            fig.tight_layout()
            runs.write_output(args.plot, lambda f: fig.savefig(f, dpi=120, format="png"))
    return 0


def slot_position(slot, segment, config, start=0):
    """The document position held by memory `slot` while segment `segment` is
    processed: segment i of a document is written at slots (start + i * T) mod M
    onwards (start: a loaded memory's write position), and the memory holds the
    latest. None: the slot holds what the memory held when the document started
    (a loaded memory's pair, or nothing)."""
    T, per = config.segment_length, config.memory_size // config.segment_length
    block = (slot - start) % config.memory_size // T  # segments 0, per, 2 per, ... wrote here
    if block >= segment:
        return None
    i = segment - 1 - ((segment - 1 - block) % per)
    return i * T + slot % T


class Sources:
    """Where the pairs that a document's queries retrieve came from: the
    document's own tokens, or a loaded memory's slots (memorize.py's source
    file, line and tokens)."""

    def __init__(self, sp, config, doc, memory=None, start=None):
        self.sp, self.config, self.doc = sp, config, doc
        # where the document's own writes begin: a loaded memory's position, else slot 0
        self.start = 0 if start is None else int(start.mem_pos[0])
        self.memory = memory.arrays if memory else None
        self.files = memory.header["files"] if memory else []

    def position(self, slot, segment):
        """The document position of a retrieved slot, or None for a loaded
        memory's slot."""
        return slot_position(slot, segment, self.config, self.start)

    def memorized(self, slot):
        """A loaded memory's slot: (its file:line, its token id, the tokens of
        its file in the slots around it: before [n], after [n])."""
        a = self.memory
        around = slice(max(slot - 40, 0), slot + 11)
        near = np.arange(len(a["token"]))[around]  # [n]
        same = near[(a["file"][around] == a["file"][slot]) & a["valid"][around]]
        where = f"{self.files[int(a['file'][slot])]}:{int(a['line'][slot])}"
        tokens = np.asarray(a["token"])
        before, after = tokens[same[same < slot]], tokens[same[same > slot]]  # [n], [n]
        return where, int(tokens[slot]), before, after

    def describe(self, slot, segment, width=60):
        """inspect's words for a retrieved slot: (source, piece, context)."""
        pos = self.position(slot, segment)
        text = lambda tokens: self.sp.decode([int(t) for t in tokens])
        if pos is None:
            where, token, before, after = self.memorized(slot)
            return where, token, (text(before) + text([token]) + text(after[:10]))[-width:]
        before = text(self.doc[max(pos - 30, 0) : pos + 10])[-width:]
        return f"{pos:6d}", int(self.doc[pos]), before


def cmd_inspect(args):
    config, params, sp, run_args = load_run(args.run_dir, None, eval_changes(args))
    if not config.active_memory_layers:
        raise cli.UsageError(f"{args.run_dir} has no memory to inspect.")
    config, start, memory = load_memory(args, config, params)
    doc, _ = _doc(args, run_args, sp, config)
    ce_on, retrievals = evaluation.per_token_loss(params, config, doc, start)
    ce_off, _ = evaluation.per_token_loss(mt.memory_off(params), config, doc)
    gain = ce_off - ce_on
    T = config.segment_length
    context = lambda a, b: sp.decode([int(t) for t in doc[max(a, 0) : b]])[-60:]
    sources = Sources(sp, config, doc, memory, start)
    print(
        f"{'document' if args.score else 'validation document'} {args.doc}: {len(gain)} tokens; "
        f"memory lowers the loss by {gain.mean():+.4f} nats "
        f"on average (memory off - memory on); the {args.top} largest gains:"
    )
    for i in np.argsort(-gain)[: args.top]:
        seg, t = divmod(int(i), T)
        r = retrievals[seg][0]  # the first memory layer
        w = r["weights"][0, :, t]  # [H, K]
        h = int(np.argmax(w.max(-1)))
        print(
            f"\nquery {i}: input {sp.id_to_piece(int(doc[i]))!r} -> target "
            f"{sp.id_to_piece(int(doc[i + 1]))!r} "
            f"gain {gain[i]:+.3f} nats | context: {context(i - 40, i + 1)!r}"
        )
        for k in np.argsort(-w[h], kind="stable")[:5]:
            if w[h, k] <= 0:
                break
            where, token, text = sources.describe(int(r["slots"][0, h, t, k]), seg)
            print(
                f"   head {h} weight {w[h, k]:.3f} memory {where}: "
                f"{sp.id_to_piece(token)!r:>14} | {text!r}"
            )
    return 0


def cmd_recall(args):
    """Recall of the approximate top-k on the real queries and keys of a trained
    model: the same document streamed with approximate and exact top-k (the
    memory's contents do not depend on which: the memory layer's keys come from
    the layers below it)."""
    changes = eval_changes(args)
    config, params, sp, run_args = load_run(args.run_dir, args.memory_size, changes)
    if not config.active_memory_layers:
        raise cli.UsageError(f"{args.run_dir} has no memory.")
    if args.dtype:  # e.g. a float32 run's weights with bfloat16 keys, queries and scores
        config = config.replace(dtype=args.dtype, memory_dtype=None)
    doc, _ = _doc(args, run_args, sp, config)
    _, approx = evaluation.per_token_loss(params, config.replace(exact_topk=False), doc)
    _, exact = evaluation.per_token_loss(params, config.replace(exact_topk=True), doc)
    K, T = config.num_neighbors, config.segment_length
    hits, total = 0, 0
    for seg, (ra, rx) in enumerate(zip(approx, exact)):
        if seg * T < K:  # fewer than k entries: both return every valid entry
            continue
        n = min(T, len(doc) - 1 - seg * T)  # the segment's queries; the last one's padding is none
        for la, le in zip(ra, rx):  # memory layers
            a, b = (
                la["slots"][0][:, :n].reshape(-1, K),
                le["slots"][0][:, :n].reshape(-1, K),
            )  # [H * n, K]
            hits += sum(len(set(x) & set(y)) for x, y in zip(a.tolist(), b.tolist()))
            total += b.size
    if not total:
        need = -(-K // T) * T + 1  # the first segment whose queries have K memories, plus a target
        if args.max_tokens and args.max_tokens < need:
            raise cli.UsageError(
                f"--max-tokens {args.max_tokens} is too few: no query had {K} memories to choose "
                f"from; give at least {need} (k {K}, T {T})."
            )
        raise cli.UsageError(
            f"document {args.doc} has {len(doc)} tokens: no query had {K} memories to choose from; "
            f"pick a longer one with --doc."
        )
    bins = mt.bin_layout(K, config.memory_size, config.topk_recall_target)[0]
    result = {
        "memory_size": config.memory_size,
        "exact_topk": config.exact_topk,
        "k": K,
        "bins": bins,
        "recall": hits / total,
        "expected_random": (bins / K) * (1 - (1 - 1 / bins) ** K),
        "retrievals": total // K,
    }
    print(
        f"memory {config.memory_size}, k {K}, {bins} bins: recall {result['recall']:.4f} on "
        f"{result['retrievals']} real queries x heads (random unit vectors: "
        f"{result['expected_random']:.4f} expected)"
    )
    if args.json:
        runs.write_output(args.json, runs.json_text(result))
    return 0


def token_text(sp, token):
    """How a token reads on the page: its piece, with SentencePiece's word mark
    as a space and a byte piece of an ASCII character as that character (other
    bytes stay <0xNN>)."""
    piece = sp.id_to_piece(int(token)).replace("\u2581", " ")
    if re.fullmatch(r"<0x[0-7][0-9A-F]>", piece):
        return chr(int(piece[3:5], 16))
    return piece


def explore_data(params, config, sp, doc, top, run_dir, index, memory=None, start=None):
    """The numbers behind the explore page: every token of `doc` (ids and
    pieces), the loss of predicting it with the memory on and off (as
    `inspect`), and for each query position, per head of the first memory layer,
    its `top` retrieved memories by attention weight: document position and
    weight in thousandths (-1 and 0 where a slot held nothing). With a loaded
    memory (load_memory's), a retrieved pair of it has position -1 and its index
    in "memorized" ([file:line, context before, piece, context after]) in
    "memory_source" (-1 for the document's own pairs)."""
    ce_on, retrievals = evaluation.per_token_loss(params, config, doc, start)
    ce_off, _ = evaluation.per_token_loss(mt.memory_off(params), config, doc)
    T, n = config.segment_length, len(doc) - 1
    sources = Sources(sp, config, doc, memory, start)
    pos = np.full((n, config.num_heads, top), -1, np.int64)
    source = np.full((n, config.num_heads, top), -1, np.int64)
    weight = np.zeros((n, config.num_heads, top), np.int64)
    memorized = {}  # slot -> its index in the page's list
    for seg, ret in enumerate(retrievals):
        w, slots = ret[0]["weights"][0], ret[0]["slots"][0]  # the first memory layer: [H, T, K]
        for t in range(min(T, n - seg * T)):
            for h in range(config.num_heads):
                for r, k in enumerate(np.argsort(-w[h, t], kind="stable")[:top]):
                    if w[h, t, k] <= 0:
                        continue
                    slot = int(slots[h, t, k])
                    at = sources.position(slot, seg)
                    if at is None:
                        source[seg * T + t, h, r] = memorized.setdefault(slot, len(memorized))
                    else:
                        pos[seg * T + t, h, r] = at
                    weight[seg * T + t, h, r] = round(1000 * float(w[h, t, k]))
    gain = ce_off - ce_on
    page = {
        "run": os.path.abspath(run_dir),
        "doc": index,
        "config": dataclasses.asdict(config),
        "summary": {
            "tokens": n,
            "loss": float(ce_on.mean()),
            "loss_memory_off": float(ce_off.mean()),
            "mean_gain": float(gain.mean()),
            "improved": float(np.mean(gain > 0)),
        },
        "layer": config.active_memory_layers[0],
        "heads": config.num_heads,
        "top": top,
        "ids": [int(t) for t in doc],
        "pieces": [token_text(sp, t) for t in doc],
        "loss": [round(float(x), 4) for x in ce_on],
        "loss_memory_off": [round(float(x), 4) for x in ce_off],
        "memory_pos": pos.ravel().tolist(),
        "memory_weight": weight.ravel().tolist(),
    }
    if memory:
        piece = lambda tokens: "".join(token_text(sp, t) for t in tokens)
        page["memory_source"] = source.ravel().tolist()
        page["memorized"] = []
        for slot in memorized:  # in the order of their indices
            where, token, before, after = sources.memorized(slot)
            page["memorized"].append([where, piece(before[-8:]), token_text(sp, token),
                                      piece(after[:3])])
    return page


def script_json(value):
    """JSON to put inside a <script> element: with no "<" in it (each is written
    \\u003c, the same string to JSON), no text of the document, such as
    "</script>" or "<!--<script>", can end the element early or change how the
    HTML parser reads it."""
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c")


def cmd_explore(args):
    config, params, sp, run_args = load_run(args.run_dir, None, eval_changes(args))
    if not config.active_memory_layers:
        raise cli.UsageError(f"{args.run_dir} has no memory to explore.")
    config, start, memory = load_memory(args, config, params)
    doc, _ = _doc(args, run_args, sp, config)
    page = explore_data(params, config, sp, doc, args.memories, args.run_dir, args.doc, memory,
                        start)
    page["document"] = (f"document {args.doc} of --score {args.score}" if args.score
                        else f"validation document {args.doc}")
    page["loaded_memory"] = args.load_memory
    # One self-contained file: the data as JSON, a style sheet and a script; no network.
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "explore.html")) as f:
        template = f.read()
    runs.write_output(args.html, template.replace("__DATA__", script_json(page)))
    s = page["summary"]
    print(
        f"{args.html}: {'document' if args.score else 'validation document'} {args.doc}, "
        f"{s['tokens']} tokens, loss {s['loss']:.4f} (memory off {s['loss_memory_off']:.4f}), "
        f"{s['improved']:.1%} of tokens improved by the memory"
    )
    return 0


# ------------------------------------------------------------------------ the memory-size curve
CURVE_BANDS = ("near_repeat", "far_repeat", "beyond", "new", "far_span")


def cmd_curve(args):
    """Sec. 4.4 and Table 1's claim, drawn for one model: the loss at each of
    --memory-sizes. In the document (the run's held-out documents), each size
    against the memory-off ablation; from a memorized code base (--load-memory,
    memorized once at the largest size), each size keeps the file's last slots
    (FIFO) and is scored against an empty memory of the same size. The bands are
    fixed at --band-memory's reach (default: the run's M), so that every size is
    scored on the same tokens."""
    sizes = args.memory_sizes
    changes = eval_changes(args)
    config, params, sp, run_args = load_run(args.run_dir, None, changes)
    if not config.active_memory_layers:
        raise cli.UsageError(f"{args.run_dir} has no memory: its curve is flat.")
    T = config.segment_length
    if min(sizes) < 1 or any(m % T for m in sizes):
        raise cli.UsageError(f"--memory-sizes takes positive multiples of the run's segment "
                             f"length {T}, got {','.join(map(str, sizes))}.")
    sizes = sorted(sizes)
    for m in sizes:  # every size checked before anything runs
        try:
            runs.check_fits(config.replace(memory_size=m), 1)
        except ValueError as e:
            raise cli.UsageError(f"--memory-sizes {m} does not fit the run: {e}") from None
    band = config.memory_size if args.band_memory is None else args.band_memory
    docs = documents_to_score(args, run_args, sp, config)
    if args.load_memory:
        memory = read_memory(args, config, params)
        rows, base = memorized_curve(args, params, config, docs, memory, sizes, band), None
    else:
        rows, base = document_curve(params, config, docs, sizes, band)
    result = {"run": args.run_dir, "load_memory": args.load_memory, "score": args.score,
              "band_memory": band, **changes, "rows": rows}
    if base is not None:
        result["memory_off"] = base
    print_curve(result)
    if args.json:
        runs.write_output(args.json, runs.json_text(result))
    if args.plot:
        plot_curve(result, args.plot)
    return 0


def curve_row(m, r, seconds):
    """A size's row: its loss, perplexity and bands (None where a band has no
    token)."""
    row = {"memory_size": m, "loss": r["loss"], "perplexity": r["perplexity"]}
    row["tokens"] = r["tokens"]
    for b in CURVE_BANDS + ("memorized",):
        if f"{b}_tokens" in r:
            row[f"{b}_loss"] = r.get(f"{b}_loss")
            row[f"{b}_tokens"] = r[f"{b}_tokens"]
    row["seconds"] = seconds
    return row


def document_curve(params, config, docs, sizes, band):
    """The held-out documents at each size, and once with the memory off (the
    same at every size: no gate lets the memory in)."""
    B, rows = config.batch_size, []
    for m in sizes:
        started = time.perf_counter()
        c = config.replace(memory_size=m)
        step = evaluation.make_forward_step(evaluation.step_config(c))
        r = evaluation.evaluate(params, c, docs, B, step, band_memory=band)
        rows.append(curve_row(m, r, time.perf_counter() - started))
    c = config.replace(memory_size=sizes[0])
    step = evaluation.make_forward_step(evaluation.step_config(c))
    off = evaluation.evaluate(mt.memory_off(params), c, docs, B, step, band_memory=band)
    return rows, curve_row(0, off, None)


def memorized_curve(args, params, config, docs, memory, sizes, band):
    """Each size from the loaded memory's last slots (or all of it and free
    ones), and from an empty memory of the same size; the memorized band both
    ways."""
    rows, T = [], config.segment_length
    for m in sizes:
        started = time.perf_counter()
        c, start, held = fifo_start(memory, config, m)
        pos = int(start.mem_pos[0])
        tokens = memory_file.held_tokens(held)
        memorized = [evaluation.memorized_band(d, tokens, pos, m, T) for d in docs]
        step = evaluation.make_forward_step(evaluation.step_config(c))
        r = evaluation.evaluate(params, c, docs, 1, step, None, band, start, memorized)
        del start
        empty = evaluation.evaluate(params, c, docs, 1, step, None, band, None, memorized)
        row = curve_row(m, r, None)
        row.update(loss_empty=empty["loss"], perplexity_empty=empty["perplexity"],
                   memorized_loss_empty=empty.get("memorized_loss"))
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
    return rows


def print_curve(result):
    """The curve as a table: a row a size, the loss against the base (memory
    off, or empty)."""
    memorized = result["load_memory"] is not None
    base = "empty" if memorized else "off"
    bands = ("memorized",) + CURVE_BANDS if memorized else CURVE_BANDS
    heads = ["memory", "ppl", "loss", base, "vs " + base] + [b.replace("_", "-") for b in bands]
    print(" ".join(f"{h:>11}" for h in heads) + f" {'s':>7}")
    fmt = lambda x: "-" if x is None else f"{x:.4f}"
    rows = result["rows"] + ([result["memory_off"]] if not memorized else [])
    for row in rows:
        against = row.get("loss_empty", result.get("memory_off", {}).get("loss"))
        change = f"{row['loss'] / against - 1:+.2%}" if row["memory_size"] else "-"
        cells = [row["memory_size"] or "off", f"{row['perplexity']:.3f}", fmt(row["loss"]),
                 fmt(against if row["memory_size"] else None), change]
        cells += [fmt(row.get(f"{b}_loss")) for b in bands]
        seconds = "-" if row["seconds"] is None else f"{row['seconds']:.0f}"
        print(" ".join(f"{x:>11}" for x in cells) + f" {seconds:>7}")
    first = result["rows"][0]
    counts = ", ".join(f"{b.replace('_', '-')} {first.get(f'{b}_tokens', 0)}" for b in bands)
    if memorized:
        counts += " (memorized: at the first size; its tokens change with the size)"
    print(f"loss in nats over {first['tokens']} tokens; the bands by the reach of "
          f"{result['band_memory']} slots: {counts}")
    if memorized:
        print("memorized: in the band, with the memory and (empty) without: "
              + ", ".join(f"{r['memory_size']}: {fmt(r.get('memorized_loss'))} "
                          f"({fmt(r.get('memorized_loss_empty'))})" for r in result["rows"]))


def plot_curve(result, path):
    """The curve as a PNG: the loss against log2 M beside its base, and each
    band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        cli.say("matplotlib is not installed: no plot (the table is printed).")
        return
    rows = result["rows"]
    sizes = [r["memory_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(sizes, [r["loss"] for r in rows], "o-", label="memory")
    if "memory_off" in result:
        left.axhline(result["memory_off"]["loss"], color="gray", ls="--", label="memory off")
    else:
        left.plot(sizes, [r["loss_empty"] for r in rows], "s--", label="empty memory")
    bands = ("memorized",) + CURVE_BANDS if result["load_memory"] else CURVE_BANDS
    for b in bands:
        values = [r.get(f"{b}_loss") for r in rows]
        if None not in values:
            right.plot(sizes, values, "o-", label=b.replace("_", "-"))
    for ax, title in ((left, "loss"), (right, "loss by band")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("memory slots M")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    runs.write_output(path, lambda f: fig.savefig(f, dpi=120, format="png"))


TABLE_ROWS = [  # Table 1's rows, in miniature: (name, memory size in segments, XL cache)
    ("no memory", 0, False),
    ("XL cache", 0, True),
    ("memory 4T", 4, False),
    ("memory 4T + XL", 4, True),
    ("memory 16T + XL", 16, True),
]


def within_reach(key_pos, query_pos, config):
    """Whether the query at query_pos can attend to the key at key_pos (same
    document, earlier): in its own segment, in the XL cache (the previous
    segment), or in the memory, which holds the M / T segments before the
    query's (the ring buffer, cleared at the document's start)."""
    T = config.segment_length
    back = query_pos // T - key_pos // T
    memory = config.memory_size // T if config.active_memory_layers else 0
    return back <= max(memory, 1 if config.xl_cache else 0)


REACH_MAX_TOKENS = (
    20_000_000  # 30x reach's defaults; on a CPU each memory size evaluates some 10^4 tokens/s
)


def cmd_reach(args):
    """Sec. 4.4: one model, memories of several sizes, references D tokens back.
    The probes' loss is low where the memory holds the definition, and at chance
    where it does not."""
    probe_tokens = args.docs * sum(
        args.distances
    )  # about: each document is its distance and ~100 tokens more
    if probe_tokens > REACH_MAX_TOKENS:  # (generated in memory before the first row)
        raise cli.UsageError(
            f"--docs {args.docs} and --distances {','.join(map(str, args.distances))} ask for "
            f"about {probe_tokens:,} tokens of probe documents; reach makes at most "
            f"{REACH_MAX_TOKENS:,} (its defaults, 8 and 1024,4096,16384,61440: {8 * 82944:,})."
        )
    if min(args.memory_sizes) < 1:
        raise cli.UsageError("--memory-sizes takes positive sizes for reach: each is a memory.")
    if len(set(args.memory_sizes)) < len(args.memory_sizes):  # each names rows of the table
        sizes = ",".join(map(str, args.memory_sizes))
        raise cli.UsageError(f"--memory-sizes names a value twice: {sizes}.")
    changes = eval_changes(args)
    config, params, sp, run_args = load_run(args.run_dir, args.memory_sizes[0], changes)
    if not corpora.is_synthetic(run_args["data"]):
        raise cli.UsageError(
            f"{args.run_dir} was trained on {run_args['data']!r}: reach probes the synthetic "
            "task's bindings, so it needs a run trained with --data synthetic."
        )
    configs = []
    for m in args.memory_sizes:  # every size checked before anything runs
        try:
            configs.append(config.replace(memory_size=m))
        except ValueError as e:
            raise cli.UsageError(f"--memory-sizes {m}: {e}") from None
        runs.check_fits(configs[-1], config.batch_size)
    steps = {
        m: evaluation.make_forward_step(evaluation.step_config(c))
        for m, c in zip(args.memory_sizes, configs)
    }
    chance = math.log(len(corpora.SYNTHETIC_VALUES))
    print(
        f"{'distance':>8} {'memory':>7} {'in reach':>9} {'far loss':>9} {'memory off':>11} "
        f"{'tokens':>7} {'mean distance':>14} {'seconds':>8}",
        flush=True,
    )
    rows = []
    for D in args.distances:
        docs, refs = data.tokenize(
            corpora.synthetic_long_documents(args.docs, D, seed=args.probe_seed), sp
        )
        for t in docs:
            data.check_tokens(t, config.vocab_size)
        dist = [data.reference_distances(t, r) for t, r in zip(docs, refs)]
        probe_pos = [np.flatnonzero(r) for r in refs]  # the probes' value tokens
        all_dist = np.concatenate([d[p] for d, p in zip(dist, probe_pos)])
        off = evaluation.evaluate(
            mt.memory_off(params),
            configs[0],
            docs,
            config.batch_size,
            steps[args.memory_sizes[0]],
            dist,
        )
        for m, c in zip(args.memory_sizes, configs):
            start = time.perf_counter()
            r = evaluation.evaluate(params, c, docs, config.batch_size, steps[m], dist)
            # The key that answers a probe sits at the definition's value token; the query at
            # the token before the probe's value (its name).
            held = np.mean(
                [within_reach(p - d[p], p - 1, c) for d, ps in zip(dist, probe_pos) for p in ps]
            )
            rows.append(
                {
                    "distance": D,
                    "memory_size": m,
                    "exact_topk": c.exact_topk,
                    "far_loss": r["reference_loss"],
                    "far_loss_memory_off": off["reference_loss"],
                    "tokens": r["reference_tokens"],
                    "in_reach": float(held),
                    "mean_distance": float(all_dist.mean()),
                    "perplexity": r["perplexity"],
                    "seconds": time.perf_counter() - start,
                }
            )
            x = rows[-1]
            print(
                f"{D:>8} {m:>7} {x['in_reach']:>9.0%} {x['far_loss']:>9.3f} "
                f"{x['far_loss_memory_off']:>11.3f} "
                f"{x['tokens']:>7} {x['mean_distance']:>14.1f} {x['seconds']:>8.1f}",
                flush=True,
            )
    print(
        "far loss: nats on the probes, values last seen once, about `distance` tokens back, in "
        f"{corpora.plural(args.docs, 'document')} per distance; chance (a uniform guess over the "
        f"{len(corpora.SYNTHETIC_VALUES)} values) is {chance:.2f}; in reach: the share of probes "
        "whose definition the memory (or the window) holds."
    )
    if args.json:
        runs.write_output(args.json, runs.json_text(rows))
    return 0


def check_planned_run(out, flags):
    """A directory that a table or a fine-tuning would reuse or resume must hold
    the run that `flags` train: one of other settings (another --segment-length,
    --data, seed, ...) is refused, not reported as this one."""
    if not os.path.isfile(os.path.join(out, "config.json")):
        return
    args, saved = train.build_parser().parse_args(flags), runs.read_run_config(out)
    conflict = runs.resume_conflict(args, saved, out, cli.given_flags(train.build_parser, flags))
    if not conflict:  # and the settings no flag names, the preset's: the model's size, ...
        planned = planned_config(args)
        conflict = next(
            (
                (
                    f"--{f.name.replace('_', '-')} {getattr(planned, f.name)}",
                    getattr(saved["config"], f.name),
                )
                for f in dataclasses.fields(presets.RunConfig)
                if f.name not in runs.RESUME_MAY_CHANGE
                and getattr(planned, f.name) != getattr(saved["config"], f.name)
            ),
            None,
        )
    if conflict:
        raise cli.UsageError(
            f"{out} holds a run of other settings ({conflict[0]} here, {conflict[1]} there); "
            f"choose another --out-root, or remove that run."
        )


def planned_config(args):
    """The config that train.py's parsed flags `args` give a new run (of their
    --preset)."""
    return cli.config_from_args(args, presets.PRESETS[args.preset], f"the {args.preset} preset")


def cache_flags(args):
    """--cache-dir for every run that table and finetune train or resume
    (train.py's default where it is not given)."""
    if args.cache_dir is None:
        return []
    runs.check_writable_dir(args.cache_dir, "--cache-dir")
    return ["--cache-dir", args.cache_dir]


def finished_or_trained(name, out, flags, steps, cache):
    """The eval.json of the run in `out` once it has finished at `steps` (a
    global step count): reused if it has, resumed if it stopped before, trained
    with `flags` if it is new; cache (cache_flags) in both cases. An exit code
    instead if training fails.
"""
    ev = runs.read_json(os.path.join(out, "eval.json"))
    if (
        ev
        and ev.get("step") == steps
        and all(isinstance(ev.get(k), float) for k in ("perplexity", "loss"))
    ):
        return ev
    resume = os.path.isfile(os.path.join(out, "config.json"))
    print(f"{'resuming' if resume else 'training'} {name} -> {out}", flush=True)
    code = train.main(
        ["--out", out, "--resume", "--steps", str(steps)] + cache
        if resume
        else flags + cache + ["--out", out]
    )
    return code or runs.read_json(os.path.join(out, "eval.json"))


def cmd_table(args):
    preset = presets.PRESETS["tiny"]
    names = [n for n, _, _ in TABLE_ROWS]
    wanted = names if args.rows is None else [x.strip() for x in args.rows.split(",") if x.strip()]
    if not wanted:
        raise cli.UsageError(f"--rows {args.rows!r} names no row; choose from {names}.")
    if set(wanted) - set(names):
        raise cli.UsageError(
            f"unknown --rows {sorted(set(wanted) - set(names))}; choose from {names}."
        )
    T, B = args.segment_length or preset.segment_length, args.batch_size or preset.batch_size
    runs.check_writable_dir(args.out_root, "--out-root")
    cache = cache_flags(args)
    plan = []
    for name, segments, xl in [
        r for r in TABLE_ROWS if r[0] in wanted
    ]:  # every row checked before any trains
        base = os.path.join(args.out_root, name.replace(" ", "_").replace("+", "plus"))
        flags = [
            "--data",
            args.data,
            "--steps",
            str(args.steps),
            "--segment-length",
            str(T),
            "--memory-size",
            str(segments * T),
            "--xl-cache" if xl else "--no-xl-cache",
            "--eval-every",
            "0",
            "--batch-size",
            str(B),
        ]
        # every setting named, the preset's where a flag is not given: a row's run of other settings
        # is then refused
        flags += ["--num-neighbors", str(args.num_neighbors or preset.num_neighbors)]
        gate = preset.init_gate_bias if args.init_gate_bias is None else args.init_gate_bias
        flags += ["--init-gate-bias", str(gate)] if segments else []
        try:
            config = preset.replace(
                segment_length=T,
                memory_size=segments * T,
                xl_cache=xl,
                batch_size=B,
                num_neighbors=args.num_neighbors or preset.num_neighbors,
            )
        except ValueError as e:
            raise cli.UsageError(f"row {name!r}: {e}") from None
        runs.check_fits(config, B)
        # Seed 0 keeps the row's directory (the runs of a one-seed table); seed s > 0 goes beside
        # it.
        seeds = [(s, base if s == 0 else f"{base}_seed{s}") for s in range(args.seeds)]
        for seed, out in seeds:
            check_planned_run(out, flags + ["--seed", str(seed)])
        plan.append((name, segments, xl, seeds, flags))
    rows = []
    for name, segments, xl, seeds, flags in plan:
        per_seed = []
        for seed, out in seeds:
            ev = finished_or_trained(
                f"{name}, seed {seed}", out, flags + ["--seed", str(seed)], args.steps, cache
            )
            if isinstance(ev, int):
                return ev
            per_seed.append(
                {
                    "seed": seed,
                    "run": out,
                    "perplexity": ev["perplexity"],
                    "perplexity_memory_off": ev.get("perplexity_memory_off"),
                    "far_repeat_loss": ev.get("far_repeat_loss"),
                    "tokens": ev["tokens"],
                }
            )
        row = {
            "name": name,
            "memory_size": segments * T,
            "xl_cache": xl,
            "steps": args.steps,
            "tokens": per_seed[0]["tokens"],
            "run": per_seed[0]["run"],
            "seeds": per_seed,
        }
        for key in ("perplexity", "perplexity_memory_off", "far_repeat_loss"):  # mean, sample std
            values = [r[key] for r in per_seed]
            unknown = None in values  # (a row without memory has no far-repeat band of its own)
            row[key] = None if unknown else float(np.mean(values))
            row[f"{key}_std"] = (
                None if unknown or len(values) < 2 else float(np.std(values, ddof=1))
            )
        rows.append(row)
    # The ceiling: the share of validation tokens whose 3-token context last occurred beyond
    # the row's local window but within its memory, the tokens only a memory could help with.
    saved = runs.read_run_config(rows[0]["run"])  # every row has the same data and tokenizer
    config, run_args = saved["config"], saved["args"]
    sp = data.load_tokenizer(os.path.join(rows[0]["run"], "tokenizer.model"))
    docs, _ = validation_docs(argparse.Namespace(data=None, data_format=None), run_args, sp, config)
    distances = np.concatenate([data.context_distance(doc) for doc in docs])
    for r in rows:
        window = T + (T if r["xl_cache"] else 0)  # the segment and its XL cache, as in compare
        r["ceiling"] = float(
            np.mean([data.reach(int(d), window, r["memory_size"]) == "memory" for d in distances])
        )
    spread = lambda r, key: (
        "-"
        if r[key] is None
        else f"{r[key]:.3f}"
        if r[f"{key}_std"] is None
        else f"{r[key]:.2f} ± {r[f'{key}_std']:.2f}"
    )
    width = 9 if args.seeds == 1 else 15
    print(
        f"\n{'model':<18} {'context':>7} {'memory':>7} {'XL':>5} {'ppl':>{width}} "
        f"{'memory off':>{width}} {'far-repeat':>{width}} {'ceiling':>8}"
    )
    for r in rows:
        print(
            f"{r['name']:<18} {T:>7} {r['memory_size'] or 'None':>7} "
            f"{T if r['xl_cache'] else 'None':>5} "
            f"{spread(r, 'perplexity'):>{width}} {spread(r, 'perplexity_memory_off'):>{width}} "
            f"{spread(r, 'far_repeat_loss'):>{width}} {r['ceiling']:>8.2%}"
        )
    if args.seeds > 1:
        print(
            f"ppl and memory off: mean ± standard deviation over {args.seeds} seeds (init and "
            "data order)"
        )
    print(
        f"ceiling: the share of the {len(distances)} validation tokens whose 3-token context last "
        "occurred beyond the window (segment + XL cache) but within the row's memory"
    )
    runs.atomic_write(os.path.join(args.out_root, "table.json"), runs.json_text(rows))
    return 0


def eval_curve(run_dir):
    """The evaluations logged in a run's metrics.jsonl: step -> that line."""
    curve = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "eval_loss" in rec:
                curve[rec["step"]] = rec
    return curve


def cmd_finetune(args):
    """Sec. 4.4: a model trained without memory learns to use one when
    fine-tuned with it. Three runs of one preset: without memory for
    --pretrain-steps; from it, with memory, for --finetune-steps more; and with
    memory from scratch for the same total.
"""
    total = args.pretrain_steps + args.finetune_steps
    common = [
        "--preset",
        args.preset,
        "--data",
        args.data,
        "--eval-every",
        str(args.eval_every),
        "--eval-docs",
        str(args.eval_docs),
        "--eval-tokens",
        str(args.eval_tokens),
    ]
    common += sum(
        [
            [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            for k in ("segment_length", "batch_size", "num_neighbors", "memory_size")
            if getattr(args, k)
        ],
        [],
    )
    try:
        config = planned_config(train.build_parser().parse_args(common))
    except cli.UsageError as e:
        raise cli.UsageError(str(e)) from None
    if not config.memory_size:
        raise cli.UsageError(f"preset {args.preset!r} has no memory to fine-tune into.")
    # every setting named, the preset's where a flag is not given: a run of other settings is then
    # refused
    common += [
        "--segment-length",
        str(config.segment_length),
        "--batch-size",
        str(config.batch_size),
        "--num-neighbors",
        str(config.num_neighbors),
        "--memory-size",
        str(config.memory_size),
    ]
    runs.check_fits(config, config.batch_size)
    runs.check_writable_dir(args.out_root, "--out-root")
    cache = cache_flags(args)
    # A fresh start counts its steps from 0 again: its own directory, and its curve shifted.
    tuned_dir = "fine_tuned_fresh_start" if args.fresh_start else "fine_tuned"
    dirs = {
        k: os.path.join(args.out_root, d)
        for k, d in (("no_memory", "no_memory"), ("fine_tuned", tuned_dir), ("memory", "memory"))
    }
    plan = [
        (
            "no memory",
            dirs["no_memory"],
            common + ["--memory-size", "0", "--steps", str(args.pretrain_steps)],
            args.pretrain_steps,
        ),
        (
            "fine-tuned with memory",
            dirs["fine_tuned"],
            common
            + ["--init-from", dirs["no_memory"], "--steps", str(args.finetune_steps)]
            + (["--fresh-start"] if args.fresh_start else []),
            args.finetune_steps if args.fresh_start else total,
        ),
        ("memory from scratch", dirs["memory"], common + ["--steps", str(total)], total),
    ]
    for _, out, flags, _ in plan:  # every run checked before any trains
        check_planned_run(out, flags)
    for name, out, flags, steps in plan:
        ev = finished_or_trained(name, out, flags, steps, cache)
        if isinstance(ev, int):
            return ev
    scratch, before = eval_curve(dirs["memory"]), eval_curve(dirs["no_memory"])
    shift = args.pretrain_steps if args.fresh_start else 0
    tuned = {
        **before,
        **{s + shift: r for s, r in eval_curve(dirs["fine_tuned"]).items()},
    }  # no memory, then memory
    # column -> metrics key: the reference losses by distance band (synthetic data), else the loss
    cols = {
        b: f"reference_loss_{b}"
        for b in evaluation.DISTANCE_BANDS
        if any(f"reference_loss_{b}" in r for r in scratch.values())
    } or {"loss": "eval_loss"}
    fmt = lambda rec, c: "-" if rec is None or cols[c] not in rec else f"{rec[cols[c]]:.3f}"
    print(
        "\nloss on the references by distance (synthetic data), or validation loss; fine-tuning "
        f"starts after step {args.pretrain_steps}"
    )
    print(
        f"{'step':>6} | "
        + " ".join(f"{'scratch ' + c:>13}" for c in cols)
        + " | "
        + " ".join(f"{'fine-tuned ' + c:>16}" for c in cols)
    )
    curve = []
    for step in sorted(set(scratch) | set(tuned)):
        a, b = scratch.get(step), tuned.get(step)
        print(
            f"{step:>6} | "
            + " ".join(f"{fmt(a, c):>13}" for c in cols)
            + " | "
            + " ".join(f"{fmt(b, c):>16}" for c in cols)
        )
        curve.append(
            {
                "step": step,
                "memory_from_scratch": a,
                "fine_tuned": b,
                "fine_tuned_has_memory": step > args.pretrain_steps,
            }
        )
    summary = os.path.join(args.out_root, f"{tuned_dir.replace('fine_tuned', 'finetune')}.json")
    runs.atomic_write(
        summary,
        runs.json_text(
            {
                "steps": args.pretrain_steps,
                "finetune_steps": args.finetune_steps,
                "fresh_start": args.fresh_start,
                "runs": dirs,
                "curve": curve,
            }
        ),
    )
    return 0


COMMANDS = {  # each command's one line in --help, and its flags (rows of cli.FLAGS)
    "perplexity": "validation perplexity, with and without memory",
    "curve": """the loss at several memory sizes (Sec. 4.4): in the held-out documents, or from a
        memorized code base (--load-memory) scored on --score's files; a table, --json, --plot""",
    "compare": "per-token loss difference between two memory sizes (Sec. 4.6)",
    "inspect": "what the memory retrieves for the tokens it helps most (Tables 6-8)",
    "explore": """an HTML page of a document: each token shaded by how much the memory lowered its
        loss, and what its prediction retrieved (Fig. 7, Appendix B)""",
    "recall": "recall of the approximate top-k on a trained model's real queries and keys",
    "reach": """Sec. 4.4: far-reference loss by distance and memory size, on synthetic documents
        with references D tokens back (the needle test), for a run trained on --data synthetic;
        --json holds a row per distance and memory size""",
    "finetune": """Sec. 4.4: train without memory, fine-tune with it, and compare with memory from
        scratch for the same total steps; --out-root gets no_memory, fine_tuned (or
        fine_tuned_fresh_start), memory and finetune.json (or finetune_fresh_start.json)""",
    "table": "Table 1 in miniature: the tiny model in the paper's rows",
}
OF_RUN = ["--data", "--data-format"]  # a trained run's, unless given
OF_DOC = ["--doc", "--max-tokens"]
OF_PRESET = ["--segment-length", "--batch-size", "--num-neighbors"]


def build_parser():
    p = cli.parser(__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = {}
    for name, text in COMMANDS.items():
        text = " ".join(text.split())
        s[name] = sub.add_parser(name, help=text, description=text)
    for name in ("perplexity", "curve", "compare", "inspect", "explore", "recall", "reach"):
        cli.add(s[name], ["run_dir"])
        cli.add(s[name], ["--ops"], unset="the run's")
    for name in ("perplexity", "curve", "compare", "inspect", "explore", "recall"):
        cli.add(s[name], OF_RUN, unset="the run's")
    cli.add(s["curve"], ["--memory-sizes"], CURVE_DEFAULTS)
    cli.add(s["curve"], ["--eval-docs", "--eval-tokens", "--exact-topk", "--num-neighbors",
                         "--memory-age-bias"], unset="the run's")
    cli.add(s["curve"], ["--band-memory", "--load-memory", "--score", "--suffixes", "--json",
                         "--plot"], helps=CURVE_HELPS)
    run_size = ["--memory-size", "--eval-docs", "--eval-tokens", "--exact-topk", "--num-neighbors"]
    run_size += ["--memory-age-bias"]
    cli.add(s["perplexity"], run_size, unset="the run's")
    cli.add(s["perplexity"], ["--band-memory", "--json", "--load-memory", "--score", "--csv"])
    cli.add(s["perplexity"], ["--suffixes"])
    cli.add(s["compare"], ["--memory-sizes", "--csv"], required=True)
    cli.add(s["compare"], OF_DOC + ["--plot"])
    cli.add(s["inspect"], OF_DOC + ["--top"])
    cli.add(s["explore"], OF_DOC + ["--memories"])
    for name in ("inspect", "explore"):
        cli.add(s[name], ["--load-memory", "--score", "--suffixes"])
    cli.add(s["explore"], ["--html"], required=True)
    cli.add(s["recall"], ["--memory-size", "--dtype"], unset="the run's")
    cli.add(s["recall"], OF_DOC + ["--json"])
    cli.add(s["reach"], ["--distances", "--memory-sizes", "--docs"], REACH_DEFAULTS)
    cli.add(s["reach"], ["--exact-topk"], unset="the run's")
    cli.add(s["reach"], ["--probe-seed", "--json"])
    finetune = ["--preset", "--data", "--pretrain-steps", "--finetune-steps", "--fresh-start"]
    finetune += ["--eval-every", "--eval-docs", "--eval-tokens"]
    cli.add(s["finetune"], finetune, FINETUNE_DEFAULTS)
    cli.add(s["finetune"], OF_PRESET + ["--memory-size"], unset="the preset's")
    cli.add(s["finetune"], ["--cache-dir", "--out-root"], {"--out-root": "runs/finetune"})
    cli.add(s["table"], ["--data", "--steps"], {"--steps": 1200})
    cli.add(s["table"], OF_PRESET + ["--init-gate-bias"], unset="the preset's")
    cli.add(s["table"], ["--seeds", "--rows", "--cache-dir", "--out-root"], TABLE_DEFAULTS)
    return p


CURVE_DEFAULTS = {"--memory-sizes": "512,2048,8192,65536"}
CURVE_HELPS = {
    "--plot": "a PNG of the loss and its bands against M (needs matplotlib)",
    "--load-memory": """a memory file (memorize.py's, best made at the largest size): each size
        keeps its last slots, FIFO, or adds free ones""",
}
REACH_DEFAULTS = {"--memory-sizes": "512,2048,8192,65536"}
FINETUNE_DEFAULTS = {
    "--preset": "synthetic",
    "--data": "synthetic",
    "--eval-every": 100,
    "--eval-docs": 16,
    "--eval-tokens": 1024,
}
TABLE_DEFAULTS = {"--out-root": "runs/table"}


def run(args):
    # Every output checked before any work, by the one rule (runs.check_output): never onto what
    # the command reads (the run's files, a memory file, a scored PATH), a corpus or a cache.
    run_dir = getattr(args, "run_dir", None)
    saved = runs.read_json(os.path.join(run_dir, "config.json")) if run_dir else None
    run_args = (saved or {}).get("args") or {}
    sources = [d for d in (run_args.get("data"), getattr(args, "data", None)) if isinstance(d, str)]
    caches = [
        d
        for d in (run_args.get("cache_dir"), getattr(args, "cache_dir", None), cli.cache_dir())
        if isinstance(d, str)
    ]
    inputs = [os.path.join(run_dir, name) for name in runs.RUN_FILES] if run_dir else []
    inputs += [p for p in (getattr(args, "load_memory", None), getattr(args, "score", None)) if p]
    for name in ("json", "csv", "plot", "html"):
        if getattr(args, name, None):
            runs.check_output(getattr(args, name), f"--{name}", inputs, sources, caches)
    refuse_unused(args)
    return {
        "perplexity": cmd_perplexity,
        "curve": cmd_curve,
        "compare": cmd_compare,
        "inspect": cmd_inspect,
        "explore": cmd_explore,
        "recall": cmd_recall,
        "reach": cmd_reach,
        "finetune": cmd_finetune,
        "table": cmd_table,
    }[args.command](args)


def main(argv=None):
    return cli.run_main(build_parser(), run, argv)


if __name__ == "__main__":
    cli.exit_with(main())

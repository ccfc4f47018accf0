"""Generate text from a trained run, with its memory: the prompt streams through the model
segment by segment, as in training, and the continuation can retrieve from all of it.

  python sample.py RUN_DIR --prompt "def main(" --tokens 200
  python sample.py RUN_DIR --prompt-file long_file.py --tokens 100 --temperature 0   # greedy
  python sample.py RUN_DIR --prompt-file long_file.py --tokens 100 --memory-off      # gates at 0
  python sample.py RUN_DIR --prompt-doc 0 --prompt-tokens 700 --tokens 3 --temperature 0 --echo

How it decodes. A segment of T tokens is the model's unit. Every complete segment (of the
prompt, then of the generated text) goes through `forward` once, which writes it to the
memory and the XL cache exactly as training and evaluation do. The tokens of the segment
that is not yet complete are run again for every new token, padded to T, and only the
logits at the last real position are read; the state that call returns is dropped. So a
new token costs one forward pass over T positions where an incremental key/value cache
would compute one: simple, and the logits are exactly those of streaming the whole text.
"""

import startup  # first: before JAX loads (malloc on a CPU; an early Ctrl-C leaves in one line)

if __name__ == "__main__":
    startup.leave_on_early_signals()

import argparse

import jax.numpy as jnp
import numpy as np

import cli
import corpora
import evaluate
import evaluation
import memorizing_transformer as mt


def next_token(logits, temperature, top_k, rng):
    """Greedy for temperature 0; else a draw from softmax(logits / temperature),
    restricted to the top_k most likely tokens when top_k is given."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    with np.errstate(
        over="ignore"
    ):  # <= 0, so a tiny temperature gives -inf (p = 0), never inf - inf
        z = (z - z.max()) / temperature
    if top_k and top_k < len(z):
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z)  # the most likely token has z = 0, p = 1
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(
    params,
    config,
    prompt,
    num_tokens,
    temperature=1.0,
    top_k=None,
    seed=0,
    vocab=None,
    on_token=None,
    start=None,
):
    """Continue `prompt` (token ids) by num_tokens tokens; returns the new ids.
    vocab: draw only ids below it (a tokenizer may have fewer pieces than the
    model's vocab_size). on_token(id) is called as each token is chosen. start:
    a loaded memory's state (memory_file.start_state), which the prompt's tokens
    are appended to in place (it is used up)."""
    if not len(prompt):
        raise ValueError("the prompt has no tokens.")
    T = config.segment_length
    # Every call takes the state in place (donated): no token copies the memory. A partial
    # segment's call appends the last complete segment to the memory, as the next call would
    # (the same pairs in the same slots), and what else it changes is put back (keep).
    step = evaluation.make_forward_step(evaluation.step_config(config), logits=True)
    keep = ("prev_k", "prev_v", "prev_valid", "mem_pos")  # the XL cache, the write position
    rng = np.random.default_rng(seed)
    state, text, done = (
        mt.init_state(config, 1) if start is None else start,
        [int(t) for t in prompt],
        0,
    )  # text[:done] is in the state

    def run(segment, state):
        tokens = np.zeros((1, T), np.int32)
        tokens[0, : len(segment)] = segment
        mask = np.arange(T)[None] < len(segment)
        reset = np.array([done == 0 and start is None])  # a loaded memory: the start, no reset
        batch = {"tokens": tokens, "targets": tokens, "mask": mask, "reset": reset}
        return step(params, state, batch)

    new = []
    while len(new) < num_tokens:
        while len(text) - done > T:  # a complete segment with a token after it: into the state
            state = run(text[done : done + T], state).state
            done += T
        kept = {name: jnp.copy(getattr(state, name)) for name in keep}  # (small)
        out = run(text[done:], state)  # 1 to T tokens
        state, logits = out.state._replace(**kept), out.logits
        token = next_token(
            np.asarray(logits[0, len(text) - done - 1, :vocab]), temperature, top_k, rng
        )
        text.append(token)
        new.append(token)
        if on_token:
            on_token(token)
    return new


class TextStream:
    """Writes the text of a growing list of tokens as each token comes. A
    character outside the tokenizer's pieces is spelled by byte pieces, one
    token a byte, and until its last byte comes the decoder shows U+FFFD for the
    partial ones: text ending in U+FFFD is held back until a later token
    resolves it or `close` writes it as it is. So what is written, in all, is
    `sp.decode` of all the tokens. before: tokens that come first and are not
    written (the prompt); a character they leave unfinished is written whole
    when the tokens that finish it come.

    Each token decodes the tokens since the last point where all was written,
    after `context` tokens before it, not the whole text (which grows with a
    long prompt). The context keeps what a decoder does at the start of a text
    (a leading space dropped) off the text that is written."""

    def __init__(self, sp, write, before=(), context=16):
        self.sp, self.write, self.context, self.ids = sp, write, context, [int(t) for t in before]
        text = sp.decode(self.ids)
        self.shown = len(text.rstrip("\ufffd"))
        self.before = text[
            : self.shown
        ]  # what `before` spells, less a character it leaves unfinished
        self._trim(text)

    def add(self, token):
        self.ids.append(int(token))
        text = self.sp.decode(self.ids)  # a character can span tokens
        ready = len(text.rstrip("\ufffd"))
        if ready > self.shown:
            self.write(text[self.shown : ready])
            self.shown = ready
        self._trim(text)

    def _trim(self, text):
        if (
            self.shown == len(text) and len(self.ids) > 2 * self.context
        ):  # all written: decode from here on
            self.ids = self.ids[-self.context :]
            self.shown = len(self.sp.decode(self.ids))

    def close(self):
        self.write(self.sp.decode(self.ids)[self.shown :])


def build_parser():
    p = cli.parser(__doc__)
    cli.add(p, ["run_dir"])
    prompt = p.add_mutually_exclusive_group(required=True)
    cli.add(prompt, ["--prompt", "--prompt-file", "--prompt-doc"])
    cli.add(p, ["--prompt-tokens", "--tokens", "--temperature", "--top-k", "--draw-seed"])
    cli.add(p, ["--memory-size", "--memory-age-bias", "--ops"], unset="the run's")
    cli.add(p, ["--memory-off", "--echo", "--load-memory"])
    return p


def sample(args):
    if args.temperature < 0:
        raise cli.UsageError(f"--temperature must be >= 0, got {args.temperature}.")
    if args.prompt_tokens and args.prompt_doc is None:
        raise cli.UsageError("--prompt-tokens goes with --prompt-doc.")
    text = args.prompt
    try:  # a shell passes bytes that are not UTF-8 as lone surrogates, which no tokenizer takes
        (text or "").encode("utf-8")
    except UnicodeEncodeError:
        raise cli.UsageError("--prompt is not UTF-8 text.") from None
    if args.prompt_file is not None:
        text = corpora.read_text(args.prompt_file, "--prompt-file")
    # --memory-size: the run's M, or with --load-memory the slots to grow the file's to
    size = None if args.load_memory else args.memory_size
    changes = evaluate.eval_changes(args)
    config, params, sp, run_args = evaluate.load_run(args.run_dir, size, changes)
    config, start, _ = evaluate.load_memory(args, config, params, args.memory_size)
    params = mt.memory_off(params) if args.memory_off and config.active_memory_layers else params
    if (
        args.prompt_doc is not None or run_args["tokenizer"] is None
    ):  # (an older checkpoint: its documents hold the
        # tokenizer to the run, as evaluate.py's validation set does)
        docs, _ = evaluate.validation_docs(
            argparse.Namespace(data=None, data_format=None), run_args, sp, config
        )
    if args.prompt_doc is not None:
        if args.prompt_doc >= len(docs):
            raise cli.UsageError(
                f"--prompt-doc {args.prompt_doc} is out of range: the validation set has "
                f"{corpora.plural(len(docs), 'document')}."
            )
        prompt = [int(t) for t in docs[args.prompt_doc][: args.prompt_tokens]]
    else:
        prompt = sp.encode(text)
    if not prompt:
        raise cli.UsageError(
            "the prompt is empty: give --prompt TEXT or a non-empty --prompt-file."
        )
    stream = TextStream(sp, lambda text: print(text, end="", flush=True), prompt)
    if (
        args.echo
    ):  # what the prompt's tokens spell (= the --prompt text), but for a character that it cuts
        print(stream.before, end="", flush=True)
    generate(
        params,
        config,
        prompt,
        args.tokens,
        args.temperature,
        args.top_k,
        args.draw_seed,
        sp.get_piece_size(),
        stream.add,
        start,
    )
    stream.close()
    print(flush=True)
    cli.say(
        f"({len(prompt)} prompt tokens, {args.tokens} generated, memory "
        f"{'off' if args.memory_off else config.memory_size})"
    )
    return 0


def main(argv=None):
    return cli.run_main(build_parser(), sample, argv)


if __name__ == "__main__":
    cli.exit_with(main())

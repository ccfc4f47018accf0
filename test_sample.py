"""sample.py: greedy decoding against streaming forward, seeds, and the command line."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import corpora
import data
import jax
import memorizing_transformer as mt
import presets
import sample
from test_cli import assert_refused, call

# A toy model whose memory (M = 2T) fills and wraps many times over a prompt of 5T tokens.
TOY = presets.RunConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=2,
    head_dim=16,
    d_ff=64,
    segment_length=8,
    memory_size=16,
    memory_layers=(1,),
    num_neighbors=4,
    batch_size=1,
)


def streamed_logits(params, config, tokens):
    """The reference: the whole text through forward in full segments, state carried, as in
    evaluation; logits [len(tokens), V] (position i predicts token i + 1)."""
    T, state, out = config.segment_length, mt.init_state(config, 1), []
    forward = jax.jit(mt.forward, static_argnums=4)  # one program, not one per operation
    for start in range(0, len(tokens), T):
        seg = np.zeros((1, T), np.int32)
        part = tokens[start : start + T]
        seg[0, : len(part)] = part
        logits, state = forward(
            params, state, seg, np.array([start == 0]), config, np.arange(T)[None] < len(part)
        )
        out.append(np.asarray(logits[0, : len(part)]))
    return np.concatenate(out)


@pytest.mark.parametrize(
    "prompt_length", [1, 8, 43]
)  # inside a segment, exactly one, and > M with a remainder
def test_greedy_decoding_is_the_argmax_of_streamed_forward_at_every_position(prompt_length):
    params = mt.init_params(TOY, jax.random.PRNGKey(prompt_length))
    params["layers"][1]["gate_bias"] = params["layers"][1]["gate_bias"] + 1.0  # lean on the memory
    prompt = np.random.default_rng(prompt_length).integers(1, TOY.vocab_size, prompt_length)
    new = sample.generate(params, TOY, prompt, 30, temperature=0)
    text = np.concatenate([prompt, new])
    logits = streamed_logits(params, TOY, text)
    for i in range(prompt_length, len(text)):
        assert text[i] == np.argmax(logits[i - 1]), i
    assert (
        len(text) > 4 * TOY.memory_size or prompt_length < 43
    )  # the longest case wraps the memory


def test_the_memory_changes_what_is_generated_and_the_seed_fixes_a_draw():
    params = mt.init_params(TOY, jax.random.PRNGKey(0))
    prompt = np.random.default_rng(0).integers(1, TOY.vocab_size, 40)
    draw = lambda p, seed: sample.generate(p, TOY, prompt, 25, temperature=1.0, top_k=8, seed=seed)
    assert draw(params, 3) == draw(params, 3)
    assert draw(params, 3) != draw(params, 4)
    assert sample.generate(params, TOY, prompt, 25, 0) != sample.generate(
        mt.memory_off(params), TOY, prompt, 25, 0
    )


def test_top_k_and_vocab_restrict_the_draw():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.0, 3.0, 9.0])
    draws = {sample.next_token(logits[:4], 1.0, 2, rng) for _ in range(200)}
    assert draws == {1, 2}
    assert sample.next_token(logits, 0, None, rng) == 4
    # A tiny temperature is the greedy limit, not a NaN (logits / 5e-324 once overflowed to inf -
    # inf).
    for t in (5e-324, 1e-300, 1e-30):
        assert {sample.next_token(logits, t, None, rng) for _ in range(20)} == {4}
        assert {
            sample.next_token(np.array([1.0, 3.0, 3.0, -2.0]), t, None, rng) for _ in range(100)
        } == {1, 2}
    big = sample.next_token(np.array([1e30, -1e30, 0.0]), 1e-300, 2, rng)
    assert big == 0


TOKENIZER_TEXT = "the cat sat on the mat; the dog sat on the log.\n\tdef f(x): return x + 1\n"


@pytest.fixture(scope="module")
def small_tokenizers(tmp_path_factory):
    """Tokenizers with no piece for "é€中😀" (they are spelled in byte pieces): ours, and one
    whose decoder drops a text's leading space (add_dummy_prefix, as a user's --tokenizer may
    have it)."""
    import io
    import sentencepiece as spm

    ours = data.train_tokenizer(
        [corpora.Document(str(i), TOKENIZER_TEXT) for i in range(20)],
        300,
        str(tmp_path_factory.mktemp("tok") / "small.model"),
    )
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT.splitlines() * 20),
        model_writer=model,
        vocab_size=300,
        hard_vocab_limit=False,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        minloglevel=2,
        add_dummy_prefix=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
    )
    dummy = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert dummy.decode([dummy.piece_to_id("\u2581sat")]) == "sat"  # the leading space dropped
    return ours, dummy


PARTS = st.lists(
    st.one_of(
        st.sampled_from(["é", "€", "中", "😀", "cat ", " sat", "\n", " "]),
        st.integers(0, 299),
    ),
    max_size=16,
)


@settings(deadline=None, max_examples=80, derandomize=True)
@given(PARTS, PARTS, st.integers(0, 3), st.sampled_from([0, 1]), st.sampled_from([1, 2, 16]))
def test_the_text_stream_writes_exactly_the_decoded_text(
    small_tokenizers, before, parts, cut, which, context
):
    """The printed continuation, written a token at a time, is sp.decode of the prompt and
    the new tokens, less the prompt's finished characters: a character spelled over several
    byte pieces is held back until complete, not written as U+FFFD (the old per-token
    difference wrote "a\ufffd\ufffd" for "a€"), and a character the prompt leaves unfinished
    (cut `cut` tokens early) is written whole; what can be shown is shown as soon as it can.
    The stream decodes only the tokens since all was last written, after `context` tokens
    before them: with a decoder that drops a text's leading space, too."""
    sp = small_tokenizers[which]
    assert sp.encode("€")[-3:] == [
        sp.piece_to_id(f"<0x{b:02X}>") for b in "€".encode()
    ]  # byte pieces
    ids_of = lambda p: sp.encode(p) if isinstance(p, str) else [p % sp.get_piece_size()]
    tokens = lambda parts: [i for p in parts for i in ids_of(p)]
    prompt, ids = tokens(before), tokens(parts)
    cut = min(cut, len(prompt))
    prompt, ids = prompt[: len(prompt) - cut], prompt[len(prompt) - cut :] + ids
    written = []
    stream = sample.TextStream(sp, written.append, prompt, context)
    shown = sp.decode(prompt).rstrip("\ufffd")
    assert not written and stream.before == shown
    for n, token in enumerate(ids, 1):
        stream.add(token)
        assert shown + "".join(written) == sp.decode(prompt + ids[:n]).rstrip("\ufffd")
        if not sp.decode(prompt + ids[:n]).endswith(
            "\ufffd"
        ):  # all written: a short window decodes on
            assert len(stream.ids) <= 2 * context
    stream.close()
    assert shown + "".join(written) == sp.decode(prompt + ids)
    if which == 0 and all(
        isinstance(p, str) for p in before + parts
    ):  # whole characters: the text itself
        assert shown + "".join(written) == "".join(before + parts)
        assert "\ufffd" not in shown + "".join(written)


def test_the_command_line_continues_a_prompt_and_refuses_bad_input(finished_run, tmp_path, capsys):
    code, out, err = call(
        "sample",
        [str(finished_run), "--prompt", "KALO FIBE\n", "--tokens", "40", "--temperature", "0"],
        capsys,
    )
    assert code == 0, err
    assert out.strip() and "40 generated" in err
    again = call(
        "sample",
        [str(finished_run), "--prompt", "KALO FIBE\n", "--tokens", "40", "--temperature", "0"],
        capsys,
    )[1]
    assert again == out
    code, out, err = call(
        "sample",
        [
            str(finished_run),
            "--prompt-doc",
            "0",
            "--prompt-tokens",
            "50",
            "--tokens",
            "5",
            "--echo",
        ],
        capsys,
    )
    assert code == 0 and "50 prompt tokens, 5 generated" in err
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    (tmp_path / "empty.txt").write_text("")
    for argv, message in (
        ([], "one of the arguments --prompt --prompt-file --prompt-doc is required"),
        (["--prompt", ""], "the prompt is empty"),
        (["--prompt-file", str(tmp_path / "missing.txt")], "missing.txt does not exist"),
        (["--prompt-file", str(tmp_path)], "is a directory, not a file"),
        (["--prompt-file", str(tmp_path / "latin1.txt")], "is not UTF-8"),
        (["--prompt-file", str(tmp_path / "empty.txt")], "the prompt is empty"),
        (["--prompt", "x", "--tokens", "0"], "must be positive"),
        (["--prompt", "x", "--temperature", "-1"], "--temperature must be >= 0"),
        (["--prompt", "x", "--temperature", "nan"], "finite"),
        (["--prompt", "x", "--top-k", "0"], "must be positive"),
        (["--prompt", "x", "--memory-size", "100"], "multiple of segment_length"),
        (["--prompt-doc", "99"], "out of range"),
        (["--prompt", "x", "--prompt-tokens", "5"], "goes with --prompt-doc"),
    ):
        code, _, err = call("sample", [str(finished_run)] + argv, capsys)
        assert_refused(code, err, argv)
        assert message in err, (argv, err)

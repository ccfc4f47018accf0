"""A run's files and the caches, under careless use: an output never replaces a run's, a corpus's or
a cache's file; config.json is read strictly; a cache that cannot be read is rebuilt; a closed
stdout or stderr keeps the command's exit code; a prompt file is read as a corpus file is; a run's
tokenizer is held to it. The fixtures `cache` and `finished_run` are conftest.py's."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import corpora
import data
import presets
import runs
from conftest import child_env
from test_cli import assert_refused, call, snapshot
from test_train import FAST

HERE = os.path.dirname(os.path.abspath(__file__))


def test_an_output_never_replaces_a_runs_files_nor_a_file_in_a_corpus_or_a_cache(
    tmp_path, finished_run, cache, capsys
):
    """`evaluate.py perplexity RUN --json RUN/checkpoint.npz` replaced the checkpoint with the JSON,
    exit 0. Every output flag is refused in one sentence, before any work, where it names a file of
    a run directory (also through a link), or a file inside the corpus or the cache it reads."""
    run, corpus = tmp_path / "run", tmp_path / "corpus"
    shutil.copytree(finished_run, run)
    os.symlink(run, tmp_path / "link")
    corpus.mkdir()
    (corpus / "a.txt").write_text("a document of the corpus\n" * 20)
    (corpus / "b.txt").write_text("another document\n" * 20)
    perplexity = ["perplexity", str(run), "--eval-docs", "1", "--eval-tokens", "64"]
    probes = [
        ("evaluate", perplexity + ["--json", str(run / name)], "of the run in")
        for name in runs.RUN_FILES
    ]
    probes += [
        (
            "evaluate",
            perplexity + ["--json", str(tmp_path / "link" / "eval.json")],
            "of the run in",
        ),
        (
            "evaluate",
            ["compare", str(run), "--memory-sizes", "0,64", "--csv", str(run / "metrics.jsonl")],
            "of the run in",
        ),
        (
            "evaluate",
            [
                "compare",
                str(run),
                "--memory-sizes",
                "0,64",
                "--csv",
                str(tmp_path / "d.csv"),
                "--plot",
                str(run / "tokenizer.model"),
            ],
            "of the run in",
        ),
        ("evaluate", ["explore", str(run), "--html", str(run / "config.json")], "of the run in"),
        ("evaluate", ["recall", str(run), "--json", str(run / "checkpoint.npz")], "of the run in"),
        ("benchmark", ["--memory-sizes", "0", "--json", str(run / "eval.json")], "of the run in"),
        (
            "evaluate",
            perplexity + ["--data", str(corpus), "--json", str(corpus / "a.txt")],
            "inside the corpus",
        ),
        (
            "evaluate",
            perplexity + ["--data", str(corpus), "--json", str(corpus / "new.json")],
            "inside the corpus",
        ),
        (
            "evaluate",
            perplexity + ["--json", os.path.join(cache, "tokens.json")],
            "inside the cache",
        ),
    ]
    before = snapshot(tmp_path, cache)
    for script, argv, message in probes:
        code, out, err = call(script, argv, capsys)
        assert_refused(code, err, argv)
        assert message in err and out == "", (argv, err)
    assert snapshot(tmp_path, cache) == before
    code, _, err = call(
        "evaluate", perplexity + ["--json", str(run / "notes.json")], capsys
    )  # any other file
    assert code == 0 and json.loads((run / "notes.json").read_text())["tokens"] == 64, err


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c.update(xl_cache="false"),
            'the field xl_cache must be true or false, got "false"',
        ),
        (lambda c: c.update(exact_topk=1), "the field exact_topk must be true or false, got 1"),
        (
            lambda c: c.update(segment_length=32.0),
            "the field segment_length must be an integer, got 32.0",
        ),
        (
            lambda c: c.update(segment_length=True),
            "the field segment_length must be an integer, got true",
        ),
        (lambda c: c.update(lr="1.0"), 'the field lr must be a number, got "1.0"'),
        (
            lambda c: c.update(memory_layers=1),
            "the field memory_layers must be a list of integers, got 1",
        ),
        (lambda c: c.update(dtype=None), "the field dtype must be a string, got null"),
        (lambda c: c.update(bogus=1), "a field 'bogus' that this project's Config does not have"),
    ],
)
def test_a_runs_config_is_read_strictly(tmp_path, finished_run, cache, capsys, edit, message):
    """A missing field once took the dataclass's default without a word (a run of T = 32 was scored
    at T = 512), and "xl_cache": "false" was read as true. Every field must be there, with its JSON
    type, for every command that reads a run."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    saved = json.loads((run / "config.json").read_text())
    edit(saved["config"])
    (run / "config.json").write_text(json.dumps(saved))
    before = snapshot(run)
    for script, argv in (
        ("evaluate", ["perplexity", str(run)]),
        ("sample", [str(run), "--prompt", "x"]),
        ("train", ["--out", str(run), "--resume", "--steps", "3", "--cache-dir", cache]),
    ):
        code, _, err = call(script, argv, capsys)
        assert_refused(code, err, (script, message))
        assert message in err, err
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "fields", [("init_gate_bias", "attention"), ("memory_age_bias",), ("dropout", "cross_batch")]
)
def test_a_run_written_before_a_field_was_added_is_read_with_its_default_and_a_note(
    tmp_path, finished_run, capsys, fields
):
    """A run from before a Config field existed lacks it: read with its default (what the code
    did before the field), and one line says so. No list names such fields: any of them."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    saved = json.loads((run / "config.json").read_text())
    for name in fields:
        saved["config"].pop(name)
    (run / "config.json").write_text(json.dumps(saved))
    code, out, err = call(
        "evaluate", ["perplexity", str(run), "--eval-docs", "1", "--eval-tokens", "64"], capsys
    )
    assert code == 0 and out.startswith("memory 64: perplexity"), err
    names = sorted(fields)
    known = {f.name: f.default for f in dataclasses.fields(presets.RunConfig)}
    s = "s" * (len(names) > 1)
    defaults = ", ".join(f"{n} {known[n]!r}" for n in names)
    assert err == (
        f"note: {run / 'config.json'} was written before the field{s} {', '.join(names)}: read "
        f"with the default{s}, {defaults}.\n"
    )


def test_a_token_cache_or_tokenizer_that_cannot_be_read_is_rebuilt_with_a_line_saying_so(
    tmp_path, cache, finished_run, capsys
):
    """A token cache truncated to 1000 bytes ended train.py in a traceback (zipfile.BadZipFile); a
    cached tokenizer that was not a model was refused without naming the file to delete. Both are
    made again, with one line each, and the run goes on."""
    own = tmp_path / "cache"
    shutil.copytree(cache, own, ignore=shutil.ignore_patterns("jax"))
    # The session's cache may hold other tests' corpora too: every file of a kind is broken, and
    # the note must name one of them, the one FAST reads.
    tokens = sorted(own.glob("tokens-*-train.npz"))
    tokenizers = sorted(own.glob("tokenizer-*.model"))
    assert tokens and tokenizers  # FAST's at least, from finished_run
    for path in tokens:
        path.write_bytes(path.read_bytes()[:1000])
    code, out, err = call(
        "train",
        FAST + ["--steps", "1", "--out", str(tmp_path / "a"), "--cache-dir", str(own)],
        capsys,
    )
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note: the token cache ")]
    assert len(notes) == 1 and notes[0] in [
        f"note: the token cache {p} cannot be read; tokenizing again." for p in tokens
    ]
    with np.load(notes[0].split()[4]) as z:  # whole again
        assert z["offsets"][-1] == len(z["tokens"])
    for path in tokenizers:
        path.write_bytes(b"not a model")
    code, out, err = call(
        "train",
        FAST + ["--steps", "1", "--out", str(tmp_path / "b"), "--cache-dir", str(own)],
        capsys,
    )
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note: the cached tokenizer ")]
    assert len(notes) == 1 and notes[0] in [
        f"note: the cached tokenizer {p} cannot be read; training it again." for p in tokenizers
    ]
    assert data.load_tokenizer(notes[0].split()[4]).get_piece_size() > 256


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_keeps_the_exit_code_and_prints_no_traceback(tmp_path, closed):
    """`python train.py --steps 0 >&-` printed its refusal, then an AttributeError from exit_with's
    flush, and ended with exit code 1. With either stream closed the command ends as it meant to:
    2 for the refusal, 0 for --help."""
    fd = {"stdout": 1, "stderr": 2}[closed]
    for argv, code in ((["--steps", "0"], 2), (["--help"], 0)):
        proc = subprocess.run(
            ["sh", "-c", f'exec "$0" "$@" {fd}>&-', sys.executable, "train.py"] + argv,
            cwd=HERE,
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )
        other = proc.stderr if closed == "stdout" else proc.stdout
        assert proc.returncode == code, (argv, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr
        if closed == "stdout" and code == 2:
            assert other.startswith("error: ") and other.count("\n") == 1, other


def test_a_prompt_file_is_read_as_a_corpus_file_is(tmp_path, finished_run, capsys):
    """--prompt-file /dev/zero read until memory ran out, and then advised a smaller batch: only a
    regular file is read, and one of at most the bound the message names."""
    os.mkfifo(tmp_path / "fifo")
    for path, message in (
        ("/dev/zero", "is not a regular file"),
        (str(tmp_path / "fifo"), "is not a regular file"),
        (str(tmp_path), "is a directory, not a file"),
        (str(tmp_path / "none"), "does not exist"),
    ):
        code, _, err = call("sample", [str(finished_run), "--prompt-file", path], capsys)
        assert_refused(code, err, path)
        assert f"--prompt-file {path} {message}" in err
    (tmp_path / "big.txt").write_text("x" * 100)
    with pytest.raises(corpora.DataError, match="has 100 bytes, more than the 99 this reads"):
        corpora.read_text(str(tmp_path / "big.txt"), "--prompt-file", limit=99)
    assert corpora.read_text(str(tmp_path / "big.txt"), "--prompt-file", limit=100) == "x" * 100


def test_sample_refuses_another_runs_tokenizer_as_evaluate_does(
    tmp_path, finished_run, cache, capsys
):
    """With another run's tokenizer copied in, sample.py generated without a word (its ids meaning
    other words). The checkpoint records the hash of the run's tokenizer; both refuse another."""
    other, run = tmp_path / "other", tmp_path / "run"
    assert (
        call(
            "train",
            FAST
            + ["--vocab-size", "1024", "--steps", "1", "--out", str(other), "--cache-dir", cache],
            capsys,
        )[0]
        == 0
    )
    shutil.copytree(finished_run, run)
    shutil.copy(other / "tokenizer.model", run / "tokenizer.model")
    for script, argv in (
        ("sample", [str(run), "--prompt", "x"]),
        ("evaluate", ["perplexity", str(run)]),
    ):
        code, out, err = call(script, argv, capsys)
        assert_refused(code, err, script)
        assert "is not the tokenizer the run in" in err and out == ""


def _rewrite_checkpoint(run, edit):
    """Load run's checkpoint.npz, let edit(arrays) change the arrays, write it back."""
    with np.load(run / "checkpoint.npz") as z:
        arrays = {k: z[k] for k in z.files}
    edit(arrays)
    with open(run / "checkpoint.npz", "wb") as f:
        np.savez(f, **arrays)


def _as_before_prev(arrays):
    """The state as checkpoints stored it before State.prev_*: the XL cache in cache_*, and the
    memory layer's (layer 1 of FAST) last segment in pending_*, both of the last segment."""
    k, v, valid = (arrays.pop(f"state['prev_{x}']") for x in ("k", "v", "valid"))
    arrays.update({"state['cache_k']": k, "state['cache_v']": v, "state['cache_valid']": valid})
    arrays["state['pending_k']"] = k[:, [1]]  # [B, Lm, H, T, D]
    arrays["state['pending_v']"] = v[:, [1]]
    arrays["state['pending_valid']"] = valid


def test_a_checkpoint_written_before_the_state_was_renamed_resumes_to_the_same_run(
    tmp_path, finished_run, cache, capsys
):
    """A checkpoint with the old state fields (cache_*, pending_*) resumes to the same weights,
    bit for bit, as the same checkpoint in today's fields."""
    runs_dir = {}
    for name, edit in (("today", lambda a: None), ("before", _as_before_prev)):
        run = runs_dir[name] = tmp_path / name
        shutil.copytree(finished_run, run)
        _rewrite_checkpoint(run, edit)
        argv = ["--out", str(run), "--resume", "--steps", "3", "--cache-dir", cache]
        code, _, err = call("train", argv, capsys)
        assert code == 0, err
    with np.load(runs_dir["today"] / "checkpoint.npz") as a:
        with np.load(runs_dir["before"] / "checkpoint.npz") as b:
            assert sorted(a.files) == sorted(b.files)
            for key in a.files:
                np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("position", [10**6, -64, 1])
def test_a_checkpoint_whose_memory_position_is_off_the_ring_is_refused(
    tmp_path, finished_run, cache, capsys, position
):
    """A write position of 10^6 once resumed with exit 0, and dynamic_update_slice clamped the
    first write onto the wrong slots; one that is not a multiple of T would write across the
    ring's end. Each is refused in one sentence, before any file changes."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    key = "state['mem_pos']"
    _rewrite_checkpoint(run, lambda a: a.update({key: np.full_like(a[key], position)}))
    before = snapshot(run)
    argv = ["--out", str(run), "--resume", "--steps", "3", "--cache-dir", cache]
    code, _, err = call("train", argv, capsys)
    assert_refused(code, err, argv)
    assert f"memory write position of {position}, where the memory of 64 slots" in err, err
    assert snapshot(run) == before


def test_a_checkpoint_value_that_its_dtype_cannot_hold_is_refused_before_any_cast(
    tmp_path, finished_run, cache, capsys
):
    """A write position stored as int64 2^32 + 128 once became 128 in the cast to int32, a
    valid position, and --resume went on. Every integer is checked against the dtype it is
    read as, before the cast."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    key = "state['mem_pos']"
    _rewrite_checkpoint(run, lambda a: a.update({key: np.full(a[key].shape, 2**32 + 128)}))
    before = snapshot(run)
    argv = ["--out", str(run), "--resume", "--steps", "3", "--cache-dir", cache]
    code, _, err = call("train", argv, capsys)
    assert_refused(code, err, argv)
    assert "outside int32's range" in err, err
    assert snapshot(run) == before

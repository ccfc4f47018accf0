"""data.py: the batching invariants against explicit bookkeeping, sources, tokenizer, bad input."""

import functools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import corpora
import data

SETTINGS = settings(deadline=None, max_examples=40, derandomize=True)
docs_strategy = st.lists(st.integers(2, 60), min_size=1, max_size=12).map(
    lambda lengths: [np.arange(1, n + 1, dtype=np.int32) + 1000 * i for i, n in enumerate(lengths)]
)


def run_epoch(docs, B, T, seed=0):
    """Collect, per row, the stream of (tokens, targets, mask, reset) until every document of the
    first epoch has been started and finished."""
    it = data.segment_batches(docs, B, T, seed)
    batches = []
    for _ in range(sum(-(-(len(d) - 1) // T) for d in docs) + 2):
        batches.append(next(it))
    return batches


@SETTINGS
@given(
    docs=docs_strategy,
    B=st.sampled_from([1, 2, 3]),
    T=st.sampled_from([1, 4, 7]),
    seed=st.integers(0, 5),
)
def test_rows_reproduce_documents_in_order_with_next_token_targets(docs, B, T, seed):
    if len(docs) < B:
        with pytest.raises(corpora.DataError, match="fewer than"):
            data.segment_batches(docs, B, T, seed)
        return
    by_id = {int(d[0]) // 1000: d for d in docs}
    for b in range(B):
        current, tokens, targets = None, [], []
        for batch in run_epoch(docs, B, T, seed):
            if batch["reset"][b]:  # a document starts exactly here
                if current is not None:
                    np.testing.assert_array_equal(tokens, current[:-1])
                    np.testing.assert_array_equal(targets, current[1:])
                current = by_id[int(batch["tokens"][b, 0]) // 1000]
                assert batch["tokens"][b, 0] == current[0]
                tokens, targets = [], []
            m = batch["mask"][b]
            # No segment mixes two documents; every target is the next token of its own document.
            assert {int(t) // 1000 for t in batch["tokens"][b][m]} <= {int(current[0]) // 1000}
            tokens += batch["tokens"][b][m].tolist()
            targets += batch["targets"][b][m].tolist()
            assert m.tolist() == sorted(m.tolist(), reverse=True)  # padding only at the end
        # the document in progress is a prefix of its document
        np.testing.assert_array_equal(tokens, current[: len(tokens)])


@SETTINGS
@given(docs=docs_strategy, T=st.sampled_from([1, 4, 7]), seed=st.integers(0, 5))
def test_reset_marks_every_document_start_and_nothing_else(docs, T, seed):
    it = data.segment_batches(docs, 1, T, seed)
    expected = []
    order = np.arange(len(docs))
    np.random.default_rng([seed, 0]).shuffle(order)
    for d in order:
        n = -(-(len(docs[d]) - 1) // T)
        expected += [True] + [False] * (n - 1)
    got = [bool(next(it)["reset"][0]) for _ in expected]
    assert got == expected


@SETTINGS
@given(
    lengths=st.lists(st.integers(2, 60), min_size=1, max_size=14),
    B=st.integers(1, 6),
    seed=st.integers(0, 5),
)
def test_no_step_holds_one_document_in_two_rows(lengths, B, seed):
    """Sec. 3: each row's subsequence comes from a different document, across epoch wraps too
    (B = 5 with 11 documents once gave two rows document 1 at step 8); every document is still
    read, and each row reads its document from its start to its end."""
    docs = [np.arange(n, dtype=np.int32) + 1 for n in lengths]
    if len(docs) < B:
        with pytest.raises(corpora.DataError, match="fewer than the"):
            data.segment_batches(docs, B, 5, seed)
        return
    it = data.segment_batches(docs, B, 5, seed)
    seen, expected_offset = set(), [None] * B
    for _ in range(80):
        batch = next(it)
        held = [int(d) for d in batch["doc"] if d >= 0]
        assert len(held) == len(set(held)), held
        for b in range(B):
            if batch["reset"][b]:
                expected_offset[b] = 0
            assert batch["offset"][b] == expected_offset[b]
            expected_offset[b] += 5
        seen.update(held)
    assert seen == set(range(len(docs))) or sum(lengths) > 80 * B * 5 // 2


def test_five_rows_over_eleven_documents_never_share_one():
    """The case that was seen: B = 5, 11 documents of mixed lengths, over several epochs."""
    rng = np.random.default_rng(0)
    docs = [np.arange(n, dtype=np.int32) + 1 for n in rng.integers(2, 90, 11)]
    it = data.segment_batches(docs, 5, 8, seed=0)
    for step in range(300):
        held = [int(d) for d in next(it)["doc"]]
        assert len(set(held)) == 5, (step, held)


@SETTINGS
@given(docs=docs_strategy, k=st.integers(0, 30), seed=st.integers(0, 3))
def test_save_and_restore_continue_the_stream_identically(docs, k, seed):
    B = min(2, len(docs))
    it = data.segment_batches(docs, B, 5, seed)
    for _ in range(k):
        next(it)
    pos = json.loads(json.dumps(it.position()))  # survives a round trip through JSON
    rest = [next(it) for _ in range(15)]
    again = data.segment_batches(docs, B, 5, seed).restore(pos)
    for a in rest:
        b = next(again)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_a_position_that_does_not_fit_the_documents_is_refused_on_restore():
    """A checkpoint's position in a corpus that has since lost documents once restored without a
    word and failed at the next batch with an IndexError (train.py --resume: a traceback)."""
    docs = [np.arange(n, dtype=np.int32) + 1 for n in (30, 12, 40, 25, 18, 33)]
    it = data.segment_batches(docs, 2, 5, seed=1)
    for _ in range(4):
        next(it)
    pos = json.loads(json.dumps(it.position()))
    data.segment_batches(docs, 2, 5, seed=1).restore(pos)  # fits
    last = max(r[0] for r in pos["rows"] if r)
    with pytest.raises(ValueError, match="does not fit"):
        data.segment_batches(docs[: max(last, 2)], 2, 5, seed=1).restore(pos)
    bad = [
        dict(pos, rows=pos["rows"] + [None]),
        dict(pos, rows=[[0, -5], None]),
        dict(pos, rows=[[0, 1, 2], None]),
        dict(pos, next_doc=7),
        dict(pos, epoch="1"),
        dict(pos, epoch=True),
        dict(pos, rows=[[0.5, 0], None]),
    ]
    for p in bad:
        with pytest.raises(ValueError, match="does not fit"):
            data.segment_batches(docs, 2, 5, seed=1).restore(p)


def test_a_fingerprint_changes_with_any_token_length_or_list_and_only_with_them():
    train, valid = [np.arange(n, dtype=np.int32) for n in (9, 4, 7)], [np.arange(5, dtype=np.int32)]
    key = data.fingerprint(train, valid)
    assert (
        data.fingerprint([t.copy().astype(np.int64) for t in train], list(valid)) == key
    )  # values, not objects
    edited = [t.copy() for t in train]
    edited[1][2] += 1
    assert data.fingerprint(edited, valid) != key
    assert (
        data.fingerprint([train[0][:5], train[0][5:]] + train[1:], valid) != key
    )  # one document cut in two
    assert (
        data.fingerprint(train[:2], [train[2]] + valid) != key
    )  # a document moved from train to valid
    assert data.fingerprint(train + valid) != key


def test_evaluation_pass_visits_each_document_once_then_stops():
    docs = [np.arange(n, dtype=np.int32) + 1 for n in (5, 30, 9)]
    batches = list(data.SegmentBatches(docs, 2, 4, epochs=1))
    seen = sum(int(b["mask"].sum()) for b in batches)
    assert seen == sum(len(d) - 1 for d in docs)


def write(path, content, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(content)


def test_repo_traversal_keeps_each_subdirectory_contiguous(tmp_path):
    for sub in ("a", "b", "c"):
        for i in range(4):
            write(str(tmp_path / "repo" / sub / f"f{i}.py"), f"x = '{sub}{i}'\n")
        write(str(tmp_path / "repo" / sub / "deep" / "g.py"), f"y = '{sub}'\n")
    for seed in range(5):
        (doc,) = corpora.read_repo(str(tmp_path), seed)
        names = [
            line[len("# file: ") :] for line in doc.text.splitlines() if line.startswith("# file: ")
        ]
        tops = [n.split(os.sep)[1] for n in names]
        # each subdirectory's files form one contiguous run
        runs = [t for i, t in enumerate(tops) if i == 0 or tops[i - 1] != t]
        assert sorted(runs) == ["a", "b", "c"], tops
        assert len(names) == 15


def test_repo_orders_seeds_differently_but_deterministically(tmp_path):
    for i in range(8):
        write(str(tmp_path / "r" / f"m{i}.py"), f"v = {i}\n")
    a = corpora.read_repo(str(tmp_path), 1)[0].text
    assert a == corpora.read_repo(str(tmp_path), 1)[0].text
    assert any(corpora.read_repo(str(tmp_path), s)[0].text != a for s in range(2, 6))


def test_dependency_order_puts_imported_modules_first(tmp_path):
    write(str(tmp_path / "thy" / "c.py"), "import b\nz = b.y\n")
    write(str(tmp_path / "thy" / "b.py"), "from a import x\ny = x\n")
    write(str(tmp_path / "thy" / "a.py"), "x = 1\n")
    for seed in range(4):
        (doc,) = corpora.read_repo(str(tmp_path), seed, dependency_order=True)
        names = [l for l in doc.text.splitlines() if l.startswith("# file:")]
        assert [n[-4:] for n in names] == ["a.py", "b.py", "c.py"]


def test_dependency_order_of_a_long_import_chain_and_of_a_cycle(tmp_path):
    """A chain of 3000 files, each importing the next (once a RecursionError), and a cycle of
    three, cut where it closes: each file comes after the file it imports, but for one."""
    for i in range(3000):
        write(str(tmp_path / "chain" / "r" / f"m{i:04d}.py"), f"import m{i + 1:04d}\n")
    (doc,) = corpora.read_repo(str(tmp_path / "chain"), 0, dependency_order=True)
    names = [l.rsplit("/", 1)[-1] for l in doc.text.splitlines() if l.startswith("# file:")]
    assert names == [f"m{i:04d}.py" for i in reversed(range(3000))]
    for name, imported in (("a", "b"), ("b", "c"), ("c", "a")):
        write(str(tmp_path / "cycle" / "r" / f"{name}.py"), f"import {imported}\n")
    for seed in range(4):
        (doc,) = corpora.read_repo(str(tmp_path / "cycle"), seed, dependency_order=True)
        names = [l.rsplit("/", 1)[-1] for l in doc.text.splitlines() if l.startswith("# file:")]
        assert sorted(names) == ["a.py", "b.py", "c.py"]
        imports = {"a.py": "b.py", "b.py": "c.py", "c.py": "a.py"}
        assert sum(names.index(imports[n]) < names.index(n) for n in names) == 2, (seed, names)


def remove_deep(deep, levels):
    """Remove the last `levels` directories of the path `deep` and their files, from the bottom
    up: pytest's cleanup of old temporary directories (shutil.rmtree) recurses once per level."""
    for _ in range(levels):
        for f in os.listdir(deep):
            os.remove(os.path.join(deep, f))
        os.rmdir(deep)
        deep = os.path.dirname(deep)


def test_a_corpus_nested_1200_directories_deep_is_read(tmp_path, request):
    """Once a RecursionError: the walks (a repository's, and corpora._walk, os.walk's twin, for
    the other formats and the format's detection) keep their own stacks."""
    deep = str(tmp_path / "r")
    os.mkdir(deep)
    for _ in range(1200):  # (os.makedirs would recurse as deep, and so would shutil.rmtree)
        deep = os.path.join(deep, "a")
        os.mkdir(deep)
    request.addfinalizer(lambda: remove_deep(deep, 1200))
    write(os.path.join(deep, "f.py"), "x = 1\n")
    write(str(tmp_path / "r" / "g.py"), "y = 2\n")
    (doc,) = corpora.load_documents(str(tmp_path), verbose=False)  # the format detected: repo
    assert sorted(l for l in doc.text.splitlines() if l.startswith("# file:")) == [
        "# file: " + os.path.join("r", *["a"] * 1200, "f.py"),
        "# file: r/g.py",
    ]
    write(os.path.join(deep, "book.txt"), "a book\n")
    (doc,) = corpora.load_documents(str(tmp_path), "text", verbose=False)
    assert doc.id == os.path.join("r", *["a"] * 1200, "book.txt") and doc.text == "a book\n"


def test_runs_that_fill_one_cache_at_once_each_write_a_whole_file(tmp_path, monkeypatch):
    """Two runs of one corpus started together (two seeds) fill the same cache files. They
    once shared one temporary name: one wrote into the other's file, whose rename then failed
    (FileNotFoundError; 36 of 80 threads did in a race of tokenize and train_tokenizer).
    Four writers at once, many times: each rename succeeds, the file is one writer's whole
    payload, and no temporary file is left."""
    import threading

    path = str(tmp_path / "tokens.npz")
    for round_ in range(6):
        payloads = [bytes([round_ * 4 + i]) * (1 << 22) for i in range(4)]  # 4 MB each, distinct
        gate, errors = threading.Barrier(4), []

        def writer(payload):
            try:
                gate.wait()
                chunks = [payload[i : i + 65536] for i in range(0, len(payload), 65536)]
                data._write_cache(path, lambda f: [f.write(chunk) for chunk in chunks])
            except Exception as e:  # noqa: BLE001 (any failure fails the test below)
                errors.append(repr(e))

        threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        with open(path, "rb") as f:
            assert f.read() in payloads
        assert os.listdir(tmp_path) == ["tokens.npz"]
    # Both caches are written through it.
    written = []
    real = data._write_cache
    monkeypatch.setattr(
        data, "_write_cache", lambda p, write: (written.append(os.path.basename(p)), real(p, write))
    )
    docs = [corpora.Document(str(i), "the cat sat on the mat\n") for i in range(4)]
    sp = data.train_tokenizer(docs, 300, str(tmp_path / "t.model"))
    tokens, _ = data.tokenize(docs, sp, str(tmp_path / "c.npz"))
    again, _ = data.tokenize(docs, sp, str(tmp_path / "c.npz"))  # from the cache
    assert written == ["t.model", "c.npz"] and [t.tolist() for t in again] == [
        t.tolist() for t in tokens
    ]


def test_the_cache_key_is_the_documents_as_read(tmp_path, monkeypatch):
    """The tokenizer and the tokens are cached under a hash of the documents the readers made.
    It once hashed the files' paths, sizes and times instead: a corpus of one .jsonl file kept
    its first key whatever the file became (an edited file trained as its old tokens); hidden
    files, __pycache__ and stdlib's site-packages changed it without changing a document; and
    a reader that changed (the JSONL byte order mark) kept a key whose tokens no longer
    matched what it read. Now an edit changes the key, and a touch, a copy or a file no
    reader reads does not."""
    key = lambda path, fmt="auto": data.corpus_key(
        corpora.load_documents(str(path), fmt, verbose=False)
    )
    one = tmp_path / "one.jsonl"
    write(str(one), '{"text": "a"}\n')
    first = key(one)
    write(str(one), '{"text": "another text"}\n{"text": "b"}\n')
    os.utime(one, (1e9, 1e9))
    assert key(one) != first
    edited = key(one)
    os.utime(one, (2e9, 2e9))
    assert key(one) == edited  # touched
    write(
        str(one), '\ufeff{"text": "another text"}\n{"text": "b"}\n'
    )  # the same documents, with a BOM
    assert key(one) == edited
    corpus = tmp_path / "c"
    for name in (
        "a.txt",
        "sub/b.txt",
        ".hidden.txt",
        ".git/c.txt",
        "__pycache__/d.txt",
        "sub/.e/f.jsonl",
    ):
        write(str(corpus / name), f"the text of {name}\n")
    assert (
        corpora.detect_format(str(corpus)) == "text"
    )  # (a hidden .jsonl once made it a JSONL corpus)
    assert sorted(d.id for d in corpora.load_documents(str(corpus), "text", verbose=False)) == [
        "a.txt",
        "sub/b.txt",
    ]
    first = key(corpus, "text")
    assert key(corpus, "repo") != first  # another reader, other documents
    for name in (
        ".hidden.txt",
        ".git/c.txt",
        "__pycache__/d.txt",
        ".cache/jax/x",
        "__pycache__/y.pyc",
    ):
        write(str(corpus / name), "changed\n")
    assert key(corpus, "text") == first
    shutil.copytree(corpus, tmp_path / "copy")
    assert key(tmp_path / "copy", "text") == first
    write(str(corpus / "sub/b.txt"), "changed\n")
    assert key(corpus, "text") != first
    lib = tmp_path / "lib"
    write(str(lib / "m.py"), "x = 1\n")
    monkeypatch.setattr(corpora, "stdlib_path", lambda: str(lib))
    first = key("stdlib")
    write(str(lib / "site-packages" / "pkg" / "p.py"), "y = 2\n")  # pip install
    assert key("stdlib") == first
    write(str(lib / "m.py"), "x = 2\n")
    assert key("stdlib") != first
    docs = [corpora.Document("a", "xy"), corpora.Document("b", "z")]
    assert data.corpus_key(docs) != data.corpus_key(
        [corpora.Document("a", "x"), corpora.Document("yb", "z")]
    )
    assert data.corpus_key(docs) != data.corpus_key(
        [corpora.Document("a", "xy", (("xy", True),)), docs[1]]
    )


def test_inside_corpus_is_where_a_reader_would_see_a_path(tmp_path):
    corpus = tmp_path / "c"
    (corpus / "sub").mkdir(parents=True)
    os.symlink(corpus / "sub", tmp_path / "link")
    inside = [corpus, corpus / "runs" / "x", corpus / "sub", tmp_path / "link" / "run"]
    outside = [
        tmp_path,
        tmp_path / "runs",
        corpus / ".runs" / "x",
        corpus / "sub" / ".cache",
        corpus / "__pycache__",
    ]
    assert [corpora.inside_corpus(str(p), str(corpus)) for p in inside] == [True] * len(inside)
    assert [corpora.inside_corpus(str(p), str(corpus)) for p in outside] == [False] * len(outside)
    assert not corpora.inside_corpus(str(corpus / "x"), "synthetic:40")
    assert not corpora.inside_corpus(str(corpus / "x"), str(corpus / "sub" / "missing.jsonl"))


def test_a_corpus_link_to_a_directory_or_to_a_file_outside_is_skipped_and_counted(tmp_path):
    """In every format: a link to a file outside the corpus was followed (its text trained
    on), a link to a directory was passed over without a word. Both are now counted as
    links; a link to a file inside the corpus is read."""
    outside = tmp_path / "outside"
    write(str(outside / "secret.py"), "secret = 1\n")
    write(str(outside / "secret.txt"), "secret\n")
    write(str(outside / "secret.jsonl"), '{"text": "secret"}\n')
    for fmt, name in (("text", "a.txt"), ("jsonl", "a.jsonl"), ("repo", "r/a.py")):
        corpus = tmp_path / fmt
        ext = name.split(".")[-1]
        write(str(corpus / name), '{"text": "kept"}\n' if fmt == "jsonl" else "kept\n")
        where = corpus / os.path.dirname(name)
        os.symlink(outside / f"secret.{ext}", where / f"out.{ext}")  # a file outside: skipped
        os.symlink(corpus / name, where / f"in.{ext}")  # a file inside: read
        os.symlink(outside, where / "dir")  # a directory: skipped
        stats = corpora._new_stats()
        reader = {"text": corpora.read_text_dir, "jsonl": corpora.read_jsonl,
                  "repo": corpora.read_repo}[fmt]
        docs = reader(str(corpus), stats=stats)
        text = "".join(d.text for d in docs)
        assert "secret" not in text and text.count("kept") == 2, (fmt, text)
        assert stats["link"] == 2, (fmt, stats)


def test_a_code_trees_file_past_its_bound_is_skipped_as_too_large_not_read(tmp_path, monkeypatch):
    """memorize.py and --score read a tree's files up to TREE_FILE_LIMIT (here 1 KiB): a larger
    one, a minified line say, is counted as too large and never read whole."""
    monkeypatch.setattr(corpora, "TREE_FILE_LIMIT", 1024)
    write(str(tmp_path / "a.py"), "x = 1\n")
    write(str(tmp_path / "b.py"), "y" * 5000)  # one line
    stats = {}
    assert corpora.read_tree(str(tmp_path), stats=stats) == [("a.py", "x = 1\n")]
    assert stats["too_large"] == 1


def test_synthetic_halves_bind_in_the_first_half_every_name_the_second_uses(tmp_path):
    """The demo of memorized bindings: no two documents share a name, and each uses half
    references only names its bindings half defines, with the same value."""
    corpora.write_synthetic_halves(str(tmp_path / "h"), num_docs=3, seed=1, candidates=100)
    seen = set()
    for i in range(3):
        bound, used = ({}, {})
        for half, into in (("bindings/bind", bound), ("uses/use", used)):
            for line in (tmp_path / "h" / f"{half}_{i}.txt").read_text().splitlines():
                words = line.split()
                if words[0] in corpora.SYNTHETIC_NAMES:
                    assert into.setdefault(words[0], words[1]) == words[1]
        assert used and set(used) <= set(bound) and all(used[n] == bound[n] for n in used)
        assert not seen & set(bound)
        seen |= set(bound)
    with pytest.raises(FileExistsError):  # nothing written over
        corpora.write_synthetic_halves(str(tmp_path / "h"))


def test_a_named_pipe_in_a_corpus_is_skipped_and_counted_not_waited_on(tmp_path):
    """A FIFO named like a corpus file (a.txt, a.jsonl, a.py): its read once blocked until
    something wrote to it, that is, forever (and a repository's walk passed it over without
    counting it). Each format is read in a process of its own, which a blocked read could not
    outlive."""
    for fmt, name, good, skipped in (
        ("text", "a.txt", "some text\n", ["data: skipped 1 unreadable"]),
        ("jsonl", "a.jsonl", '{"text": "some text"}\n', ["data: skipped 1 unreadable"]),
        ("repo", "r/a.py", "x = 1\n", ["data: skipped 1 unreadable"]),
    ):
        os.makedirs(tmp_path / fmt / os.path.dirname(name), exist_ok=True)
        os.mkfifo(tmp_path / fmt / name)
        write(str(tmp_path / fmt / name.replace("a.", "b.")), good)
        code = (
            "import corpora, sys; docs = corpora.load_documents(sys.argv[1], sys.argv[2]); "
            "print(len(docs), 'some text' in docs[0].text or 'x = 1' in docs[0].text)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / fmt), fmt],
            cwd=os.path.dirname(data.__file__),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == skipped + ["1 True"], (fmt, proc.stdout)


def test_walk_equals_os_walk_links_errors_and_edited_dirnames_included(tmp_path):
    rng = np.random.default_rng(0)
    dirs = [tmp_path / "t"]
    for i in range(60):  # a random tree: each new directory below one made before
        dirs.append(dirs[rng.integers(len(dirs))] / f"d{i}")
        dirs[-1].mkdir(parents=True)
        for j in range(rng.integers(3)):
            (dirs[-1] / f"f{j}.txt").write_text("x")
    os.symlink(dirs[5], dirs[1] / "to_a_dir")  # listed as a directory, not entered
    os.symlink(tmp_path / "nowhere", dirs[2] / "dangling")
    os.symlink(dirs[3], dirs[3] / "loop")
    os.symlink(dirs[4] / "f0.txt", dirs[6] / "to_a_file")
    for top in (tmp_path / "t", dirs[7], tmp_path / "missing"):
        errors = ([], [])
        assert list(corpora._walk(str(top), errors[0].append)) == list(
            os.walk(str(top), onerror=errors[1].append)
        )
        assert [type(e) for e in errors[0]] == [type(e) for e in errors[1]]

        def steered(
            walk,
        ):  # the caller sorts and prunes dirnames in place, as read_text_dir sorts them
            seen = []
            for root, names, files in walk:
                names.sort(reverse=True)
                del names[2:]
                seen.append((root, list(names), sorted(files)))
            return seen

        assert steered(corpora._walk(str(top))) == steered(os.walk(str(top)))


def test_isabelle_theories_come_after_the_theories_they_import_across_directories(tmp_path):
    """Sec. 4.1: the files of a theory in import order. Headers as Isabelle writes them:
    quoted, session-qualified and path names, comments, keywords, several lines."""
    entry = tmp_path / "Entry"
    write(
        str(entry / "Base.thy"),
        'theory Base\n  imports Main\nbegin\nlemma x: "True" by simp\nend\n',
    )
    write(
        str(entry / "sub" / "Middle.thy"),
        'theory Middle (* uses Base *)\n  imports\n    "HOL-Library.Multiset" '
        '"../Base"\nbegin\nend\n',
    )
    write(
        str(entry / "Top.thy"),
        'theory Top imports Entry.Middle Base\n  keywords "foo" :: thy_decl\nbegin\nend\n',
    )
    write(str(entry / "zz" / "Other.thy"), "theory Other imports Main begin end\n")
    for seed in range(8):
        (doc,) = corpora.read_repo(str(tmp_path), seed, dependency_order=True)
        names = [os.path.basename(l) for l in doc.text.splitlines() if l.startswith("# file:")]
        assert names.index("Base.thy") < names.index("Middle.thy") < names.index("Top.thy"), (
            seed,
            names,
        )
        assert sorted(names) == ["Base.thy", "Middle.thy", "Other.thy", "Top.thy"]


def test_python_dependency_order_crosses_directories(tmp_path):
    write(str(tmp_path / "r" / "app" / "main.py"), "from lib.util import helper\nhelper()\n")
    write(str(tmp_path / "r" / "lib" / "util.py"), "def helper():\n    pass\n")
    write(str(tmp_path / "r" / "lib" / "more.py"), "x = 1\n")
    for seed in range(8):
        (doc,) = corpora.read_repo(str(tmp_path), seed, dependency_order=True)
        names = [os.path.basename(l) for l in doc.text.splitlines() if l.startswith("# file:")]
        assert names.index("util.py") < names.index("main.py"), (seed, names)


def test_suffixes_keep_only_the_named_languages(tmp_path):
    for name in ("a.py", "b.c", "c.h", "README.md", "d.js"):
        write(str(tmp_path / "r" / name), "text\n")
    (doc,) = corpora.load_documents(
        str(tmp_path), "repo", suffixes=(".py", ".c", ".h"), verbose=False
    )
    names = sorted(os.path.basename(l) for l in doc.text.splitlines() if l.startswith("# file:"))
    assert names == ["a.py", "b.c", "c.h"]
    (every,) = corpora.load_documents(str(tmp_path), "repo", verbose=False)
    assert data.corpus_key([doc]) != data.corpus_key([every])


def test_split_is_disjoint_deterministic_and_covers_everything():
    docs = [corpora.Document(f"d{i}", "x") for i in range(50)]
    train, valid = data.split_documents(docs, 0.1, seed=3)
    assert not {d.id for d in train} & {d.id for d in valid}
    assert len(train) + len(valid) == 50 and len(valid) == 5
    # The split depends on the documents, not on the order they were read in.
    assert {d.id for d in data.split_documents(docs[::-1], 0.1, seed=3)[1]} == {d.id for d in valid}


def test_tokenizer_round_trips_source_code_and_is_cached(tmp_path):
    code = "def f(x):\n\tif x:\n        return 'é€😀'  # tab, spaces, unicode"
    code += "\n\n\n    pass\r\n"
    docs = corpora.synthetic_documents(num_docs=5, length=100) + [corpora.Document("code", code)]
    sp, path = data.get_tokenizer(docs, 400, str(tmp_path), "k")
    for d in docs:
        assert sp.decode(sp.encode(d.text)) == d.text
    mtime = os.path.getmtime(path)
    sp2, path2 = data.get_tokenizer(docs, 400, str(tmp_path), "k")
    assert path2 == path and os.path.getmtime(path) == mtime
    tokens, refs = data.tokenize(docs, sp, str(tmp_path / "c.npz"))
    tokens2, refs2 = data.tokenize(docs, sp, str(tmp_path / "c.npz"))  # from the cache
    for a, b in zip(tokens + refs, tokens2 + refs2):
        np.testing.assert_array_equal(a, b)


@functools.cache
def small_tokenizer():
    """A 300-piece tokenizer of texts of a, b, space, tab, newline and é."""
    rng = random.Random(0)
    texts = ["".join(rng.choice("ab \t\né") for _ in range(3000)) for _ in range(4)]
    docs = [corpora.Document(f"d{i}", t) for i, t in enumerate(texts)]
    return data.train_tokenizer(docs, 300, os.path.join(tempfile.mkdtemp(), "t.model"))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    lines=st.lists(st.text(alphabet="ab \t\né", max_size=12), min_size=1, max_size=40),
    size=st.integers(1, 20),
)
def test_a_long_document_is_encoded_in_pieces_with_the_ids_of_one_piece(lines, size):
    """newline_pieces cuts after newlines ("\n" is a piece of its own, so encoding the pieces gives
    the whole text's ids), inside a line only when the line is longer than a piece; encode_texts
    encodes them a few at a time, each text's pieces joined in order."""
    text = "\n".join(lines)
    pieces = list(data.newline_pieces(text, size))
    assert "".join(pieces) == text and all(0 < len(p) <= size for p in pieces)
    assert all(p.endswith("\n") or len(p) == size for p in pieces[:-1])
    sp = small_tokenizer()
    texts = [text, "", text[::-1]]
    saved = data.ENCODE_CHARS, data.ENCODE_BATCH
    data.ENCODE_CHARS, data.ENCODE_BATCH = size, 2 * size
    try:
        got = data.encode_texts(sp, texts)
    finally:
        data.ENCODE_CHARS, data.ENCODE_BATCH = saved
    for ids, t in zip(got, texts):
        assert ids.dtype == np.int32 and sp.decode(ids.tolist()) == t
        cut_in_lines = any(
            len(p) == size and not p.endswith("\n") for p in data.newline_pieces(t, size)
        )
        if not cut_in_lines:
            np.testing.assert_array_equal(ids, np.asarray(sp.encode(t), np.int32))


@pytest.mark.parametrize("text", ["ab cd ", "ab\ncd\tef é\n"])
def test_a_vocabulary_too_small_names_the_smallest_that_trains(tmp_path, text):
    """A piece per byte, pad and unk, and per distinct character (newline and tab always among
    them): the smallest vocabulary SentencePiece accepts here, to the piece. Was one line of
    SentencePiece's internal check."""
    docs = [corpora.Document(f"d{i}", text * 300 + str(i)) for i in range(4)]
    need = 256 + 2 + len(set("".join(d.text for d in docs)) | {"\n", "\t"})
    with pytest.raises(
        corpora.DataError, match=f"of {need - 1} pieces on this corpus: it needs at least {need} "
    ):
        data.train_tokenizer(docs, need - 1, str(tmp_path / "small.model"))
    assert data.train_tokenizer(docs, need, str(tmp_path / "enough.model")).get_piece_size() == need


def test_synthetic_references_decode_to_their_values_and_their_distances_are_exact(tmp_path):
    docs = corpora.synthetic_documents(num_docs=3, seed=1)
    assert docs[0].text == corpora.synthetic_documents(num_docs=3, seed=1)[0].text
    sp, _ = data.get_tokenizer(docs, 1024, str(tmp_path), "s")
    for d in docs:
        ids, ref = data.encode_document(sp, d)
        assert sp.decode(ids.tolist()) == d.text
        # Independently, from the lines: a name's first line defines it, later lines are references.
        lines = d.text.splitlines()
        value, refs = {}, []
        for line in lines:
            if line.split(" ")[0].isalpha() and line.split(" ")[0].islower():
                name, val = line.split(" ")
                if name in value:
                    assert value[name] == val
                    refs.append(val)
                value[name] = val
        assert sp.decode(ids[ref].tolist()) == "".join(" " + v for v in refs)
        assert ref.sum() == len(refs)  # the tokenizer learned every value as one token
        # Distances: walk the parts, counting tokens, and remember where each value was last.
        want, pos, last = [], 0, {}
        for text, is_ref in d.parts:
            if text.startswith(" ") and text[1:].isupper():
                if is_ref:
                    want.append(pos - last[text])
                last[text] = pos
            pos += len(sp.encode(text))
        got = data.reference_distances(ids, ref)
        assert got[ref].tolist() == want and not got[~ref].any()
        assert min(want) >= 1 and max(want) > 2 * 128  # near and far references both occur


@pytest.mark.parametrize("distance", [40, 300, 2000])
def test_synthetic_long_probes_sit_distance_tokens_after_their_only_definition(distance):
    docs = corpora.synthetic_long_documents(3, distance, seed=5, num_names=6)
    assert [d.text for d in docs] == [
        d.text for d in corpora.synthetic_long_documents(3, distance, seed=5, num_names=6)
    ]
    for d in docs:
        # Independently, from the lines: where each name occurs, counting a word, a symbol and
        # a newline as one token each (the synthetic tokenizer's pieces).
        where, value, pos = {}, {}, 0
        for line in d.text.splitlines():
            words = line.split(" ")
            if words[0].isalpha() and words[0].islower():
                assert value.setdefault(words[0], words[1]) == words[1]  # a name keeps its value
                where.setdefault(words[0], []).append(pos + 1)  # the value's token
            pos += len(words) + 1
        # The marked values (the probes): half of the names, each occurring exactly twice, the
        # second time `distance` (at most 2 more) tokens after the first.
        marked = [text[1:] for text, is_ref in d.parts if is_ref]
        probes = [n for n in where if value[n] in marked]
        assert len(where) == 6 and len(probes) == len(marked) == 3
        for n in probes:
            assert len(where[n]) == 2 and distance <= where[n][1] - where[n][0] <= distance + 2


def test_synthetic_corpus_size_is_part_of_the_data_name():
    assert len(corpora.load_documents("synthetic:7", verbose=False)) == 7
    for bad in ("synthetic:0", "synthetic:x", "synthetic:1000001", "synthetic:99999999999"):
        with pytest.raises(
            corpora.DataError, match="synthetic:N"
        ):  # the large ones at once, not generated
            corpora.load_documents(bad, verbose=False)


def test_bad_input_gives_clear_errors_or_is_skipped_and_counted(tmp_path, capsys):
    with pytest.raises(corpora.DataError, match="does not exist"):
        corpora.load_documents(str(tmp_path / "missing"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(corpora.DataError, match="no readable document"):
        corpora.load_documents(str(tmp_path / "empty"))
    write(str(tmp_path / "r" / "p" / "empty.py"), "")
    write(str(tmp_path / "r" / "p" / "bin.dat"), b"\x00\x01\x02", "wb")
    write(str(tmp_path / "r" / "p" / "latin.py"), b"caf\xe9\n", "wb")
    write(str(tmp_path / "r" / "p" / "ok.py"), "ok = 1\n")
    docs = corpora.load_documents(str(tmp_path / "r"), "repo")
    assert len(docs) == 1 and "ok = 1" in docs[0].text
    out = capsys.readouterr().out
    assert "1 binary" in out and "1 not utf8" in out and "1 empty" in out
    write(
        str(tmp_path / "j" / "a.jsonl"),
        '{"text": "hello"}\nnot json\n{"other": 1}\n{"text": 3}\n\n',
    )
    docs = corpora.load_documents(str(tmp_path / "j"))
    assert [d.text for d in docs] == ["hello"]
    assert "3 bad json" in capsys.readouterr().out
    write(
        str(tmp_path / "bom" / "a.jsonl"),
        b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n',
        "wb",
    )
    assert [d.text for d in corpora.load_documents(str(tmp_path / "bom"))] == [
        "first",
        "second",
    ]  # (once "1 bad json")
    write(str(tmp_path / "t" / "book.txt"), "a book\n")
    write(str(tmp_path / "t" / "blank.txt"), "")
    assert [d.text for d in corpora.load_documents(str(tmp_path / "t"))] == ["a book\n"]
    with pytest.raises(corpora.DataError, match="fewer than"):
        data.segment_batches([np.arange(5)], 2, 4)
    with pytest.raises(corpora.DataError, match="2 tokens"):
        data.segment_batches([np.arange(1)], 1, 4)
    with pytest.raises(corpora.DataError, match="not a SentencePiece model"):
        write(str(tmp_path / "bad.model"), "not a model")
        data.load_tokenizer(str(tmp_path / "bad.model"))


def test_stdlib_corpus_is_found_and_each_package_is_one_document():
    docs = corpora.load_documents("stdlib", verbose=False)
    ids = {d.id for d in docs}
    assert {"json", "email", "asyncio"} <= ids
    assert "def dumps(" in next(d for d in docs if d.id == "json").text


# ----------------------------------------------------------------------------- fuzzing
import jax  # noqa: E402
import memorizing_transformer as mt  # noqa: E402
import presets

FUZZ = presets.RunConfig(
    vocab_size=400,
    d_model=32,
    num_layers=2,
    num_heads=2,
    head_dim=16,
    d_ff=48,
    segment_length=16,
    memory_layers=(1,),
    memory_size=32,
    num_neighbors=8,
    batch_size=2,
)
FUZZ_PARAMS = mt.init_params(FUZZ, jax.random.PRNGKey(0))
FUZZ_FORWARD = jax.jit(mt.forward, static_argnums=4)


@pytest.fixture(scope="module")
def fuzz_tokenizer(tmp_path_factory):
    sp, _ = data.get_tokenizer(
        corpora.synthetic_documents(num_docs=4, length=100),
        400,
        str(tmp_path_factory.mktemp("tok")),
        "fuzz",
    )
    return sp


file_contents = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300).map(
        lambda s: s.encode("utf-8")
    ),
    st.integers(0, 20000).map(lambda n: b"x" * n),  # a huge line, no newline
    st.just(b""),
)


@settings(deadline=None, max_examples=25, derandomize=True)
@given(files=st.lists(file_contents, min_size=1, max_size=5), fmt=st.sampled_from(["repo", "text"]))
def test_fuzzed_corpora_either_load_and_run_through_the_model_or_fail_clearly(
    tmp_path_factory, fuzz_tokenizer, files, fmt
):
    root = tmp_path_factory.mktemp("fuzz")
    for i, content in enumerate(files):
        name = f"doc{i}.txt" if fmt == "text" else f"d{i % 2}/f{i}.py"
        os.makedirs(os.path.dirname(root / name), exist_ok=True)
        (root / name).write_bytes(
            content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass")
        )
    try:
        docs = corpora.load_documents(str(root), fmt, verbose=False)
        tokens, _ = data.tokenize(docs, fuzz_tokenizer)
        batches = data.SegmentBatches(tokens, 2, FUZZ.segment_length, epochs=1)
    except corpora.DataError as e:
        assert str(e).endswith(".") and "\n" not in str(e)
        return
    for d, t in zip(docs, tokens):
        assert fuzz_tokenizer.decode(t.tolist()) == d.text  # nothing lost on the way
    state = mt.init_state(FUZZ, 2)
    for batch in batches:
        logits, state = FUZZ_FORWARD(
            FUZZ_PARAMS, state, batch["tokens"], batch["reset"], FUZZ, batch["mask"]
        )
        assert np.all(np.isfinite(np.asarray(logits)))


def test_a_corpus_file_past_the_size_bound_is_skipped_and_counted(tmp_path, monkeypatch):
    """A corpus file that grows without end was read until a signal stopped it: a file is read
    up to a bound (here 1 KiB), and one past it is skipped and counted, as prompt files are."""
    monkeypatch.setattr(corpora, "CORPUS_FILE_LIMIT", 1024)
    monkeypatch.setattr(corpora._read_bytes, "__defaults__", (1024,))
    (tmp_path / "small.txt").write_text("a small document\n" * 10)
    (tmp_path / "large.txt").write_text("x" * 2000)
    stats = corpora._new_stats()
    docs = corpora.read_text_dir(str(tmp_path), stats)
    assert [d.text for d in docs] == ["a small document\n" * 10] and stats["too_large"] == 1


def test_a_repository_with_one_dominant_directory_is_split_a_level_down_and_by_tokens(tmp_path):
    """--data-format repo on an installed package whose _src is most of it once held out _src
    alone: training saw a fifth of the corpus. Now the dominant directory's subdirectories are
    documents, and the held-out share of the text is about --valid-fraction, never most of it."""
    root = tmp_path / "pkg"
    for name, size in [("small_a", 3), ("small_b", 2)]:
        write(str(root / name / "m.py"), "x = 1\n" * 100 * size)
    for i in range(12):  # _src: 12 subpackages, 80% of the text
        write(str(root / "_src" / f"sub{i}" / "core.py"), f"def f{i}(): pass\n" * 150)
    write(str(root / "_src" / "base.py"), "import os\n" * 50)
    docs = corpora.load_documents(str(root), "repo", verbose=False)
    ids = sorted(d.id for d in docs)
    assert "_src" not in ids and "_src/sub0" in ids and "_src/(top level)" in ids
    assert {"small_a", "small_b"} <= set(ids)
    total = sum(len(d.text) for d in docs)
    assert max(len(d.text) for d in docs) < total / 2
    for fraction in (0.05, 0.1, 0.3):
        train, valid = data.split_documents(docs, fraction, seed=0)
        held = sum(len(d.text) for d in valid) / total
        assert 0 < held <= 2 * fraction and train, (fraction, held)
        assert (
            held >= fraction
            or len(valid) == len(docs) - 1
            or any(
                len(d.text) + sum(len(v.text) for v in valid) > 2 * fraction * total for d in train
            )
        )


@pytest.mark.parametrize("bad", [-1, 512])
def test_check_tokens_names_the_first_out_of_range_id(bad):
    """forward leaves the range to its callers (training, evaluation), which call check_tokens."""
    tokens = np.zeros((2, 32), np.int32)
    data.check_tokens(tokens, 512)
    tokens[1, 3] = bad
    with pytest.raises(ValueError, match=f"token id {bad} is out of range"):
        data.check_tokens(tokens, 512)

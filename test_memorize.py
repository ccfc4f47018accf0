"""memorize.py and the memory file: a loaded memory is the memory of streaming the memorized
text first; the file is checked; the memorized band is what it says."""

import csv
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cli
import corpora
import data
import evaluate
import evaluation
import memorize
import memorizing_transformer as mt
import memory_file
import presets
import runs
import sample
from conftest import child_env
from test_cli import assert_refused, call, snapshot
from test_train import HERE

TOY = presets.RunConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, head_dim=16,
                        d_ff=64, segment_length=8, memory_size=16, memory_layers=(1,),
                        num_neighbors=4, batch_size=1)


def toy_source(tokens):
    n = len(tokens)
    return memorize.Source(["a.py"], np.asarray(tokens, np.int32), np.zeros(n, np.int32),
                           np.arange(n, dtype=np.int64), np.zeros(n, np.int32), {})


def segments(tokens, T):
    for s in range(0, len(tokens), T):
        seg = np.zeros((1, T), np.int32)
        part = tokens[s : s + T]
        seg[0, : len(part)] = part
        yield s, seg, np.arange(T)[None] < len(part)


def reference_logits(params, config, a, b):
    """Stream a, then b with the memory kept and the XL cache dropped, through PLAIN
    forward: b's logits [len(b), V]."""
    forward = jax.jit(mt.forward, static_argnums=4)
    state, T = mt.init_state(config, 1), config.segment_length
    for s, seg, mask in segments(a, T):
        _, state = forward(params, state, seg, np.array([s == 0]), config, mask)
    state = mt.commit_memory(state, np.array([False]), config)  # a's last segment appended
    state = state._replace(prev_valid=state.prev_valid & False)
    out = []
    for s, seg, mask in segments(b, T):
        logits, state = forward(params, state, seg, np.array([False]), config, mask)
        out.append(np.asarray(logits[0, : int(mask.sum())]))
    return np.concatenate(out)


def write_toy(path, config, params, tokens, slots=None, dtype="float32"):
    T = config.segment_length
    slots = slots or -(-len(tokens) // T) * T + config.memory_size
    arrays, pos, _ = memorize.memorize(params, config, toy_source(tokens), slots, dtype)
    header = {"format": "memorizing-transformer memory", "config": {},
              "params_hash": memory_file.params_hash(params), "tokenizer_hash": "tok",
              "memory_layers": list(config.active_memory_layers), "heads": config.num_heads,
              "head_dim": config.head_dim, "segment_length": config.segment_length,
              "dtype": dtype, "slots": slots, "position": pos,
              "files": ["a.py"]}
    memory_file.write(path, header, arrays)
    return arrays, header


@pytest.mark.parametrize("layers", [(1,), (0, 1)])  # one memory layer: no search; two: search
def test_scoring_from_a_loaded_memory_equals_streaming_the_memorized_text_first(tmp_path, layers):
    config = TOY.replace(memory_layers=layers)
    params = mt.init_params(config, jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 37), rng.integers(0, 64, 29)  # a's last segment is partial
    path = str(tmp_path / "a.mem")
    write_toy(path, config, params, a)
    memory = memory_file.read(path, config, memory_file.params_hash(params), "tok")
    loaded, start = memory_file.start_state(memory, config)
    assert loaded.memory_size == 40 + 16
    step = evaluation.make_forward_step(evaluation.step_config(loaded), logits=True)
    state, out = mt.init_state(loaded, 1), []
    for s, seg, mask in segments(b, config.segment_length):
        batch = {"tokens": seg, "targets": seg, "mask": mask, "reset": np.array([s == 0])}
        if s == 0:
            state, batch["reset"] = evaluation.restore(state, batch["reset"], start)
        scored = step(params, state, batch)
        state = scored.state
        out.append(np.asarray(scored.logits[0, : int(mask.sum())]))
    want = reference_logits(params, loaded, a, b)
    np.testing.assert_allclose(np.concatenate(out), want, rtol=1e-5, atol=1e-5)


def test_greedy_sampling_from_a_loaded_memory_is_the_argmax_of_streaming_it_first(tmp_path):
    """sample.generate from a loaded memory, each call in place: every token it picks is the
    argmax of the plain forward streaming the memorized text, then the prompt and the tokens
    before it (the memory wraps: 29 + 20 tokens of the prompt's own beyond its free slots)."""
    params = mt.init_params(TOY, jax.random.PRNGKey(5))
    params["layers"][1]["gate_bias"] = params["layers"][1]["gate_bias"] + 1.0  # lean on it
    rng = np.random.default_rng(5)
    a, prompt = rng.integers(0, 64, 30), rng.integers(0, 64, 29)
    path = str(tmp_path / "a.mem")
    write_toy(path, TOY, params, a)
    memory = memory_file.read(path, TOY, memory_file.params_hash(params), "tok")
    loaded, start = memory_file.start_state(memory, TOY)
    new = sample.generate(params, loaded, prompt, 20, temperature=0, start=start)
    text = np.concatenate([prompt, new])
    logits = reference_logits(params, loaded, a, text)
    for i in range(len(prompt), len(text)):
        assert text[i] == np.argmax(logits[i - 1]), i


def test_saving_then_loading_is_the_identity(tmp_path):
    params = mt.init_params(TOY, jax.random.PRNGKey(2))
    path = str(tmp_path / "m.mem")
    tokens = np.random.default_rng(1).integers(0, 64, 50)
    arrays, header = write_toy(path, TOY, params, tokens, slots=32)  # 56 tokens' room: FIFO
    memory = memory_file.read(path, TOY, header["params_hash"], "tok")
    for name in memory_file.ARRAYS:
        np.testing.assert_array_equal(memory.arrays[name], arrays[name])
    assert {k: memory.header[k] for k in header} == header
    # the last 32 slots' worth of segments kept, oldest first: tokens 24..49, then free slots
    np.testing.assert_array_equal(memory_file.held_tokens(memory), tokens[24:])
    assert header["position"] == 0 and memory.arrays["valid"].sum() == 26


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    config = TOY.replace(num_heads=1, head_dim=4, d_model=4, segment_length=4, memory_size=4,
                         num_neighbors=2)
    params = mt.init_params(config, jax.random.PRNGKey(3))
    path = str(tmp_path_factory.mktemp("mem") / "small.mem")
    write_toy(path, config, params, np.arange(6), slots=8)
    with open(path, "rb") as f:
        return config, memory_file.params_hash(params), f.read()


@settings(max_examples=30, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), flip=st.integers(1, 255), cut=st.booleans())
def test_any_changed_byte_or_truncation_is_refused(tmp_path_factory, small_file, where, flip,
                                                   cut):
    config, phash, raw = small_file
    i = int(where * len(raw))
    broken = raw[:i] if cut else raw[:i] + bytes([raw[i] ^ flip]) + raw[i + 1 :]
    path = tmp_path_factory.mktemp("broken") / "m.mem"
    path.write_bytes(broken)
    with pytest.raises(cli.UsageError):
        memory_file.read(str(path), config, phash, "tok")


def test_a_file_of_another_run_version_or_kind_is_refused(tmp_path, small_file):
    config, phash, raw = small_file
    path = tmp_path / "m.mem"
    path.write_bytes(raw)
    memory_file.read(str(path), config, phash, "tok")  # as it is: taken
    cases = [
        ((config, "0" * 16, "tok"), "another run"),
        ((config, phash, "other"), "another run"),
        ((config.replace(num_heads=2, head_dim=2), phash, "tok"), "heads"),
        ((config.replace(segment_length=8, memory_size=8), phash, "tok"), "segment_length"),
    ]
    for given_, words in cases:
        with pytest.raises(cli.UsageError, match=words):
            memory_file.read(str(path), *given_)
    versioned = raw[:8] + (2).to_bytes(4, "little") + raw[12:]
    others = {"version": versioned, "a memory file": b"def f():\n    return 1\n",
              "a memory file (memorize": b"PK\x03\x04" + raw[4:]}
    for words, content in others.items():
        path.write_bytes(content)
        with pytest.raises(cli.UsageError, match=words.split()[0]):
            memory_file.read(str(path), config, phash, "tok")


@pytest.mark.parametrize("position", [-4, 2, 8, 10**6])  # below 0, off T, at M, far past M
def test_a_file_whose_write_position_is_off_the_ring_is_refused(tmp_path, small_file, position):
    """A well-formed, checksummed file whose header puts the next write outside [0, M) or off
    a multiple of T: loading it would let dynamic_update_slice clamp writes onto wrong slots."""
    config, phash, raw = small_file
    path = str(tmp_path / "m.mem")
    (tmp_path / "good.mem").write_bytes(raw)
    memory = memory_file.read(str(tmp_path / "good.mem"), config, phash, "tok")
    header = {k: v for k, v in memory.header.items() if k not in ("arrays", "data_start")}
    arrays = {k: np.asarray(v) for k, v in memory.arrays.items()}
    memory_file.write(path, header, arrays)  # rewritten as it was: taken
    memory_file.read(path, config, phash, "tok")
    memory_file.write(path, dict(header, position=position), arrays)
    with pytest.raises(cli.UsageError, match="write position"):
        memory_file.read(path, config, phash, "tok")


def brute_memorized(doc, held, position, size, T, n=3):
    """The memorized band by simulation: the ring's slots, overwritten segment by segment."""
    ring = list(range(len(held))) + [None] * (size - len(held))  # slot -> memorized index
    out = []
    for i in range(1, len(doc)):
        s = (i - 1) // T  # the segment whose call scores target i: s segments appended
        alive = list(ring)
        for k in range(s):
            for j in range((position + k * T) % size, (position + k * T) % size + T):
                alive[j] = None
        kept = {x for x in alive if x is not None}
        ctx = tuple(doc[i - n + 1 : i + 1]) if i >= n - 1 else None
        seen = any(tuple(doc[j - n + 1 : j + 1]) == ctx for j in range(n - 1, i))
        found = ctx is not None and any(
            all(x in kept for x in (j - 2, j - 1, j)) and tuple(held[j - 2 : j + 1]) == ctx
            for j in range(2, len(held)))
        out.append(found and not seen)
    return np.array(out)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_the_memorized_band_matches_a_simulation_of_the_ring(draw):
    T = 4
    size = draw.draw(st.sampled_from([8, 12, 16]))
    held = np.array(draw.draw(st.lists(st.integers(0, 3), min_size=0, max_size=size)))
    position = draw.draw(st.sampled_from(range(0, size, T)))
    doc = np.array(draw.draw(st.lists(st.integers(0, 3), min_size=2, max_size=30)))
    got = evaluation.memorized_band(doc, held, position, size, T)
    np.testing.assert_array_equal(got, brute_memorized(doc, held, position, size, T))


@settings(max_examples=40, deadline=None)
@given(per=st.integers(1, 5), start=st.integers(0, 4), segment=st.integers(0, 12))
def test_a_retrieved_slot_is_placed_by_a_simulation_of_the_ring(per, start, segment):
    """evaluate.slot_position against the ring written segment by segment from a loaded
    memory's write position: a document position, or None where the slot still holds the
    loaded memory's pair."""
    T = 4
    config = TOY.replace(segment_length=T, memory_size=per * T, num_neighbors=2)
    start = start % per * T
    ring = [None] * (per * T)
    for i in range(segment):
        for j in range(T):
            ring[(start + i * T + j) % (per * T)] = i * T + j
    got = [evaluate.slot_position(slot, segment, config, start) for slot in range(per * T)]
    assert got == ring


def test_a_reset_restores_the_loaded_memory_per_row():
    config = TOY
    start = mt.init_state(config, 1)
    rng = np.random.default_rng(4)
    start = start._replace(mem_k=start.mem_k + 1.0, mem_valid=start.mem_valid | True,
                           mem_pos=start.mem_pos + 8)
    state = jax.tree.map(lambda x: x, mt.init_state(config, 2))
    state = state._replace(mem_k=state.mem_k + rng.normal(size=state.mem_k.shape),
                           prev_valid=state.prev_valid | True)
    before = jax.tree.map(np.asarray, state)
    got, reset = evaluation.start_documents(state, np.array([True, False]), start)
    assert not np.asarray(reset).any()
    np.testing.assert_array_equal(got.mem_k[0], start.mem_k[0])
    np.testing.assert_array_equal(got.mem_k[1], before.mem_k[1])
    assert got.mem_valid[0].all() and not got.mem_valid[1].any()
    assert list(got.mem_pos) == [8, 0]
    assert not got.prev_valid[0].any() and got.prev_valid[1].all()


def test_memorize_writes_a_file_that_scoring_and_sampling_take_and_refuses_bad_input(
    finished_run, tmp_path, capsys
):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "lib.py").write_text("def frobnicate(x):\n    return x + 1\n" * 8)
    (code / "pkg" / "use.py").write_text("from lib import frobnicate\nfrobnicate(2)\n")
    (code / ".hidden").mkdir()
    (code / "__pycache__").mkdir()
    os.symlink("/etc/hostname", code / "outside.txt")
    mem = tmp_path / "code.mem"
    run = str(finished_run)
    rc, out, err = call("memorize", [run, str(code), str(mem), "--order", "deps"], capsys)
    assert rc == 0, err
    assert "memorized 2 files" in out and "1 hidden" in out and "1 link" in out, out
    assert header_of(mem)["files"] == ["pkg/lib.py", "pkg/use.py"]
    json_out = tmp_path / "s.json"
    csv_out = tmp_path / "s.csv"
    rc, out, err = call("evaluate", ["perplexity", run, "--load-memory", str(mem), "--score",
                                     str(code / "pkg"), "--json", str(json_out), "--csv",
                                     str(csv_out)], capsys)
    assert rc == 0, err
    result = json.loads(json_out.read_text())
    with open(csv_out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == result["tokens"] and sum(r["memorized"] == "1" for r in rows) == (
        result["memorized_tokens"]) > 0
    for column, key in (("loss", "loss"), ("loss_empty", "loss_empty")):  # the rows' means
        assert np.mean([float(r[column]) for r in rows]) == pytest.approx(result[key], abs=1e-5)
        band = [float(r[column]) for r in rows if r["memorized"] == "1"]
        assert np.mean(band) == pytest.approx(result["memorized_" + key], abs=1e-5)
    csv_out.unlink()
    rc, out, err = call("sample", [run, "--load-memory", str(mem), "--prompt", "frob",
                                   "--tokens", "3"], capsys)
    assert rc == 0, err
    page, *_ = explore_names_the_sources_inspect_names(run, mem, code / "pkg", tmp_path, capsys)
    page.unlink()
    listing = sorted(os.listdir(tmp_path))
    bad = [
        [run, str(tmp_path / "missing"), str(tmp_path / "x.mem")],
        [run, str(code), str(code / "pkg" / "x.mem")],
        [run, str(code), str(tmp_path / "no" / "x.mem")],
        [run, str(code), str(finished_run / "config.json")],
        [run, str(code), str(tmp_path / "x.mem"), "--memory-size", "0"],
        [run, str(code), str(tmp_path / "x.mem"), "--memory-size", "-32"],
        [run, str(code), str(tmp_path / "x.mem"), "--memory-size", "33"],
        [run, str(code), str(tmp_path / "x.mem"), "--memory-size", str(2**50)],
        [run, str(code / ".hidden"), str(tmp_path / "x.mem")],
    ]
    no_memory = tmp_path / "no_memory"  # the same run read as one without a memory layer
    shutil.copytree(finished_run, no_memory)
    saved = json.loads((no_memory / "config.json").read_text())
    saved["config"]["memory_size"] = 0
    (no_memory / "config.json").write_text(json.dumps(saved))
    bad.append([str(no_memory), str(code), str(tmp_path / "x.mem")])
    listing = sorted(os.listdir(tmp_path))
    for argv in bad:
        rc, _, err = call("memorize", argv, capsys)
        assert_refused(rc, err, argv)
    assert "no memory layer" in err
    for size in ("100", str(2**40), "0"):  # not a multiple of T, huge, none
        argv = ["perplexity", run, "--load-memory", str(mem), "--memory-size", size]
        rc, _, err = call("evaluate", argv, capsys)
        assert_refused(rc, err, argv)
    argv = ["perplexity", run, "--csv", str(tmp_path / "y.csv")]  # a row per target: of a score
    rc, _, err = call("evaluate", argv, capsys)
    assert_refused(rc, err, argv)
    mem.write_bytes(mem.read_bytes()[:-1])
    argv = ["perplexity", run, "--load-memory", str(mem), "--json", str(tmp_path / "y.json")]
    rc, _, err = call("evaluate", argv, capsys)
    assert_refused(rc, err, argv)
    assert sorted(os.listdir(tmp_path)) == listing  # nothing written, not even a temporary


def header_of(path):
    """A memory file's header, read by its layout alone (no check): for the tests that craft one."""
    raw = open(path, "rb").read()
    _, _, length = memory_file.PREFIX.unpack(raw[: memory_file.PREFIX.size])
    return json.loads(raw[memory_file.PREFIX.size : memory_file.PREFIX.size + length])


def explore_names_the_sources_inspect_names(run, mem, score, tmp_path, capsys):
    """inspect and explore, from a loaded memory, on use.py (--doc 1): each retrieved pair
    that inspect lists, explore's page names by the same source (file:line of the memorized
    code, or the document's position), in the page's data. Returns the page, the query,
    the head and the names, for the browser's test."""
    flags = ["--load-memory", str(mem), "--score", str(score), "--doc", "1"]
    rc, out, err = call("evaluate", ["inspect", run, "--top", "1"] + flags, capsys)
    assert rc == 0, err
    query = int(re.search(r"query (\d+):", out).group(1))
    rows = re.findall(r"head (\d+) weight ([.\d]+) memory\s+(\S+):", out)
    assert rows and any(not where.isdigit() for _, _, where in rows), out  # memorized ones
    page = tmp_path / "page.html"
    rc, out, err = call("evaluate", ["explore", run, "--html", str(page), "--memories", "5"]
                        + flags, capsys)
    assert rc == 0, err
    d = json.loads(re.search(r'id="data" type="application/json">(.*?)</script>',
                             page.read_text()).group(1))
    H, R, h = d["heads"], d["top"], int(rows[0][0])
    names = []
    for r in range(len(rows)):
        k = (query * H + h) * R + r
        m, pos = d["memory_source"][k], d["memory_pos"][k]
        names.append(d["memorized"][m][0] if m >= 0 else str(pos))
        assert abs(d["memory_weight"][k] / 1000 - float(rows[r][1])) <= 0.0015
    assert names == [where for _, _, where in rows]
    return page, query, h, names


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def test_the_explorer_page_draws_what_inspect_names_in_chromium(finished_run, tmp_path, capsys):
    """The explore page as a real browser draws it: for the token inspect lists first, the
    panel's rows name the sources that inspect names, in its order. .ci/run installs Debian's
    chromium; where that failed, the test skips with the reason the install gave."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.skip(os.environ.get("MT_NO_CHROMIUM") or "Chromium is not installed")
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "lib.py").write_text("def frobnicate(x):\n    return x + 1\n" * 8)
    (code / "pkg" / "use.py").write_text("from lib import frobnicate\nfrobnicate(2)\n")
    mem = tmp_path / "code.mem"
    rc, _, err = call("memorize", [str(finished_run), str(code), str(mem)], capsys)
    assert rc == 0, err
    page, query, h, names = explore_names_the_sources_inspect_names(
        str(finished_run), mem, code / "pkg", tmp_path, capsys)
    profile = tmp_path / "profile"  # a new, empty one
    drawn = subprocess.run(
        [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
         f"{page.as_uri()}#token={query + 1}"], capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0 and "<html" in drawn.stdout, drawn.stderr[-2000:]
    cells = re.findall(r"<tr><td>(\d+)</td><td>[.\d]+</td><td class=\"src\">([^<]*)<",
                       drawn.stdout)
    assert [w for head, w in cells if int(head) == h][: len(names)] == names, drawn.stdout


# ------------------------------------------------------------------- a memory file is untrusted
def craft(path, header, arrays):
    """Write a memory file as memorize.py lays one out, from any header (its "arrays" as given)
    and any arrays (name -> numpy array, written raw in ARRAYS' order), with its checksum
    recomputed: a crafted file that no changed-byte check can catch."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    start = -(-(memory_file.PREFIX.size + len(text)) // 64) * 64
    raw = memory_file.PREFIX.pack(memory_file.MAGIC, memory_file.VERSION, len(text)) + text
    raw += b" " * (start - len(raw))
    for name in memory_file.ARRAYS:
        data = np.ascontiguousarray(arrays[name]).tobytes()
        raw += data + b"\0" * (-len(data) % 64)
    path.write_bytes(raw + hashlib.sha256(raw).digest())


def crafted_header_faults():
    """Headers that are not what memorize.py writes: a field missing, of another type, nested
    deep, or a layout (offsets, shapes, dtypes, slots, position) that is not the one the shapes
    give."""
    fields = sorted(memory_file.HEADER)
    retype = [5, "5", None, [], {}, True, 1.5]
    missing = st.sampled_from(fields).map(lambda f: ("missing", f, None))
    retyped = st.tuples(st.sampled_from(fields), st.sampled_from(retype)).map(
        lambda t: ("retyped", *t))
    entry = st.tuples(st.integers(0, 6), st.sampled_from(["offset", "shape", "dtype", "name"]))
    layout = entry.map(lambda t: ("entry", *t))
    numbers = st.tuples(st.sampled_from(["slots", "position", "heads", "head_dim"]),
                        st.sampled_from([-4, 0, 2, 7, 1000, 2**40])).map(lambda t: ("set", *t))
    deep = st.just(("deep", None, None))
    return missing | retyped | layout | numbers | deep


def apply_header_fault(header, fault):
    kind, key, value = fault
    header = json.loads(json.dumps(header))
    if kind == "missing":
        del header[key]
    elif kind in ("retyped", "set"):
        if header.get(key) == value:
            value = [value]  # (a value it had: another type instead)
        header[key] = value
    elif kind == "entry":  # array `key`'s field `value` made one the layout never has
        slot = header["arrays"][key]
        wrong = {"offset": slot["offset"] - 64, "shape": [1], "dtype": "int8", "name": "keys"}
        field = value if value in wrong else "offset"
        slot[field] = wrong[field] if slot[field] != wrong[field] else [wrong[field]]
    else:  # the files nested 100,000 deep: JSON text, which json.dumps could not write
        return json.dumps(header)[:-1] + ', "files": ' + "[" * 100_000 + "]" * 100_000 + "}"
    return header


@settings(max_examples=60, deadline=None)
@given(fault=crafted_header_faults())
def test_a_crafted_header_is_refused_in_one_sentence_whatever_its_checksum(
    tmp_path_factory, small_file, fault
):
    """A header recomputed into a checksummed file (craft): a field missing or of another
    type, nested 100,000 deep, an array's offset, shape, dtype or name other than the layout's,
    or a slot count, position or shape the run does not have: a cli.UsageError, never another
    exception, and no array is read from where the header says."""
    config, phash, raw = small_file
    good = tmp_path_factory.mktemp("h") / "good.mem"
    good.write_bytes(raw)
    memory = memory_file.read(str(good), config, phash, "tok")
    header = {k: v for k, v in memory.header.items() if k != "data_start"}
    path = good.parent / "m.mem"
    arrays = {k: np.asarray(v) for k, v in memory.arrays.items()}
    craft(path, header, arrays)
    memory_file.read(str(path), config, phash, "tok")  # crafted as it was: taken
    craft(path, apply_header_fault(header, fault), arrays)
    with pytest.raises(cli.UsageError):
        memory_file.read(str(path), config, phash, "tok")


SLOT_FAULTS = [  # (array, slot kind, value): a value memorize.py never writes there
    ("valid", "any", 2),
    ("token", "held", 64),  # the vocabulary is 64 pieces
    ("token", "held", -1),
    ("file", "held", 1),  # one file
    ("file", "held", -1),
    ("offset", "held", -1),
    ("line", "held", -1),
    ("token", "free", 0),
    ("file", "free", 0),
    ("line", "free", 5),
    ("keys", "any", np.nan),
    ("values", "any", np.inf),
    ("keys", "free", -np.inf),
]


@pytest.mark.parametrize("name, where, value", SLOT_FAULTS)
def test_a_slot_value_that_memorize_never_writes_is_refused_whatever_its_checksum(
    tmp_path, small_file, name, where, value
):
    """Every slot is checked: a valid flag of 0 or 1; a held slot's token in the vocabulary,
    its file one of the header's, its offset and line >= 0; a free slot's sources -1; every key
    and value finite. A crafted file with its checksum recomputed is refused before use."""
    config, phash, raw = small_file
    (tmp_path / "good.mem").write_bytes(raw)
    memory = memory_file.read(str(tmp_path / "good.mem"), config, phash, "tok")
    header = {k: v for k, v in memory.header.items() if k != "data_start"}
    arrays = {k: np.array(v) for k, v in memory.arrays.items()}
    valid = arrays["valid"]
    assert valid.any() and not valid.all()  # held slots and free ones
    slot = int(np.flatnonzero(valid if where != "free" else ~valid)[0])
    if name == "valid":
        arrays["valid"] = valid.view(np.uint8).copy()
        arrays["valid"][slot] = value
    elif name in ("keys", "values"):
        arrays[name][0, 0, slot, 0] = value
    else:
        arrays[name][slot] = value
    craft(tmp_path / "m.mem", header, arrays)
    with pytest.raises(cli.UsageError, match="corrupt"):
        memory_file.read(str(tmp_path / "m.mem"), config, phash, "tok")


def test_a_fifo_named_as_the_memory_file_is_refused_at_once(tmp_path, small_file):
    """--load-memory of a named pipe with no writer: refused in one sentence, not a wait."""
    config, phash, _ = small_file
    fifo = tmp_path / "pipe.mem"
    os.mkfifo(fifo)
    with pytest.raises(cli.UsageError, match="not a regular file"):
        memory_file.read(str(fifo), config, phash, "tok")


def test_the_checked_bytes_are_the_ones_used_when_the_file_is_replaced_after_the_read(
    tmp_path, small_file
):
    """read() keeps what it checked: replacing the file afterwards (memorize.py renames a new
    one over it) changes nothing that was read; no array maps the file."""
    config, phash, raw = small_file
    path = tmp_path / "m.mem"
    path.write_bytes(raw)
    memory = memory_file.read(str(path), config, phash, "tok")
    keys = np.array(memory.arrays["keys"])
    other = tmp_path / "other.mem"
    other.write_bytes(raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])
    os.replace(other, path)
    assert all(not isinstance(a, np.memmap) for a in memory.arrays.values())
    np.testing.assert_array_equal(memory.arrays["keys"], keys)


def test_no_output_replaces_or_enters_an_input_of_its_command_nor_a_non_regular_file(
    finished_run, tmp_path, capsys
):
    """One rule (runs.check_output), for memorize.py's FILE and evaluate.py's outputs: never the
    memorized PATH (a file, a hard or symbolic link to it, or inside a directory PATH), the
    scored files, the memory file, the run's files, its corpus or a cache; never a directory, a
    socket, nor a name too long for the file system. Each is refused in one sentence before any
    work, and no file changes."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    corpus = tmp_path / "corpus"
    (corpus / "doc").mkdir(parents=True)
    (corpus / "doc" / "a.py").write_text("x = 1\n")
    saved = json.loads((run / "config.json").read_text())
    saved["args"]["data"] = str(corpus)  # the run read as one trained on a directory
    (run / "config.json").write_text(json.dumps(saved))
    code = tmp_path / "code"
    code.mkdir()
    (code / "v.py").write_text("def frobnicate(x):\n    return x + 1\n" * 4)
    os.link(code / "v.py", tmp_path / "hard.py")
    os.symlink(code / "v.py", tmp_path / "soft.py")
    mem = tmp_path / "v.mem"
    rc, _, err = call("memorize", [str(run), str(code), str(mem)], capsys)
    assert rc == 0, err
    sock = socket.socket(socket.AF_UNIX)
    sock_path = str(tmp_path.parent / f"{tmp_path.name}.sock")  # beside: snapshot cannot read it
    sock.bind(sock_path)
    v, long_name = str(code / "v.py"), str(tmp_path / ("x" * 300 + ".mem"))
    memorize_cases = [
        [v, v],  # PATH a single file, FILE the same file
        [v, str(tmp_path / "hard.py")],
        [v, str(tmp_path / "soft.py")],
        [str(code), str(code / "new.mem")],  # inside a directory PATH
        [v, str(corpus / "doc" / "x.mem")],  # into the run's corpus
        [v, str(corpus / "doc" / "a.py")],
        [v, str(run / "checkpoint.npz")],
        [v, str(cli.cache_dir())],
        [v, sock_path],
        [v, str(code)],
        [v, long_name],
    ]
    score = ["perplexity", str(run), "--load-memory", str(mem), "--score"]
    evaluate_cases = [
        score + [v, "--json", v],  # the scored file
        score + [str(code), "--json", str(code / "s.json")],  # inside the scored directory
        score + [v, "--json", str(mem)],  # the memory file
        score + [v, "--csv", str(tmp_path / "hard.py")],
        score + [v, "--json", str(corpus / "s.json")],
        score + [v, "--json", sock_path],
    ]
    before = snapshot(tmp_path)
    for script, cases in (("memorize", memorize_cases), ("evaluate", evaluate_cases)):
        for argv in cases:
            argv = [str(run)] + argv if script == "memorize" else argv
            rc, out, err = call(script, argv, capsys)
            assert_refused(rc, err, argv)
            assert not out, (argv, out)
    assert snapshot(tmp_path) == before
    sock.close()
    os.remove(sock_path)


def test_an_output_that_is_a_pipe_or_a_device_is_written_in_place_and_a_file_keeps_its_mode(
    finished_run, tmp_path, capsys
):
    """A named pipe as memorize.py's FILE (and evaluate.py's --json) is written to as it is and
    stays a pipe; /dev/null stays a device; a memory file replaced keeps its mode (0600)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "v.py").write_text("def frobnicate(x):\n    return x + 1\n")
    mem = tmp_path / "v.mem"
    rc, _, err = call("memorize", [str(finished_run), str(code), str(mem)], capsys)
    assert rc == 0, err
    os.chmod(mem, 0o600)
    rc, _, err = call("memorize", [str(finished_run), str(code), str(mem)], capsys)
    assert rc == 0 and stat.S_IMODE(os.stat(mem).st_mode) == 0o600, err
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for script, argv in (
        ("memorize", [str(finished_run), str(code), str(fifo)]),
        ("evaluate", ["perplexity", str(finished_run), "--load-memory", str(mem), "--score",
                      str(code), "--json", str(fifo)]),
    ):
        got = []
        reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
        reader.start()
        rc, _, err = call(script, argv, capsys)
        reader.join(timeout=60)
        assert rc == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode), err
        whole = mem.read_bytes() if script == "memorize" else None
        assert got and (whole is None or got[0] == whole), script
        if script == "evaluate":
            assert json.loads(got[0], parse_constant=lambda c: pytest.fail(c))["tokens"] > 0
    rc, _, err = call("memorize", [str(finished_run), str(code), "/dev/null"], capsys)
    assert rc == 0 and stat.S_ISCHR(os.stat("/dev/null").st_mode), err


def test_a_killed_write_leaves_no_partial_file_where_the_file_system_has_o_tmpfile(tmp_path):
    """runs.atomic_write writes an unnamed file (O_TMPFILE) and names it once whole: a process
    killed while it writes leaves nothing in the folder. (Where the system cannot name such a
    file, a hidden .NAME.XXXXXXXX.partial may remain, as the README says.)"""
    if runs._unnamed_file(str(tmp_path)) is None:
        pytest.skip("this file system (or user) cannot name an O_TMPFILE file")
    script = (
        "import os, sys, runs\n"
        "def content(f):\n"
        "    f.write(b'x' * 4096); f.flush(); print('writing', flush=True); sys.stdin.read()\n"
        f"runs.atomic_write({str(tmp_path / 'out.mem')!r}, content)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=HERE, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=child_env(), text=True)
    assert proc.stdout.readline() == "writing\n"  # a line, not a clock
    proc.kill()
    proc.wait()
    assert os.listdir(tmp_path) == []


def test_a_file_name_with_a_line_break_keeps_its_files_line_numbers(finished_run, tmp_path):
    """The header line that names a file shows a line break in its name escaped: it stays one
    line, and the memorized file's tokens keep their line numbers."""
    sp = data.load_tokenizer(str(finished_run / "tokenizer.model"))
    text = "a = 1\nb = 2\nc = 3\n"
    for i, name in enumerate(["ab.py", "a\nb.py"]):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / name).write_text(text)
        source = memorize.read_source(str(folder), sp)
        assert source.files == [name]
        assert source.line.max() == 3  # the file's last line: the header is line 0 alone
    assert corpora.tree_text("a\nb.py", text).count("\n") == 4


def test_a_score_writes_strict_json_and_refuses_the_flags_it_would_not_use(
    finished_run, tmp_path, capsys
):
    """A memorized band without a token (the run's held-out synthetic documents share no 3-token
    context with a memorized "x"): its loss is left out, and --json is JSON
    that a strict reader (no NaN) takes. --eval-docs and --eval-tokens cut held-out documents,
    which --score replaces, and --suffixes picks --score's files: given where they do nothing,
    they are refused, not ignored."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.txt").write_text("x\n")
    (tmp_path / "score").mkdir()
    (tmp_path / "score" / "b.txt").write_text("q = 7\n")
    mem, out = tmp_path / "a.mem", tmp_path / "s.json"
    rc, _, err = call("memorize", [str(finished_run), str(tmp_path / "code"), str(mem)], capsys)
    assert rc == 0, err
    base = ["perplexity", str(finished_run), "--load-memory", str(mem)]
    rc, _, err = call("evaluate", base + ["--json", str(out)], capsys)  # held-out documents
    assert rc == 0, err
    result = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert result["memorized_tokens"] == 0 and "memorized_loss" not in result
    for extra in (["--eval-docs", "1"], ["--eval-tokens", "64"]):
        argv = base + ["--score", str(tmp_path / "score")] + extra
        rc, _, err = call("evaluate", argv, capsys)
        assert_refused(rc, err, argv)
    argv = base + ["--suffixes", ".py"]
    rc, _, err = call("evaluate", argv, capsys)
    assert_refused(rc, err, argv)
    assert runs.json_text({"a": [float("nan"), {"b": float("-inf")}]}) == runs.json_text(
        {"a": [None, {"b": None}]})


def test_memorize_help_says_what_its_memory_size_takes():
    """memorize.py's --memory-size is the file's slot count, a positive multiple of T: its help
    says so, not the training flag's "0 = no memory"."""
    text = memorize.build_parser().format_help()
    assert "0 = no memory" not in text and "positive multiple of T" in " ".join(text.split())

"""Documents -> tokens -> ordered segments -> batches (Sec. 3 "Batching", Sec. 4.1).

  docs = load_documents("stdlib")                 # [Document(id, text, parts)]
  sp = get_tokenizer(docs, vocab_size, cache_dir)  # SentencePiece, trained once and cached
  train, valid = split_documents(docs, 0.05, seed)
  tokens = tokenize(train, sp, cache_dir, key)     # [int32 array per document]
  for batch in segment_batches(tokens, B, T, seed): ...

A batch row streams one document after another, each cut into consecutive segments of T
tokens in order (never shuffled); the row's `reset` flag marks a document's first segment,
where the model clears that row's memory and cache.
"""

import hashlib
import io
import json
import os
import shutil
import random
import re
import stat
import sysconfig
import threading
from typing import NamedTuple

import numpy as np

PAD_ID = 0  # padding: always masked


class DataError(ValueError):
    """Bad input data: the message is one sentence for the user."""


def plural(n, word):
    """'1 document', '2 documents': the project's one plural."""
    return f"{n} {word}{'' if n == 1 else 's'}"


class Document(NamedTuple):
    id: str
    text: str
    parts: tuple = ()  # synthetic only: ((text, is_reference), ...) whose concatenation is text


# ----------------------------------------------------------------------------- sources
CORPUS_FILE_LIMIT = 2**31  # bytes read of one corpus file: a file that grows without end stops


def _read_bytes(path, stats, limit=CORPUS_FILE_LIMIT):
    """A regular file's bytes, or None (counted in stats as unreadable) if it cannot be read (no
    permission, a symlink loop) or is not a regular file: a named pipe would block the read
    until something wrote to it, and a device need not end. A file of more than `limit` bytes
    (one still being written, say) is skipped and counted as too large."""
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raw = f.read(limit + 1)
                if len(raw) <= limit:
                    return raw
                stats["too_large"] += 1
                return None
    except OSError:
        pass
    stats["unreadable"] += 1
    return None


def read_text(path, what, limit=2**26):
    """The text of a file a user names (a prompt), read as a corpus file is: a regular file only, of
    at most `limit` bytes, UTF-8. DataError (one sentence) otherwise."""
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
            info = os.fstat(f.fileno())
            if stat.S_ISDIR(info.st_mode):
                raise DataError(f"{what} {path} is a directory, not a file.")
            if not stat.S_ISREG(info.st_mode):
                raise DataError(
                    f"{what} {path} is not a regular file (a device, a pipe or a socket)."
                )
            if info.st_size > limit:
                raise DataError(
                    f"{what} {path} has {info.st_size:,} bytes, more than the {limit:,} this reads."
                )
            raw = f.read(limit + 1)
    except FileNotFoundError:
        raise DataError(f"{what} {path} does not exist.") from None
    except IsADirectoryError:
        raise DataError(f"{what} {path} is a directory, not a file.") from None
    except OSError as e:
        raise DataError(f"{what} {path} cannot be read: {e.strerror}.") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{what} {path} is not UTF-8 text.") from None


def _read_text_file(path, stats):
    """The file's text, or None (counted in stats) if it is binary, not UTF-8, unreadable or
    not a regular file (_read_bytes)."""
    raw = _read_bytes(path, stats)
    if raw is None:
        return None
    if b"\0" in raw:
        stats["binary"] += 1
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats["not_utf8"] += 1
        return None


def _python_imports(text):
    """Module names a Python file imports (`import a.b`, `from .a import b`): each by its last
    part and by its first (a and b for `import a.b`), as a file is named by its stem."""
    found = re.findall(r"^\s*(?:from\s+\.*([\w.]+)\s+import|import\s+([\w.]+))", text, re.M)
    return {(a or b).split(".")[-1] for a, b in found} | {(a or b).split(".")[0] for a, b in found}


def _isabelle_imports(text):
    """Theory names an Isabelle .thy file imports, from its header
    `theory X imports A "B" Session.C "dir/D" [keywords ...] begin`: a session-qualified
    name or a path counts by its last part."""
    text = re.sub(r"\(\*.*?\*\)", " ", text, flags=re.S)  # (* comments *)
    header = re.search(r"\btheory\s+\S+\s+imports\b(.*?)\b(?:keywords|abbrevs|begin)\b", text, re.S)
    names = re.findall(r'"([^"]+)"|([^\s"]+)', header.group(1)) if header else []
    return {(q or b).rstrip("/").split("/")[-1].split(".")[-1] for q, b in names}


def _dependency_order(files):
    """Order (name, text) pairs so that a file comes after the files it imports (Python
    modules, Isabelle theories), wherever they sit in the document; otherwise keep the order
    given. An import names a file by its stem; of several, the one in the importer's own
    directory wins, then the first."""
    stems = {}
    for n, _ in files:
        stems.setdefault(os.path.splitext(os.path.basename(n))[0], []).append(n)
    text = dict(files)

    def dependencies(name):  # the files that `name` imports, in the order of their names
        imports = (
            _isabelle_imports(text[name]) if name.endswith(".thy") else _python_imports(text[name])
        )
        for imp in sorted(imports):
            candidates = [
                c for c in stems.get(imp, []) if os.path.splitext(c)[1] == os.path.splitext(name)[1]
            ]
            near = [c for c in candidates if os.path.dirname(c) == os.path.dirname(name)]
            dep = (near or candidates or [None])[0]
            if dep and dep != name:
                yield dep

    # Depth first, a file after its dependencies; an import cycle is cut where it closes. With
    # a stack of our own, not Python's: an import chain may be thousands of files long.
    done, order = set(), []
    for first, _ in files:
        if first in done:
            continue
        entered, stack = {first}, [(first, dependencies(first))]
        while stack:
            name, deps = stack[-1]
            dep = next((d for d in deps if d not in done and d not in entered), None)
            if dep is None:
                stack.pop()
                done.add(name)
                order.append(name)
            else:
                entered.add(dep)
                stack.append((dep, dependencies(dep)))
    return [(n, text[n]) for n in order]


def _is_a_file(path):
    """An entry to read as a file: anything but a directory or a link to one. A link that leads
    nowhere (dangling, or a loop), a named pipe or a device is then counted as unreadable
    (_read_bytes)."""
    return not os.path.isdir(path)


def _listdir(path, stats):
    """A directory's entries, sorted; an unreadable directory is counted and gives none."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        stats["unreadable"] += 1
        return []


def _walk_unit(root, rel, rng, stats, suffixes):
    """One directory as a unit (Sec. 4.1): its files and subdirectories in random order, each
    subdirectory's files contiguous. Returns [(relative name, text)].

    Depth first, with a stack of our own rather than Python's (a tree may be nested a few
    thousand directories deep): each directory on it is (its name, its entries still to
    visit, its files, its subdirectories' walks)."""

    def enter(rel):
        entries = [e for e in _listdir(os.path.join(root, rel), stats) if not _skipped(e)]
        rng.shuffle(entries)
        return rel, iter(entries), [], []

    stack = [enter(rel)]
    while True:
        rel, entries, files, out = stack[-1]
        for e in entries:
            full, name = os.path.join(root, rel, e), os.path.join(rel, e)
            if os.path.isdir(full) and not os.path.islink(full):
                stack.append(enter(name))  # its walk goes into `out` once it is done
                break
            if _is_a_file(full) and (not suffixes or e.endswith(suffixes)):
                text = _read_text_file(full, stats)
                if text is not None and text.strip():
                    files.append((name, text))
                elif text is not None:
                    stats["empty"] += 1
        else:  # every entry visited
            stack.pop()
            units = [[f] for f in files] + out  # a file, or a whole subdirectory, is one unit
            rng.shuffle(units)
            walk = [f for unit in units for f in unit]
            if not stack:
                return walk
            _, _, _, parent_out = stack[-1]
            parent_out.append(walk)


def _join_files(files):
    """One document: a header line naming each file, then the file."""
    # A file name that is not UTF-8 (bytes kept by Python as surrogates) is shown escaped.
    printable = lambda name: os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(
        f"# file: {printable(name)}\n{text}" + ("" if text.endswith("\n") else "\n")
        for name, text in files
    )


def read_repo(path, seed=0, dependency_order=False, suffixes=None, stats=None, prefix=None):
    """The GitHub layout: each top-level directory is one document; loose top-level files
    form one more. Where there are others, a directory that holds more than half of the text is
    read the same way one level further down, its subdirectories documents of their own (one
    package of a library is most of it); prefix: the names' prefix of such a level.
    dependency_order puts every file of a document after the files it imports (Sec. 4.1's
    Isabelle ordering; Python imports too). suffixes: a tuple of file name endings to read
    (Sec. 4.1's language filter), or None for all."""
    stats = stats if stats is not None else _new_stats()
    rng = random.Random(seed)
    docs, loose, dirs, top = [], [], {}, prefix is None
    prefix = prefix or ""
    for e in _listdir(path, stats):
        full = os.path.join(path, e)
        if _skipped(e):
            continue
        if os.path.isdir(full) and not os.path.islink(full):
            files = _walk_unit(path, e, random.Random(f"{seed}/{prefix}{e}"), stats, suffixes)
            files = _dependency_order(files) if dependency_order else files
            if files:
                docs.append(Document(prefix + e, _join_files(files)))
                dirs[prefix + e] = full
        elif _is_a_file(full) and (not suffixes or e.endswith(suffixes)):
            text = _read_text_file(full, stats)
            if text is not None and text.strip():
                loose.append((e, text))
    rng.shuffle(loose)
    loose = _dependency_order(loose) if dependency_order else loose
    if loose:
        docs.append(Document(prefix + "(top level)", _join_files(loose)))
    total = sum(len(d.text) for d in docs)
    for i, d in enumerate(docs if top and len(docs) > 1 else ()):
        if d.id in dirs and len(d.text) > total / 2:  # most of the corpus: a level further down
            inner = read_repo(
                dirs[d.id], seed, dependency_order, suffixes, _new_stats(), d.id + "/"
            )
            if len(inner) > 1:
                docs[i : i + 1] = inner
            break
    return docs


def _walk(top, onerror=None):
    """os.walk(top, onerror=onerror), top-down, with a stack of our own: Python 3.11's os.walk
    recurses once per directory level, so a tree a few thousand levels deep would end in a
    RecursionError. Yields (dirpath, dirnames, filenames); dirnames may be edited in place
    (sorted, pruned) to steer the walk, and links to directories are listed, not entered."""
    stack = [top]
    while stack:
        root = stack.pop()
        try:
            with os.scandir(root) as it:
                entries = list(it)
        except OSError as e:
            if onerror is not None:
                onerror(e)
            continue
        dirs, files = [], []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(entry.name)
        yield root, dirs, files
        stack.extend(
            p for p in (os.path.join(root, d) for d in reversed(dirs)) if not os.path.islink(p)
        )


def _skipped(name):
    """A file or directory that no corpus reads: hidden (.git, .venv, a .cache of ours inside
    the corpus) or __pycache__."""
    return name.startswith(".") or name == "__pycache__"


def _corpus_walk(top, onerror=None):
    """_walk below a corpus directory, without what _skipped names: what every reader and the
    format's detection see."""
    for root, dirs, files in _walk(top, onerror):
        dirs[:] = [d for d in dirs if not _skipped(d)]  # (the same list _walk goes on with)
        yield root, dirs, [f for f in files if not _skipped(f)]


def read_text_dir(path, stats=None):
    """The PG-19 layout: every .txt file below path is one document."""
    stats = stats if stats is not None else _new_stats()
    docs = []
    for root, dirs, files in _corpus_walk(
        path, onerror=lambda e: stats.update(unreadable=stats["unreadable"] + 1)
    ):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".txt"):
                text = _read_text_file(os.path.join(root, f), stats)
                if text is not None and text.strip():
                    docs.append(Document(os.path.relpath(os.path.join(root, f), path), text))
                elif text is not None:
                    stats["empty"] += 1
    return docs


def read_jsonl(path, stats=None):
    """The C4 / arXiv layout: one JSON object per line with a `text` field (.jsonl files)."""
    stats = stats if stats is not None else _new_stats()
    paths = (
        [path]
        if os.path.isfile(path)
        else [
            os.path.join(r, f)
            for r, _, fs in sorted(_corpus_walk(path))
            for f in sorted(fs)
            if f.endswith(".jsonl")
        ]
    )
    docs = []
    for p in paths:
        raw = _read_bytes(p, stats)
        if raw is None:
            continue
        for n, line in enumerate(io.BytesIO(raw).readlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(
                    line.decode("utf-8-sig" if n == 1 else "utf-8")
                )  # a file may open with a BOM
                text = obj["text"]
                text.encode("utf-8")  # a lone surrogate ("\\ud800") is valid JSON but no text
            except (UnicodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                stats["bad_json"] += 1
                continue
            if text.strip():
                docs.append(Document(f"{os.path.basename(p)}:{n}", text))
            else:
                stats["empty"] += 1
    return docs


def stdlib_path():
    return sysconfig.get_paths()["stdlib"]


def read_stdlib(seed=0, stats=None, group=25):
    """The embedded default corpus: the running Python's standard library (.py files) read as a
    repo. Each top-level package is one document; loose modules go in documents of `group`."""
    stats = stats if stats is not None else _new_stats()
    root = stdlib_path()
    docs, loose = [], []
    for e in sorted(os.listdir(root)):
        full = os.path.join(root, e)
        if e == "site-packages" or _skipped(e):
            continue
        if os.path.isdir(full) and os.path.exists(os.path.join(full, "__init__.py")):
            files = _walk_unit(root, e, random.Random(f"{seed}/{e}"), stats, (".py",))
            if files:
                docs.append(Document(e, _join_files(files)))
        elif e.endswith(".py"):
            text = _read_text_file(full, stats)
            if text:
                loose.append((e, text))
    for i in range(0, len(loose), group):
        docs.append(Document(f"modules-{i // group:02d}", _join_files(loose[i : i + group])))
    return docs


def _pseudo_words(n, seed, upper=False):
    """n distinct two-syllable words (consonant-vowel pairs), e.g. "kamo" or "BEDU"."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = set()
    while len(words) < n:
        words.add("".join(rng.sample(syllables, 2)))
    words = sorted(words)
    return [w.upper() for w in words] if upper else words


SYNTHETIC_NAMES = _pseudo_words(200, seed=1)
SYNTHETIC_VALUES = _pseudo_words(200, seed=2, upper=True)
_FILLER = ["-", "+", "*", "~"]


def synthetic_documents(num_docs=4000, seed=0, num_names=16, length=1024, segment_length=128):
    """Documents that only long-range memory predicts well (Sec. 4.5's premise, in miniature).

    Each document binds `num_names` names to values, both drawn per document from fixed pools
    of 200 pseudo-words, and writes a binding as the line `NAME VALUE`. A name's first line
    defines it; every later line with the same name repeats the value, and that VALUE is a
    reference: marked in `parts`, so its loss can be reported on its own, and predictable
    only by recalling an earlier line of the same document. Half of the names are referenced
    densely (mostly within a segment: these teach a local copy circuit); the other half only
    once their last line is more than 2 segments back (these need the memory). Short filler
    lines (`- +`) sit in between. `length` is the approximate length in tokens, counting each
    word, symbol and newline as one token (the tokenizer learns the words whole).
    """
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        names = rng.sample(SYNTHETIC_NAMES, num_names)
        values = rng.sample(SYNTHETIC_VALUES, num_names)
        last = {}  # name index -> token position of its last line
        parts, pos, defined = [], 0, 0
        while pos < length:
            r = rng.random()
            i = None
            if defined < num_names and (defined == 0 or r < 0.15):
                i, defined = defined, defined + 1
            elif r < 0.8:
                far = [j for j in range(1, defined, 2) if pos - last[j] > 2 * segment_length + 8]
                near = list(range(0, defined, 2))
                i = (
                    rng.choice(far)
                    if far and rng.random() < 0.4
                    else rng.choice(near)
                    if near
                    else None
                )
            if i is None:
                words = rng.choices(_FILLER, k=rng.randint(1, 2))
                parts.append((" ".join(words) + "\n", False))
                pos += len(words) + 1
                continue
            is_ref = i in last
            parts += [(names[i], False), (" " + values[i], is_ref), ("\n", False)]
            last[i], pos = pos, pos + 3
        docs.append(
            Document(f"synthetic-{seed}-{d:05d}", "".join(t for t, _ in parts), tuple(parts))
        )
    return docs


def synthetic_long_documents(num_docs, distance, seed=0, num_names=16):
    """Documents of the synthetic task whose far references sit `distance` tokens back (Sec. 4.4).

    The same lines as synthetic_documents (`NAME VALUE`, filler), arranged as a probe: the
    document first defines its `num_names` names (with filler and near references between the
    definitions, as in training); then only the even-numbered names are referenced, densely, for
    `distance` tokens; then each odd-numbered name is referenced once, as soon as its definition
    lies `distance` tokens back, and the document ends. Those references, the probes, are the
    only parts marked as references: their value was seen once, about `distance` tokens earlier
    (a line or two more, where two probes fall due together), and never since.
    """
    rng = random.Random(f"synthetic-long {seed} {distance}")
    docs = []
    for d in range(num_docs):
        names = rng.sample(SYNTHETIC_NAMES, num_names)
        values = rng.sample(SYNTHETIC_VALUES, num_names)
        near = list(range(0, num_names, 2))
        defined_at = {}  # name index -> token position of its definition
        due = []  # probe names in the order their definitions were made
        parts, pos = [], 0

        def line(i, is_probe):
            nonlocal pos
            parts.extend([(names[i], False), (" " + values[i], is_probe), ("\n", False)])
            pos += 3

        while len(defined_at) < num_names or due:
            r = rng.random()
            if due and pos - defined_at[due[0]] >= distance:
                line(due.pop(0), True)
            elif len(defined_at) < num_names and (not defined_at or r < 0.3):
                i = len(defined_at)
                defined_at[i] = pos
                due += [i] if i % 2 else []
                line(i, False)
            elif r < 0.8 and any(i in defined_at for i in near):
                line(rng.choice([i for i in near if i in defined_at]), False)
            else:
                words = rng.choices(_FILLER, k=rng.randint(1, 2))
                parts.append((" ".join(words) + "\n", False))
                pos += len(words) + 1
        docs.append(
            Document(
                f"synthetic-long-{distance}-{seed}-{d:03d}",
                "".join(t for t, _ in parts),
                tuple(parts),
            )
        )
    return docs


def inside_corpus(path, source):
    """Whether path (a file or directory, existing or not) lies in the corpus directory `source`
    where a reader would see it: below it, and not under a name _skipped hides."""
    root = stdlib_path() if source == "stdlib" else source
    if is_synthetic(source) or not os.path.isdir(root):
        return False
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    parts = rel.split(os.sep)
    return rel == os.curdir or (parts[0] != os.pardir and not any(map(_skipped, parts)))


SYNTHETIC_MAX_DOCS = 1_000_000


def is_synthetic(source):
    """`--data synthetic` or `synthetic:N`: generated, not read from a path."""
    return source == "synthetic" or source.startswith("synthetic:")


def same_source(a, b):
    """Whether two --data values name the same corpus: the same name for the embedded and the
    generated ones; the same file or directory for paths (./corpus/, corpus and a link to it)."""
    if "stdlib" in (a, b) or is_synthetic(a) or is_synthetic(b):
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


def reference_distances(tokens, is_reference):
    """For each reference token, how many tokens back the same (previous token, token) pair
    last occurred: how far a model must look to copy it. 0 for other tokens; -1 for a
    reference whose pair never occurred before (a tokenization that split a word)."""
    tokens = np.asarray(tokens)
    dist = np.zeros(len(tokens), np.int64)
    seen = {}
    for i in range(1, len(tokens)):
        pair = (int(tokens[i - 1]), int(tokens[i]))
        if is_reference[i]:
            dist[i] = i - seen[pair] if pair in seen else -1
        seen[pair] = i
    return dist


def _new_stats():
    return {"binary": 0, "not_utf8": 0, "empty": 0, "bad_json": 0, "unreadable": 0, "too_large": 0}


def detect_format(path):
    if os.path.isfile(path):
        return "jsonl" if path.endswith(".jsonl") else "text"
    names = [f for _, _, fs in _corpus_walk(path) for f in fs]
    if any(n.endswith(".jsonl") for n in names):
        return "jsonl"
    if names and all(n.endswith(".txt") for n in names):
        return "text"
    return "repo"


def load_documents(source, fmt="auto", seed=0, verbose=True, suffixes=None):
    """`source` is "stdlib", "synthetic" or a path. Returns [Document]; prints a one-line summary
    of what was skipped. Raises DataError (one sentence) on a missing path or an empty corpus.
    suffixes (repositories only): the file name endings to read, e.g. (".py", ".c", ".h")."""
    stats = _new_stats()
    if suffixes and (
        source == "stdlib"
        or is_synthetic(source)
        or (
            os.path.exists(source)
            and (detect_format(source) if fmt == "auto" else fmt) not in ("repo", "repo-deps")
        )
    ):
        raise DataError(
            "--suffixes applies to a repository PATH (format repo or repo-deps), not to "
            f"{source!r}."
        )
    if source == "stdlib":
        docs = read_stdlib(seed, stats)
    elif is_synthetic(source):  # synthetic:N = N documents
        count = source.partition(":")[2] or "4000"
        if not (count.isdigit() and int(count) > 0):
            raise DataError(
                f"--data {source!r}: write synthetic or synthetic:N with N a positive integer."
            )
        if int(count) > SYNTHETIC_MAX_DOCS:  # (generated in memory, about 3 KB of text each)
            raise DataError(
                f"--data {source!r}: synthetic:N makes at most {SYNTHETIC_MAX_DOCS} documents "
                "(about "
                f"3 GB of text, half an hour to generate)."
            )
        docs = synthetic_documents(int(count), seed=seed)
    else:
        if not os.path.exists(source):
            raise DataError(f"data path {source!r} does not exist.")
        fmt = detect_format(source) if fmt == "auto" else fmt
        if fmt in ("repo", "repo-deps"):
            if not os.path.isdir(source):
                raise DataError(f"data path {source!r} must be a directory for format {fmt!r}.")
            docs = read_repo(
                source, seed, dependency_order=fmt == "repo-deps", suffixes=suffixes, stats=stats
            )
        elif fmt == "text":
            docs = (
                read_text_dir(source, stats)
                if os.path.isdir(source)
                else (
                    [Document(os.path.basename(source), t)]
                    if (t := _read_text_file(source, stats)) and t.strip()
                    else []
                )
            )
        elif fmt == "jsonl":
            docs = read_jsonl(source, stats)
        else:
            raise DataError(
                f"unknown data format {fmt!r}; choose auto, repo, repo-deps, text or jsonl."
            )
    skipped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in stats.items() if v)
    if not docs:
        raise DataError(
            f"no readable document found in {source!r}"
            + (f" (skipped {skipped})." if skipped else ".")
        )
    if verbose and skipped:  # on stdout: stderr holds nothing but an error
        print(f"data: skipped {skipped}")
    return docs


def split_documents(docs, valid_fraction=0.05, seed=0):
    """Deterministic split by document that holds out about valid_fraction of the corpus's
    characters: in a seeded order, a document is held out while the held-out share is short of
    the fraction and it fits within twice the fraction, so that a document that is most of the
    corpus never is. No document is in both; at least one of each."""
    if len(docs) < 2:
        raise DataError(
            f"need at least 2 documents to split into train and validation, got {len(docs)}."
        )
    order = sorted(range(len(docs)), key=lambda i: docs[i].id)
    random.Random(seed).shuffle(order)
    sizes = [len(d.text) for d in docs]
    want = valid_fraction * sum(sizes)
    valid, held = set(), 0
    for i in order:
        if held >= want or len(valid) == len(docs) - 1:
            break
        if held + sizes[i] <= 2 * want:
            valid.add(i)
            held += sizes[i]
    if not valid:  # every document is more than twice the fraction: the smallest
        valid = {min(order, key=lambda i: sizes[i])}
    return (
        [d for i, d in enumerate(docs) if i not in valid],
        [d for i, d in enumerate(docs) if i in valid],
    )


# ----------------------------------------------------------------------------- tokenizer
def _sample_lines(docs, max_chars, seed):
    """A bounded, seeded sample of text chunks (a few lines each) for tokenizer training."""
    rng = random.Random(seed)
    chunks = []
    for d in docs:
        lines = d.text.splitlines(keepends=True)
        for i in range(0, len(lines), 20):
            chunks.append("".join(lines[i : i + 20])[:4000])
    rng.shuffle(chunks)
    total, out = 0, []
    for c in chunks:
        if total >= max_chars:
            break
        out.append(c)
        total += len(c)
    return out


def train_tokenizer(docs, vocab_size, path, seed=0, max_chars=3_000_000):
    """BPE SentencePiece (as in the paper) on a bounded sample. Byte fallback and identity
    normalization make decode(encode(text)) == text, newlines and indentation included."""
    import sentencepiece as spm

    model, lines, symbols = io.BytesIO(), _sample_lines(docs, max_chars, seed), ["\n", "\t"]
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=symbols,
            pad_id=PAD_ID,
            unk_id=1,
            bos_id=-1,
            eos_id=-1,
            max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as e:
        # Every byte (the fallback), pad and unk, and every character of the sample (coverage 1.0)
        # get a piece each; a smaller vocabulary is what usually fails here.
        chars = len(set("".join(lines)) | set(symbols))
        need = 256 + 2 + chars
        why = (
            f"it needs at least {need} (256 bytes, pad and unk, and its {chars} distinct "
            "characters); "
            f"raise --vocab-size"
            if vocab_size < need
            else str(e).strip().splitlines()[-1]
        )
        raise DataError(
            f"cannot train a tokenizer of {plural(vocab_size, 'piece')} on this corpus: {why}."
        ) from None
    _write_cache(path, lambda f: f.write(model.getvalue()))
    return load_tokenizer(path)


def _write_cache(path, write):
    """write(f) into a file of this call's own beside `path`, renamed over it when whole: two runs
    that fill one cache at once (two seeds started together) each write their own. A cache file
    needs no fsync: a corrupt one is rebuilt."""
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        with open(tmp, "xb") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:  # a full disk, say: the error names the cache file
        e.filename = path
        raise
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_tokenizer(path):
    import sentencepiece as spm

    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {path!r} does not exist.")
    sp = spm.SentencePieceProcessor()
    try:  # which exception a file that is not a model raises differs between sentencepiece builds
        loaded = sp.load(path) is not False and sp.get_piece_size() > 0
    except Exception:
        loaded = False
    if not loaded:
        raise DataError(f"tokenizer file {path!r} is not a SentencePiece model.")
    return sp


def corpus_key(docs):
    """A name for a list of documents: a hash of their ids, texts and parts, that is, of what
    the readers made of the files, not of the files. A touched or copied corpus keeps its key;
    an edit changes it, and so does a change in what a reader makes of the same files. Hashing
    is fast next to reading."""
    h = hashlib.sha256(len(docs).to_bytes(8, "little"))
    for d in docs:
        for text in (d.id, d.text, repr(d.parts)):
            b = text.encode("utf-8", "surrogateescape")
            h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:16]


def file_hash(path):
    """A short hash of a file's bytes (a tokenizer's)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def fingerprint(*doc_lists):
    """A short hash of lists of token documents (each an int array): their number, lengths and
    ids. A checkpoint keeps the one of the documents it was trained on, which a --resume then
    compares: a touched or copied corpus matches (corpus_key is the same for their text)."""
    h = hashlib.sha256()
    for docs in doc_lists:
        h.update(len(docs).to_bytes(8, "little"))
        for d in docs:
            d = np.ascontiguousarray(d, np.int32)
            h.update(len(d).to_bytes(8, "little") + d.tobytes())
    return h.hexdigest()[:16]


def get_tokenizer(docs, vocab_size, cache_dir, key, seed=0):
    """The cached tokenizer for this corpus and vocab size, trained on first use, and again where
    the cached one cannot be read (a cache heals)."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, f"tokenizer-{key}-{vocab_size}.model")
    if os.path.isfile(path):
        try:
            return load_tokenizer(path), path
        except DataError:
            print(f"note: the cached tokenizer {path} cannot be read; training it again.")
    elif os.path.lexists(path):  # a directory or a link in its place: the cache's own name
        print(f"note: the cached tokenizer {path} is not a file; training it again.")
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    return train_tokenizer(docs, vocab_size, path, seed), path


ENCODE_CHARS = 1 << 22  # a longer text is encoded a piece at a time
ENCODE_BATCH = 1 << 24  # characters encoded at once: SentencePiece's lists take ~40 bytes a token


def newline_pieces(text, size):
    """text in pieces of at most `size` characters, each cut after a newline where one is."""
    start = 0
    while start < len(text):
        end = text.rfind("\n", start, start + size) + 1 if len(text) - start > size else len(text)
        end = end if end > start else start + size  # a line longer than size: cut inside it
        yield text[start:end]
        start = end


def encode_texts(sp, texts):
    """The ids int32 of each text, encoded on every core in batches of pieces cut after newlines
    ("\n" is a piece of its own, so the ids are the whole text's), in bounded memory."""
    ids = [[] for _ in texts]
    batch, owners, size = [], [], 0

    def flush():
        for i, piece in zip(owners, sp.encode(batch, num_threads=os.cpu_count() or 1)):
            ids[i].append(np.asarray(piece, np.int32))
        batch.clear(), owners.clear()

    for i, text in enumerate(texts):
        for piece in newline_pieces(text, ENCODE_CHARS):
            batch.append(piece), owners.append(i)
            size += len(piece)
            if size >= ENCODE_BATCH:
                flush()
                size = 0
    flush()
    return [np.concatenate(p) if p else np.zeros(0, np.int32) for p in ids]


def encode_document(sp, doc):
    """ids int32 [N] and, for synthetic documents, is_reference bool [N]."""
    if not doc.parts:
        ids = encode_texts(sp, [doc.text])[0]
        return ids, np.zeros(len(ids), bool)
    pieces = sp.encode([t for t, _ in doc.parts])  # each part alone: a reference is whole tokens
    return (
        np.concatenate([np.asarray(p, np.int32) for p in pieces]),
        np.concatenate([np.full(len(p), ref, bool) for p, (_, ref) in zip(pieces, doc.parts)]),
    )


def tokenize(docs, sp, cache_path=None):
    """Token arrays, one per document (documents of fewer than 2 tokens are dropped), and the
    matching reference masks. Cached as one .npz when cache_path is given."""
    if cache_path and os.path.isfile(cache_path):
        try:
            with np.load(cache_path) as z:
                tokens, refs, offsets = z["tokens"], z["refs"], z["offsets"]
            # Values as tokenize writes them: ids of this tokenizer, offsets in order.
            in_order = offsets[0] == 0 and offsets[-1] == len(tokens) == len(refs)
            in_order = in_order and np.all(np.diff(offsets) >= 0)
            in_range = tokens.dtype.kind in "iu" and (
                not len(tokens) or 0 <= tokens.min() <= tokens.max() < sp.get_piece_size()
            )
            if not (in_order and in_range):
                raise ValueError(f"{cache_path} holds values tokenize never writes")
            return (
                [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
                [refs[a:b] for a, b in zip(offsets[:-1], offsets[1:])],
            )
        # noqa: BLE001  (a truncated zip, a bad array, ...: whatever np.load raises)
        except Exception:
            print(f"note: the token cache {cache_path} cannot be read; tokenizing again.")
    plain = iter(encode_texts(sp, [d.text for d in docs if not d.parts]))
    encoded = [encode_document(sp, d) if d.parts else (next(plain), None) for d in docs]
    encoded = [(t, np.zeros(len(t), bool) if r is None else r) for t, r in encoded]
    encoded = [(t, r) for t, r in encoded if len(t) >= 2]
    if cache_path:
        offsets = np.cumsum([0] + [len(t) for t, _ in encoded])
        _write_cache(
            cache_path,
            lambda f: np.savez(
                f,
                tokens=np.concatenate([t for t, _ in encoded] or [np.zeros(0, np.int32)]),
                refs=np.concatenate([r for _, r in encoded] or [np.zeros(0, bool)]),
                offsets=offsets,
            ),
        )
    return [t for t, _ in encoded], [r for _, r in encoded]


# ----------------------------------------------------------------------------- batching
class SegmentBatches:
    """Stream documents through B rows, each cut into consecutive segments of T tokens.

    Each step yields numpy arrays: tokens int32 [B, T]; targets int32 [B, T] (the next token,
    across segment boundaries inside a document); mask bool [B, T] (False on padding and on a
    document's last token, which has no target); reset bool [B] (True exactly where a row
    starts a new document). A document of N tokens gives ceil((N - 1) / T) segments.

    Training (epochs=None): document order is reshuffled every epoch with the seed, forever.
    No step holds one document in two rows (Sec. 3: each row's subsequence comes from a
    different document): a row skips the documents other rows are still reading, taking the
    next free one of the order in their place, and they wait; where the rest of an epoch is all
    being read, the row starts the next epoch. Evaluation (epochs=1): one pass; finished rows
    get fully masked segments, and the iterator stops when every row is done.
    `position()` / `restore()` save and resume.
    """

    def __init__(self, docs, batch_size, segment_length, seed=0, epochs=None):
        if batch_size <= 0 or segment_length <= 0:
            raise DataError("batch_size and segment_length must be positive.")
        self.docs = [np.asarray(d, np.int32) for d in docs if len(d) >= 2]
        if not self.docs:
            raise DataError("no document has the 2 tokens that one prediction needs.")
        if epochs is None and len(self.docs) < batch_size:
            n = len(self.docs)
            raise DataError(
                f"the corpus has {plural(n, 'document')}, fewer than the {batch_size} batch rows "
                "(each row reads its own document, Sec. 3); lower --batch-size or add documents."
            )
        self.B, self.T, self.seed, self.epochs = batch_size, segment_length, seed, epochs
        self.epoch, self.next_doc = 0, 0  # position in the epoch's shuffled order
        self.rows = [None] * batch_size  # per row: [doc index, offset] or None (no document)
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch):
        order = np.arange(len(self.docs))
        if self.epochs is None:  # training: a new seeded order every epoch
            np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order

    def _take_document(self, busy):
        """The next document of the order that no other row is reading (`busy`)."""
        while True:
            if self.next_doc == len(self._order):
                if self.epochs is not None and self.epoch + 1 >= self.epochs:
                    return None
                self.epoch, self.next_doc = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            free = [i for i in range(self.next_doc, len(self._order)) if self._order[i] not in busy]
            if not free:  # the rest of this epoch is being read: the next epoch
                self.next_doc = len(self._order)
                continue
            i = free[0]  # it moves up; the busy documents before it wait one place
            self._order[self.next_doc : i + 1] = np.roll(self._order[self.next_doc : i + 1], 1)
            d = int(self._order[self.next_doc])
            self.next_doc += 1
            return d

    def _reading(self, b, batch):
        """The documents the other rows read at this step: rows before b have taken theirs,
        rows after b go on with theirs unless finished."""
        before = {int(d) for d in batch["doc"][:b] if d >= 0}
        after = {
            r[0] for r in self.rows[b + 1 :] if r is not None and r[1] < len(self.docs[r[0]]) - 1
        }
        return before | after

    def __iter__(self):
        return self

    def __next__(self):
        B, T = self.B, self.T
        batch = {
            "tokens": np.full((B, T), PAD_ID, np.int32),
            "targets": np.full((B, T), PAD_ID, np.int32),
            "mask": np.zeros((B, T), bool),
            "reset": np.zeros(B, bool),
            "doc": np.full(B, -1, np.int64),
            "offset": np.zeros(B, np.int64),
        }
        for b in range(B):
            row = self.rows[b]
            if row is None or row[1] >= len(self.docs[row[0]]) - 1:  # finished: next document
                d = self._take_document(self._reading(b, batch))
                self.rows[b] = row = None if d is None else [d, 0]
                batch["reset"][b] = True
            if row is None:
                continue
            doc, off = self.docs[row[0]], row[1]
            seg = doc[off : off + T + 1]
            n = len(seg) - 1  # positions that have a target
            batch["tokens"][b, : len(seg[:T])] = seg[:T]
            batch["targets"][b, :n] = seg[1:]
            batch["mask"][b, :n] = True
            batch["doc"][b], batch["offset"][b] = row[0], off
            row[1] = off + T
        if self.epochs is not None and all(r is None for r in self.rows):
            raise StopIteration
        return batch

    def position(self):
        """A JSON-able position; restore() continues the stream identically."""
        return {
            "epoch": self.epoch,
            "next_doc": self.next_doc,
            "rows": [None if r is None else list(r) for r in self.rows],
            "order": [int(d) for d in self._order],
        }

    def restore(self, pos):
        """Continue from position(). A position that does not fit these documents (a row in a
        document past the last, more or fewer rows) is a ValueError, not a later IndexError."""
        epoch, next_doc, rows = pos["epoch"], pos["next_doc"], pos["rows"]
        is_count = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
        fits = (
            is_count(epoch)
            and is_count(next_doc)
            and next_doc <= len(self.docs)
            and isinstance(rows, list)
            and len(rows) == self.B
            and all(
                r is None
                or (
                    isinstance(r, list)
                    and len(r) == 2
                    and all(map(is_count, r))
                    and r[0] < len(self.docs)
                )
                for r in rows
            )
        )
        # The epoch's order as the rows left it (a position written before it was kept: the seeded
        # order).
        order = pos.get("order", [int(d) for d in self._epoch_order(epoch)])
        fits = fits and isinstance(order, list) and all(map(is_count, order))
        fits = fits and sorted(order) == list(range(len(self.docs)))
        if not fits:
            raise ValueError(
                f"the position {pos!r} does not fit {len(self.docs)} documents in {self.B} rows"
            )
        self.epoch, self.next_doc = epoch, next_doc
        self.rows = [None if r is None else list(r) for r in rows]
        self._order = np.asarray(order, np.int64)
        return self


# ------------------------------------------------------------ where a token's context was last seen
def context_distance(doc, n=3):
    """For each target doc[i], i >= 1: how many tokens back its context (the n tokens ending
    at it) last occurred in the document, 0 if never. A context last seen beyond the local
    window but within the memory is what only the memory can help to predict."""
    last, out = {}, np.zeros(len(doc), np.int64)
    for i in range(n - 1, len(doc)):
        key = tuple(int(t) for t in doc[i - n + 1 : i + 1])
        out[i] = i - last[key] if key in last else 0
        last[key] = i
    return out[1:]


def reach(distance, window, memory_size):
    """Where a context last seen `distance` tokens back lies: new, in the window (local
    attention and XL cache), in the memory, or beyond it."""
    if distance == 0:
        return "new"
    return (
        "window"
        if distance <= window
        else "memory"
        if distance <= window + memory_size
        else "beyond"
    )


REPEAT_BANDS = ("near_repeat", "far_repeat", "new")  # what evaluation reports, by reach


def repeat_bands(doc, window, memory_size, n=3):
    """The band of each target doc[i], i >= 1, by where its context (the n = 3 tokens ending at
    it: a 3-gram of BPE pieces rarely recurs by chance, a single piece everywhere) last occurred
    in the document: near_repeat within the local window (T + the XL cache), far_repeat beyond it
    but within the memory (what only the memory can reach), new never, beyond farther."""
    names = {"window": "near_repeat", "memory": "far_repeat", "new": "new", "beyond": "beyond"}
    return np.array([names[reach(int(d), window, memory_size)] for d in context_distance(doc, n)])


def segment_batches(docs, batch_size, segment_length, seed=0):
    """The core of the pipeline: an endless iterator of batches (see SegmentBatches)."""
    return SegmentBatches(docs, batch_size, segment_length, seed)


# ----------------------------------------------------------------------------- a run's data
def parse_suffixes(text):
    """--suffixes ".py,.c,.h" -> (".py", ".c", ".h"); None -> None."""
    if text is None:
        return None
    suffixes = tuple(x.strip() for x in text.split(","))
    if not all(suffixes):
        raise DataError(
            f"--suffixes takes comma-separated file name endings such as .py,.c,.h, got {text!r}."
        )
    return suffixes


def check_tokens(tokens, vocab_size):
    """A clear error for token ids outside [0, vocab_size): the model never clips them."""
    tokens = np.asarray(tokens)
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if bad.size:
        raise DataError(f"token id {int(bad[0])} is out of range for vocab_size {vocab_size}.")


def first_tokens(docs, n):
    """Each document's first n targets (its first n + 1 tokens); n = 0: the whole document."""
    return [d[: n + 1] for d in docs] if n else list(docs)


class DataOptions(NamedTuple):
    """What chooses a run's data and its validation (train.py's flags of the same names)."""

    data: str
    data_format: str
    suffixes: str  # comma-separated file name endings, or None
    valid_fraction: float
    min_doc_tokens: int
    eval_docs: int
    eval_tokens: int
    cache_dir: str


def prepare(options, vocab_size, tokenizer_path=None):
    """A run's data, from its DataOptions: (train tokens, validation tokens cut to eval_docs and
    eval_tokens (0: whole), their reference distances or None, the tokenizer's path, the
    fingerprints of the training and the whole validation documents, (held-out documents, their
    token share)).
    Writes only to the cache, whose every file is named by a hash of what determines it."""
    os.makedirs(options.cache_dir, exist_ok=True)
    docs = load_documents(
        options.data, options.data_format, seed=0, suffixes=parse_suffixes(options.suffixes)
    )
    train_docs, valid_docs = split_documents(docs, options.valid_fraction, seed=0)
    # the documents as read, whatever the path, format or suffixes that gave them
    split = f"valid_fraction {options.valid_fraction!r} of the characters"
    key = hashlib.sha256(f"{corpus_key(docs)}|{split}".encode()).hexdigest()[:16]
    if tokenizer_path:
        sp = load_tokenizer(tokenizer_path)
    else:
        sp, tokenizer_path = get_tokenizer(train_docs, vocab_size, options.cache_dir, key)
    if sp.get_piece_size() > vocab_size:
        raise DataError(
            f"the tokenizer has {sp.get_piece_size()} pieces but vocab_size is {vocab_size}."
        )
    cache = lambda part: os.path.join(
        options.cache_dir, f"tokens-{key}-{file_hash(tokenizer_path)}-{part}.npz"
    )
    train, _ = tokenize(train_docs, sp, cache("train"))
    valid, refs = tokenize(valid_docs, sp, cache("valid"))
    if options.min_doc_tokens:
        train = [t for t in train if len(t) >= options.min_doc_tokens]
        keep = [i for i, t in enumerate(valid) if len(t) >= options.min_doc_tokens]
        valid, refs = [valid[i] for i in keep], [refs[i] for i in keep]
    if not train or not valid:
        raise DataError(
            f"no document of at least {max(options.min_doc_tokens, 2)} tokens left after the split."
        )
    documents = {"train": fingerprint(train), "validation": fingerprint(valid)}
    share = sum(map(len, valid)) / (sum(map(len, valid)) + sum(map(len, train)))
    held_out = (len(valid), share)  # documents, and their share of the tokens
    valid = first_tokens(valid[: options.eval_docs], options.eval_tokens)
    refs = [r[: len(t)] for t, r in zip(valid, refs)]
    # Synthetic data: how far back each reference's value last appeared.
    distances = (
        [reference_distances(t, r) for t, r in zip(valid, refs)]
        if any(r.any() for r in refs)
        else None
    )
    return train, valid, distances, tokenizer_path, documents, held_out

"""Corpora as documents (Sec. 4.1): how each format is read, and the generated synthetic task.

  docs = load_documents("stdlib")                       # [Document(id, text, parts)]
  docs = load_documents(PATH, "repo", suffixes=(".py",))  # a document per top-level directory

Every reader skips what no corpus holds (hidden files, __pycache__) and counts
what it cannot read (binary, not UTF-8, empty, unreadable) instead of failing;
data.py takes the documents on.
"""

import io
import json
import os
import random
import re
import stat
import sysconfig
from typing import NamedTuple


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
    """A regular file's bytes, or None (counted in stats as unreadable) if it
    cannot be read (no permission, a symlink loop) or is not a regular file: a
    named pipe would block the read until something wrote to it, and a device
    need not end. A file of more than `limit` bytes (one still being written,
    say) is skipped and counted as too large."""
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
    """The text of a file a user names (a prompt), read as a corpus file is: a
    regular file only, of at most `limit` bytes, UTF-8. DataError (one sentence)
    otherwise."""
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
    """The file's text, or None (counted in stats) if it is binary, not UTF-8,
    unreadable or not a regular file (_read_bytes)."""
    raw = _read_bytes(path, stats)
    return None if raw is None else _decode(raw, stats)


def _decode(raw, stats):
    """A file's bytes as text, or None (counted) if binary or not UTF-8."""
    if b"\0" in raw:
        stats["binary"] += 1
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats["not_utf8"] += 1
        return None


def _python_imports(text):
    """Module names a Python file imports (`import a.b`, `from .a import
    b`): each by its last part and by its first (a and b for `import a.b`),
    as a file is named by its stem."""
    found = re.findall(r"^\s*(?:from\s+\.*([\w.]+)\s+import|import\s+([\w.]+))", text, re.M)
    return {(a or b).split(".")[-1] for a, b in found} | {(a or b).split(".")[0] for a, b in found}


def _isabelle_imports(text):
    """Theory names an Isabelle .thy file imports, from its header `theory X
    imports A "B" Session.C "dir/D" [keywords ...] begin`: a session-qualified
    name or a path counts by its last part."""
    text = re.sub(r"\(\*.*?\*\)", " ", text, flags=re.S)  # (* comments *)
    header = re.search(r"\btheory\s+\S+\s+imports\b(.*?)\b(?:keywords|abbrevs|begin)\b", text, re.S)
    names = re.findall(r'"([^"]+)"|([^\s"]+)', header.group(1)) if header else []
    return {(q or b).rstrip("/").split("/")[-1].split(".")[-1] for q, b in names}


def _dependency_order(files):
    """Order (name, text) pairs so that a file comes after the files it imports
    (Python modules, Isabelle theories), wherever they sit in the document;
    otherwise keep the order given. An import names a file by its stem; of
    several, the one in the importer's own directory wins, then the first."""
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

    # Depth first, a file after its dependencies; an import cycle is cut
    # where it closes. With a stack of our own, not Python's: an import chain
    # may be thousands of files long.
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
    """An entry to read as a file: anything but a directory or a link to one. A
    link that leads nowhere (dangling, or a loop), a named pipe or a device is
    then counted as unreadable (_read_bytes)."""
    return not os.path.isdir(path)


def _leaves(root, full):
    """A link that no reader follows (counted as a link): one to a directory (a
    tree could hold itself), or to a file outside root (not the corpus's, nor
    the code base's, text)."""
    if not os.path.islink(full):
        return False
    target = os.path.relpath(os.path.realpath(full), os.path.realpath(root))
    return os.path.isdir(full) or target.split(os.sep)[0] == os.pardir


def _listdir(path, stats):
    """A directory's entries, sorted; an unreadable directory is counted and
    gives none.
"""
    try:
        return sorted(os.listdir(path))
    except OSError:
        stats["unreadable"] += 1
        return []


def _walk_unit(root, rel, rng, stats, suffixes):
    """One directory as a unit (Sec. 4.1): its files and subdirectories in
    random order, each subdirectory's files contiguous. Returns [(relative name,
    text)].

    Depth first, with a stack of our own rather than Python's (a tree may be
    nested a few thousand directories deep): each directory on it is (its name,
    its entries still to visit, its files, its subdirectories' walks)."""

    def enter(rel):
        entries = [e for e in _listdir(os.path.join(root, rel), stats) if not _skipped(e)]
        rng.shuffle(entries)
        return rel, iter(entries), [], []

    stack = [enter(rel)]
    while True:
        rel, entries, files, out = stack[-1]
        for e in entries:
            full, name = os.path.join(root, rel, e), os.path.join(rel, e)
            if _leaves(root, full):
                stats["link"] += 1
            elif os.path.isdir(full):
                stack.append(enter(name))  # its walk goes into `out` once it is done
                break
            elif _is_a_file(full) and (not suffixes or e.endswith(suffixes)):
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
    # A file name that is not UTF-8 (bytes kept by Python as surrogates) is shown escaped, and
    # so is a line break in it: the header stays one line, and the file's lines keep their numbers.
    breaks = str.maketrans({"\n": "\\n", "\r": "\\r"})
    printable = lambda name: os.fsencode(name).decode("utf-8", "backslashreplace").translate(breaks)
    return "".join(
        f"# file: {printable(name)}\n{text}" + ("" if text.endswith("\n") else "\n")
        for name, text in files
    )


def read_repo(path, seed=0, dependency_order=False, suffixes=None, stats=None, prefix=None):
    """The GitHub layout: each top-level directory is one document; loose
    top-level files form one more. Where there are others, a directory that
    holds more than half of the text is read the same way one level further
    down, its subdirectories documents of their own (one package of a library is
    most of it); prefix: the names' prefix of such a level. dependency_order
    puts every file of a document after the files it imports (Sec. 4.1's
    Isabelle ordering; Python imports too). suffixes: a tuple of file name
    endings to read (Sec. 4.1's language filter), or None for all."""
    stats = stats if stats is not None else _new_stats()
    rng = random.Random(seed)
    docs, loose, dirs, top = [], [], {}, prefix is None
    prefix = prefix or ""
    for e in _listdir(path, stats):
        full = os.path.join(path, e)
        if _skipped(e):
            continue
        if _leaves(path, full):
            stats["link"] += 1
        elif os.path.isdir(full):
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


# A directory memorize.py and evaluate.py --score skip, by cause: what no one's code is.
BUILD_DIRS = ("build", "dist", "node_modules", "site-packages", "target")


def _skip_cause(root, name, full):
    """Why a code tree's entry is not read (read_tree), or None."""
    if name.startswith("."):
        return "hidden"
    if name == "__pycache__" or name.endswith(".egg-info") or name in BUILD_DIRS:
        return "build_output"
    if os.path.isdir(full) and os.path.isfile(os.path.join(full, "pyvenv.cfg")):
        return "virtualenv"
    return "link" if _leaves(root, full) else None


TREE_FILE_LIMIT = 2**26  # bytes of one file of a code tree; a larger one is skipped as too large


def read_tree(path, suffixes=None, dependency_order=False, stats=None):
    """The files of a code tree (or one file), as [(name relative to path,
    text)] in sorted path order, or with dependency_order each after the files
    it imports; what is skipped (hidden, build outputs, virtual environments,
    links, binary, ...) is counted in stats."""
    stats = stats if stats is not None else _new_stats()
    for cause in (*_new_stats(), "hidden", "build_output", "virtualenv"):
        stats.setdefault(cause, 0)
    if not os.path.isdir(path):
        text = _read_text_file(path, stats)
        return [(os.path.basename(path), text)] if text and text.strip() else []
    files, stack = [], [""]
    while stack:  # depth first, in sorted order, with a stack of our own
        rel = stack.pop()
        below = []
        for e in _listdir(os.path.join(path, rel), stats):
            full, name = os.path.join(path, rel, e), os.path.join(rel, e)
            cause = _skip_cause(path, e, full)
            if cause:
                stats[cause] += 1
            elif os.path.isdir(full):
                below.append(name)
            elif not suffixes or e.endswith(suffixes):
                raw = _read_bytes(full, stats, TREE_FILE_LIMIT)
                text = None if raw is None else _decode(raw, stats)
                if text is not None and text.strip():
                    files.append((name, text))
                elif text is not None:
                    stats["empty"] += 1
        stack.extend(reversed(below))
    files.sort(key=lambda f: f[0].split(os.sep))
    return _dependency_order(files) if dependency_order else files


def tree_text(name, text):
    """A file as the repository reader joins it: a header line naming it, then
    its text.
"""
    return _join_files([(name, text)])


def _walk(top, onerror=None):
    """os.walk(top, onerror=onerror), top-down, with a stack of our own: Python
    3.11's os.walk recurses once per directory level, so a tree a few thousand
    levels deep would end in a RecursionError. Yields (dirpath, dirnames,
    filenames); dirnames may be edited in place (sorted, pruned) to steer the
    walk, and links to directories are listed, not entered."""
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
    """A file or directory that no corpus reads: hidden (.git, .venv, a .cache
    of ours inside the corpus) or __pycache__."""
    return name.startswith(".") or name == "__pycache__"


def _corpus_walk(top, onerror=None, stats=None):
    """_walk below a corpus directory, without what _skipped names, nor the
    links that _leaves names (counted in stats): what every reader and the
    format's detection see.
"""
    stats = stats if stats is not None else _new_stats()
    for root, dirs, files in _walk(top, onerror):
        kept = {n: not _skipped(n) and not _leaves(top, os.path.join(root, n))
                for n in dirs + files}
        stats["link"] += sum(not _skipped(n) and not kept[n] for n in dirs + files)
        dirs[:] = [d for d in dirs if kept[d]]  # (the same list _walk goes on with)
        yield root, dirs, [f for f in files if kept[f]]


def read_text_dir(path, stats=None):
    """The PG-19 layout: every .txt file below path is one document."""
    stats = stats if stats is not None else _new_stats()
    docs = []
    for root, dirs, files in _corpus_walk(
        path, lambda e: stats.update(unreadable=stats["unreadable"] + 1), stats
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
    """The C4 / arXiv layout: one JSON object per line with a `text` field
    (.jsonl files)."""
    stats = stats if stats is not None else _new_stats()
    paths = (
        [path]
        if os.path.isfile(path)
        else [
            os.path.join(r, f)
            for r, _, fs in sorted(_corpus_walk(path, stats=stats))
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
    """The embedded default corpus: the running Python's standard library (.py
    files) read as a repo. Each top-level package is one document; loose modules
    go in documents of `group`."""
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
    """n distinct two-syllable words (consonant-vowel pairs), e.g. "kamo" or
    "BEDU"."""
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
    """Documents that only long-range memory predicts well (Sec. 4.5's premise,
    in miniature).

    Each document binds `num_names` names to values, both drawn per document
    from fixed pools of 200 pseudo-words, and writes a binding as the line `NAME
    VALUE`. A name's first line defines it; every later line with the same name
    repeats the value, and that VALUE is a reference: marked in `parts`, so its
    loss can be reported on its own, and predictable only by recalling an
    earlier line of the same document. Half of the names are referenced densely
    (mostly within a segment: these teach a local copy circuit); the other half
    only once their last line is more than 2 segments back (these need the
    memory). Short filler lines (`- +`) sit in between. `length` is the
    approximate length in tokens, counting each word, symbol and newline as one
    token (the tokenizer learns the words whole).
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


def synthetic_halves(num_docs=4, seed=0, candidates=1000):
    """The synthetic task across documents (docs/memorize.md, "The mechanism"):
    documents of synthetic_documents that share no name, each cut after the line
    that defines its last name, as [(bindings, uses)]. Memorized, the first
    halves hold every binding; the second halves' first reference to each name
    is then answered by the loaded memory alone."""
    halves, taken = [], set()
    for doc in synthetic_documents(candidates, seed=seed):  # 16 names of 200 each: few disjoint
        lines = doc.text.splitlines(keepends=True)
        names = [line.split()[0] for line in lines if line.split()[0] in SYNTHETIC_NAMES]
        if taken & set(names):
            continue
        taken |= set(names)
        last = max(names.index(n) for n in set(names))  # the last first line, among names
        binding = [i for i, line in enumerate(lines) if line.split()[0] in SYNTHETIC_NAMES]
        cut = binding[last]  # the line of the last name's first binding
        halves.append(("".join(lines[: cut + 1]), "".join(lines[cut + 1 :])))
        if len(halves) == num_docs:
            return halves
    raise ValueError(f"seed {seed} gives fewer than {num_docs} documents with no name shared.")


def write_synthetic_halves(out, num_docs=4, seed=0, candidates=1000):
    """synthetic_halves as files: out/bindings/bind_N.txt and out/uses/use_N.txt
    (out must not exist)."""
    os.makedirs(out)
    for half in ("bindings", "uses"):
        os.makedirs(os.path.join(out, half))
    for i, pair in enumerate(synthetic_halves(num_docs, seed, candidates)):
        for half, text in zip(("bindings/bind", "uses/use"), pair):
            with open(os.path.join(out, f"{half}_{i}.txt"), "w", encoding="utf-8") as f:
                f.write(text)


def synthetic_long_documents(num_docs, distance, seed=0, num_names=16):
    """Documents of the synthetic task whose far references sit `distance`
    tokens back (Sec. 4.4).

    The same lines as synthetic_documents (`NAME VALUE`, filler), arranged as a
    probe: the document first defines its `num_names` names (with filler and
    near references between the definitions, as in training); then only the
    even-numbered names are referenced, densely, for `distance` tokens; then
    each odd-numbered name is referenced once, as soon as its definition lies
    `distance` tokens back, and the document ends. Those references, the probes,
    are the only parts marked as references: their value was seen once, about
    `distance` tokens earlier (a line or two more, where two probes fall due
    together), and never since.
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
    """Whether path (a file or directory, existing or not) lies in the
    corpus directory `source` where a reader would see it: below it, and not
    under a name _skipped hides."""
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
    """Whether two --data values name the same corpus: the same name for the
    embedded and the generated ones; the same file or directory for paths
    (./corpus/, corpus and a link to it)."""
    if "stdlib" in (a, b) or is_synthetic(a) or is_synthetic(b):
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


def _new_stats():
    return {"binary": 0, "not_utf8": 0, "empty": 0, "bad_json": 0, "unreadable": 0, "too_large": 0,
            "link": 0}


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
    """`source` is "stdlib", "synthetic" or a path. Returns [Document]; prints a
    one-line summary of what was skipped. Raises DataError (one sentence) on a
    missing path or an empty corpus. suffixes (repositories only): the file name
    endings to read, e.g. (".py", ".c", ".h")."""
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

"""Documents -> tokens -> ordered segments -> batches (Sec. 3 "Batching", Sec. 4.1).

  docs = corpora.load_documents("stdlib")          # [Document(id, text, parts)]
  train, valid = split_documents(docs, 0.05, seed)
  sp = get_tokenizer(train, vocab_size, cache_dir, key)  # SentencePiece, trained once and cached
  tokens, _ = tokenize(train, sp, cache_path)      # [int32 array per document]
  for batch in segment_batches(tokens, B, T, seed): ...

A batch row streams one document after another, each cut into consecutive segments of T
tokens in order (never shuffled); the row's `reset` flag marks a document's first segment,
where the model clears that row's memory and cache.
"""

import hashlib
import io
import os
import random
import shutil
import threading
from typing import NamedTuple

import numpy as np

import corpora
from corpora import DataError, plural

PAD_ID = 0  # padding: always masked


# ----------------------------------------------------------------------------- the split
def split_documents(docs, valid_fraction=0.05, seed=0):
    """Deterministic split by document that holds out about valid_fraction of
    the corpus's characters: in a seeded order, a document is held out while the
    held-out share is short of the fraction and it fits within twice the
    fraction, so that a document that is most of the corpus never is. No
    document is in both; at least one of each."""
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
    """A bounded, seeded sample of text chunks (a few lines each) for tokenizer
    training."""
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
    """BPE SentencePiece (as in the paper) on a bounded sample. Byte fallback
    and identity normalization make decode(encode(text)) == text, newlines and
    indentation included."""
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
    """write(f) into a file of this call's own beside `path`, renamed over it
    when whole: two runs that fill one cache at once (two seeds started
    together) each write their own. A cache file needs no fsync: a corrupt one
    is rebuilt."""
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
    """A name for a list of documents: a hash of their ids, texts and parts,
    that is, of what the readers made of the files, not of the files. A touched
    or copied corpus keeps its key; an edit changes it, and so does a change in
    what a reader makes of the same files. Hashing is fast next to reading."""
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
    """A short hash of lists of token documents (each an int array): their
    number, lengths and ids. A checkpoint keeps the one of the documents it was
    trained on, which a --resume then compares: a touched or copied corpus
    matches (corpus_key is the same for their text)."""
    h = hashlib.sha256()
    for docs in doc_lists:
        h.update(len(docs).to_bytes(8, "little"))
        for d in docs:
            d = np.ascontiguousarray(d, np.int32)
            h.update(len(d).to_bytes(8, "little") + d.tobytes())
    return h.hexdigest()[:16]


def get_tokenizer(docs, vocab_size, cache_dir, key, seed=0):
    """The cached tokenizer for this corpus and vocab size, trained on first
    use, and again where the cached one cannot be read (a cache heals)."""
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
    """text in pieces of at most `size` characters, each cut after a newline
    where one is."""
    start = 0
    while start < len(text):
        end = text.rfind("\n", start, start + size) + 1 if len(text) - start > size else len(text)
        end = end if end > start else start + size  # a line longer than size: cut inside it
        yield text[start:end]
        start = end


def encode_texts(sp, texts):
    """The ids int32 of each text, encoded on every core in batches of pieces
    cut after newlines ("\n" is a piece of its own, so the ids are the whole
    text's), in bounded memory."""
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
    """Token arrays, one per document (documents of fewer than 2 tokens are
    dropped), and the matching reference masks. Cached as one .npz when
    cache_path is given."""
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
    """Stream documents through B rows, each cut into consecutive segments of T
    tokens.

    Each step yields numpy arrays: tokens int32 [B, T]; targets int32 [B, T]
    (the next token, across segment boundaries inside a document); mask bool [B,
    T] (False on padding and on a document's last token, which has no target);
    reset bool [B] (True exactly where a row starts a new document). A document
    of N tokens gives ceil((N - 1) / T) segments.

    Training (epochs=None): document order is reshuffled every epoch with the
    seed, forever. No step holds one document in two rows (Sec. 3: each row's
    subsequence comes from a different document): a row skips the documents
    other rows are still reading, taking the next free one of the order in their
    place, and they wait; where the rest of an epoch is all being read, the row
    starts the next epoch. Evaluation (epochs=1): one pass; finished rows get
    fully masked segments, and the iterator stops when every row is done.
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
        """The next document of the order that no other row is reading (`busy`).
        """
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
        """The documents the other rows read at this step: rows before b have
        taken theirs, rows after b go on with theirs unless finished."""
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
        """Continue from position(). A position that does not fit these
        documents (a row in a document past the last, more or fewer rows) is a
        ValueError, not a later IndexError."""
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


def segment_batches(docs, batch_size, segment_length, seed=0):
    """The core of the pipeline: an endless iterator of batches (see
    SegmentBatches)."""
    return SegmentBatches(docs, batch_size, segment_length, seed)


# ------------------------------------------------------------ where a token's context was last seen
def context_distance(doc, n=3):
    """For each target doc[i], i >= 1: how many tokens back its context (the n
    tokens ending at it) last occurred in the document, 0 if never. A context
    last seen beyond the local window but within the memory is what only the
    memory can help to predict.
"""
    last, out = {}, np.zeros(len(doc), np.int64)
    for i in range(n - 1, len(doc)):
        key = tuple(int(t) for t in doc[i - n + 1 : i + 1])
        out[i] = i - last[key] if key in last else 0
        last[key] = i
    return out[1:]


def reach(distance, window, memory_size):
    """Where a context last seen `distance` tokens back lies: new, in the window
    (local attention and XL cache), in the memory, or beyond it."""
    if distance == 0:
        return "new"
    return (
        "window"
        if distance <= window
        else "memory"
        if distance <= window + memory_size
        else "beyond"
    )


REPEAT_BANDS = ("near_repeat", "far_repeat", "beyond", "new")  # evaluation reports, by reach
SPAN = 16  # far_span's context: about a line of code, which an idiom rarely fills
BANDS = REPEAT_BANDS + ("far_span",)  # far_span: a part of far_repeat (span_band)


def repeat_bands(doc, window, memory_size, n=3):
    """The band of each target doc[i], i >= 1, by where its context (the n = 3
    tokens ending at it: a 3-gram of BPE pieces rarely recurs by chance, a
    single piece everywhere) last occurred in the document: near_repeat within
    the local window (T + the XL cache), far_repeat beyond it but within the
    memory (what only the memory can reach), new never, beyond farther."""
    names = {"window": "near_repeat", "memory": "far_repeat", "new": "new", "beyond": "beyond"}
    return np.array([names[reach(int(d), window, memory_size)] for d in context_distance(doc, n)])


def span_band(doc, window, memory_size, n=SPAN, bands=None):
    """far_span: the far_repeat targets whose n-token context also last occurred
    beyond the window and within the memory. A 3-token context on code is often
    an idiom (`self.`, `return`) that recurs everywhere; a whole line repeated
    verbatim is what retrieval copies. bands: the document's repeat_bands, where
    the caller has them."""
    bands = repeat_bands(doc, window, memory_size) if bands is None else bands
    far = bands == "far_repeat"  # [len(doc) - 1]
    return far & (repeat_bands(doc, window, memory_size, n) == "far_repeat")


def reference_distances(tokens, is_reference):
    """For each reference token, how many tokens back the same (previous token,
    token) pair last occurred: how far a model must look to copy it. 0 for other
    tokens; -1 for a reference whose pair never occurred before (a tokenization
    that split a word)."""
    tokens = np.asarray(tokens)
    dist = np.zeros(len(tokens), np.int64)
    seen = {}
    for i in range(1, len(tokens)):
        pair = (int(tokens[i - 1]), int(tokens[i]))
        if is_reference[i]:
            dist[i] = i - seen[pair] if pair in seen else -1
        seen[pair] = i
    return dist


# ----------------------------------------------------------------------------- a run's data
def check_tokens(tokens, vocab_size):
    """A clear error for token ids outside [0, vocab_size): the model never
    clips them.
"""
    tokens = np.asarray(tokens)
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if bad.size:
        raise DataError(f"token id {int(bad[0])} is out of range for vocab_size {vocab_size}.")


def first_tokens(docs, n):
    """Each document's first n targets (its first n + 1 tokens); n = 0: the
    whole document."""
    return [d[: n + 1] for d in docs] if n else list(docs)


class DataOptions(NamedTuple):
    """What chooses a run's data and its validation (train.py's flags of the
    same names)."""

    data: str
    data_format: str
    suffixes: str  # comma-separated file name endings, or None
    valid_fraction: float
    min_doc_tokens: int
    eval_docs: int
    eval_tokens: int
    cache_dir: str


def prepare(options, vocab_size, tokenizer_path=None):
    """A run's data, from its DataOptions: (train tokens, validation tokens cut
    to eval_docs and eval_tokens (0: whole), their reference distances or None,
    the tokenizer's path, the fingerprints of the training and the whole
    validation documents, (held-out documents, their token share)). Writes only
    to the cache, whose every file is named by a hash of what determines it."""
    os.makedirs(options.cache_dir, exist_ok=True)
    suffixes = corpora.parse_suffixes(options.suffixes)
    docs = corpora.load_documents(options.data, options.data_format, seed=0, suffixes=suffixes)
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

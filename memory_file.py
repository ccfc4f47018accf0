"""A memorized code base on disk: the memory layers' (key, value) pairs, what each slot came
from, and what they were made with, in one checked file (memorize.py writes it; sample.py and
evaluate.py take it with --load-memory).

  write(path, header, arrays)                 # atomically
  memory = read(path, config, params_hash, tokenizer_hash, pieces)   # checked, in memory
  memory = last_slots(memory, size)           # what memorize.py --memory-size size keeps

The layout, every part aligned to 64 bytes:
  MAGIC (8 bytes), the format VERSION (uint32), the header's length (uint64), the header
  (JSON, padded with spaces), the arrays (raw, little-endian, in ARRAYS' order, each padded with
  zeros), and last a SHA-256 over all the bytes before it.
The header names the run's Config, the hashes of its parameters and tokenizer, the memory
layers, H, D, the dtype, the slot count M, the write position, the memorized files' names
(relative to the memorized PATH), and each array's dtype, shape and offset.

A memory file is untrusted input. read() takes it through one open descriptor: the header is
checked field by field, the layout recomputed from the shapes and held to the header and to the
file's size, the arrays read into their final buffers as they are hashed, and every slot's
values checked, before anything uses them.
"""

import contextlib
import hashlib
import json
import os
import stat
import struct
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import cli
import memorizing_transformer as mt
import runs

MAGIC = b"MTMEMORY"
FORMAT = "memorizing-transformer memory"  # the header's "format"
VERSION = 1
ALIGN = 64
CHUNK = 1 << 22  # bytes read and hashed at a time
HEADER_LIMIT = 1 << 28  # bytes: a header names files, not slots
# name: what each slot holds; keys and values are [Lm, H, M, D], the others [M]: the
# token id, the index of its file in the header's list, its token offset in the file's
# text, and its line there (1-based; 0 is the header line that names the file). A free
# slot holds zeros, and -1 in each of its sources.
ARRAYS = ("keys", "values", "valid", "token", "file", "offset", "line")
SOURCES = ("token", "file", "offset", "line")
SLOT_DTYPES = {"valid": "bool", "token": "int32", "file": "int32", "offset": "int64",
               "line": "int32"}
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "bool": np.dtype(bool), "int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
# Every field of a header, and the JSON type it must have.
HEADER = {"format": str, "config": dict, "params_hash": str, "tokenizer_hash": str,
          "memory_layers": list, "heads": int, "head_dim": int, "segment_length": int,
          "dtype": str, "slots": int, "position": int, "files": list, "arrays": list}


class Memory(NamedTuple):
    """A read memory file: its header (dict), arrays (read-only numpy arrays)
    and path.
"""

    header: dict
    arrays: dict
    path: str


def params_hash(params):
    """A short hash of a model's parameters: every leaf's name, dtype, shape and
    bytes.
"""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)} {x.dtype} {x.shape}".encode())
        h.update(x.tobytes())
    return h.hexdigest()[:16]


def _padded(n):
    return -(-n // ALIGN) * ALIGN


def layout(layers, heads, slots, head_dim, dtype):
    """The header's "arrays": each array's name, dtype, shape and offset from
    the first, as write lays them out; and the bytes they take."""
    entries, offset = [], 0
    for name in ARRAYS:
        pairs = name in ("keys", "values")
        shape = [layers, heads, slots, head_dim] if pairs else [slots]
        kind = SLOT_DTYPES.get(name, dtype)
        entries.append({"name": name, "dtype": kind, "shape": shape, "offset": offset})
        offset += _padded(int(np.prod(shape)) * DTYPES[kind].itemsize)
    return entries, offset


def write(path, header, arrays):
    """Write header (a dict) and arrays (name -> numpy array, all of ARRAYS) to
    path whole (runs.write_output: a stream in place, a file atomically), the
    checksum computed as the bytes are written."""
    layers, heads, slots, head_dim = arrays["keys"].shape
    dtype = _dtype_name(arrays["keys"].dtype)
    entries, _ = layout(layers, heads, slots, head_dim, dtype)
    for entry in entries:
        a = arrays[entry["name"]]
        assert list(a.shape) == entry["shape"] and _dtype_name(a.dtype) == entry["dtype"], entry
    text = json.dumps(dict(header, arrays=entries), sort_keys=True).encode()
    start = _padded(PREFIX.size + len(text))
    head = PREFIX.pack(MAGIC, VERSION, len(text)) + text
    head += b" " * (start - len(head))

    def content(f):
        h = hashlib.sha256()

        def put(b):
            h.update(b)
            f.write(b)

        put(head)
        for name in ARRAYS:
            a = np.ascontiguousarray(arrays[name])
            flat = a.reshape(-1).view(np.uint8)  # [nbytes]
            for i in range(0, flat.size, CHUNK):
                put(flat[i : i + CHUNK].tobytes())
            put(b"\0" * (_padded(a.nbytes) - a.nbytes))
        f.write(h.digest())

    runs.write_output(path, content)


def _dtype_name(dtype):
    return next(k for k, v in DTYPES.items() if v == dtype)


def _refuse(path, why):
    raise cli.UsageError(f"--load-memory {path} {why}")


# ----------------------------------------------------------------------------- reading
@contextlib.contextmanager
def _open_regular(path):
    """path opened for reading, once: a FIFO or a device is refused without
    waiting for a writer (O_NONBLOCK), and a directory is refused too."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        _refuse(path, f"cannot be read: {e.strerror}.")
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _refuse(path, "is not a regular file: a memory file is one (memorize.py writes it).")
        yield f


def _take(f, h, n, path):
    """The next n bytes of f, added to the hash h; fewer is a truncated file."""
    out = bytearray(n)
    view = memoryview(out)
    for i in range(0, n, CHUNK):
        piece = view[i : i + CHUNK]
        if f.readinto(piece) != len(piece):
            _refuse(path, "is truncated: memorize the code again.")
        h.update(piece)
    return out


def _read_array(f, h, entry, path):
    """One array read straight into its final buffer as it is hashed, then its
    padding.
"""
    bytewise = entry["dtype"] == "bool"  # a flag as its byte, checked to be 0 or 1 later
    out = np.empty(entry["shape"], np.uint8 if bytewise else DTYPES[entry["dtype"]])
    flat = out.reshape(-1).view(np.uint8)  # [nbytes]
    for i in range(0, flat.size, CHUNK):
        piece = flat[i : i + CHUNK]
        if f.readinto(memoryview(piece)) != piece.size:
            _refuse(path, "is truncated: memorize the code again.")
        h.update(piece)
    _take(f, h, _padded(flat.size) - flat.size, path)
    return out


def _parse_header(text, path):
    try:
        header = json.loads(bytes(text))
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        _refuse(path, "has a header that is not a JSON object: it is not a memory file.")
    for field, kind in HEADER.items():
        value = header.get(field)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            _refuse(path, f"has no valid header field {field!r}: it is corrupt.")
    if header["format"] != FORMAT:
        _refuse(path, f"names its format {header['format']!r}, not {FORMAT!r}.")
    ints = lambda xs: all(mt.is_int(x) for x in xs)
    if not ints(header["memory_layers"]) or not all(isinstance(x, str) for x in header["files"]):
        _refuse(path, "has a header whose memory_layers or files are of the wrong type.")
    return header


def _check_header(path, header, config, params_hash_, tokenizer_hash):
    """The header against the run, and its layout against the one its shapes
    give."""
    for field, ours in (("params_hash", params_hash_), ("tokenizer_hash", tokenizer_hash)):
        if header[field] != ours:
            _refuse(path, f"was made by another run: its {field.replace('_', ' ')} is "
                    f"{header[field]}, this run's is {ours}.")
    layers = list(config.active_memory_layers)
    expected = {"memory_layers": layers, "heads": config.num_heads,
                "head_dim": config.head_dim, "segment_length": config.segment_length}
    for field, ours in expected.items():
        if header[field] != ours:
            _refuse(path, f"was made for {field} {header[field]}, this run has {ours}.")
    if header["dtype"] not in ("float32", "bfloat16"):
        _refuse(path, f"has keys of dtype {header['dtype']!r}: it is corrupt.")
    M, pos, T = header["slots"], header["position"], config.segment_length
    if not (M > 0 and M % T == 0 and 0 <= pos < M and pos % T == 0):
        _refuse(path, f"has a write position of {pos} in {M} slots, where writes land at "
                f"multiples of {T} below M: it is corrupt.")
    entries, _ = layout(len(layers), config.num_heads, M, config.head_dim, header["dtype"])
    if header["arrays"] != entries:
        _refuse(path, "does not lay out its arrays as a memory file does: it is corrupt.")


def read(path, config, params_hash_, tokenizer_hash, pieces=None):
    """The checked memory file at path, for a run of this config, parameters and
    tokenizer (of `pieces` token ids; default: config.vocab_size):
    Memory(header, arrays). Whatever would make it wrong for the run, or is not
    what memorize.py writes, is a cli.UsageError naming it, raised before
    anything uses the file."""
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.sha256()
        prefix = _take(f, h, PREFIX.size, path) if size >= PREFIX.size else b""
        if len(prefix) < PREFIX.size or prefix[:8] != MAGIC:
            _refuse(path, "is not a memory file (memorize.py writes them).")
        _, version, length = PREFIX.unpack(prefix)
        if version != VERSION:
            _refuse(path, f"has format version {version}; this code reads version "
                    f"{VERSION}: memorize the code again.")
        if length > min(HEADER_LIMIT, size - PREFIX.size - 32):
            _refuse(path, "is truncated: memorize the code again.")
        header = _parse_header(_take(f, h, length, path), path)
        _check_header(path, header, config, params_hash_, tokenizer_hash)
        data_start = _padded(PREFIX.size + length)
        _, data_bytes = layout(len(header["memory_layers"]), header["heads"], header["slots"],
                               header["head_dim"], header["dtype"])
        if size != data_start + data_bytes + 32:
            _refuse(path, f"has {size} bytes where its header lays out "
                    f"{data_start + data_bytes + 32}: it is truncated or changed.")
        _take(f, h, data_start - PREFIX.size - length, path)  # the header's padding
        arrays = {e["name"]: _read_array(f, h, e, path) for e in header["arrays"]}
        if h.digest() != f.read(32):
            _refuse(path, "fails its checksum: it is truncated or changed; memorize the "
                    "code again.")
    header["data_start"] = data_start
    _check_slots(path, header, arrays, config.vocab_size if pieces is None else pieces)
    arrays["valid"] = arrays["valid"].view(bool)
    for a in arrays.values():
        a.flags.writeable = False
    return Memory(header, arrays, path)


def _check_slots(path, header, arrays, pieces):
    """Every slot's values: a valid flag of 0 or 1; a held slot's token a piece
    of the tokenizer, its file one of the header's, its offset and line >= 0; a
    free slot's sources -1; keys and values finite."""
    flags = arrays["valid"]  # [M] uint8
    if flags.max(initial=0) > 1:
        _refuse(path, "holds a valid flag other than 0 or 1: it is corrupt.")
    held = flags == 1
    lows = {"token": 0, "file": 0, "offset": 0, "line": 0}
    highs = {"token": pieces, "file": len(header["files"])}
    for name in SOURCES:
        a = arrays[name]
        low, high = lows[name], highs.get(name)
        bad = (a < low) | (a >= high) if high is not None else a < low  # [M]
        if np.any(bad & held) or np.any((a != -1) & ~held):
            limits = f"[{low}, {high})" if high is not None else f">= {low}"
            _refuse(path, f"holds a slot whose {name} is out of range (a held slot's must be in "
                    f"{limits}, a free slot's -1): it is corrupt.")
    for name in ("keys", "values"):
        for block in arrays[name].reshape(-1, header["slots"], header["head_dim"]):
            if not np.isfinite(block.astype(np.float32)).all():
                _refuse(path, f"holds {name} that are not finite: it is corrupt.")


# ----------------------------------------------------------------------------- using a memory
def last_slots(memory, size):
    """The memory that memorize.py --memory-size `size` (a multiple of T below
    M) would have written from the same text: the last size / T segments
    written, oldest first from slot 0 (FIFO), and the write position after them.
    """
    M, T = memory.header["slots"], memory.header["segment_length"]
    start = memory.header["position"] // T
    order = [(start + i) % (M // T) for i in range(M // T)]  # the blocks, oldest first
    written = [b for b in order if memory.arrays["valid"][b * T : (b + 1) * T].any()]
    kept = written[len(written) - size // T :] if size // T < len(written) else written
    take = np.full(size, -1)  # [size]: the file's slot of each new slot, -1 for a free one
    for i, b in enumerate(kept):
        take[i * T : (i + 1) * T] = np.arange(b * T, (b + 1) * T)
    free = take < 0  # [size]
    arrays = {}
    for name, a in memory.arrays.items():
        axis = 2 if name in ("keys", "values") else 0  # the slot axis: [Lm, H, M, D] or [M]
        part = np.take(a, np.maximum(take, 0), axis=axis)
        fill = False if name == "valid" else (-1 if name in SOURCES else 0)
        where = free.reshape([-1] + [1] * (a.ndim - 1 - axis))  # free slots along the axis
        arrays[name] = np.where(where, np.asarray(fill, a.dtype), part)
    header = dict(memory.header, slots=size, position=len(kept) * T % size)
    return Memory(header, arrays, memory.path)


def start_state(memory, config, memory_size=None):
    """The config and the one-row state that a document starts from: the file's
    slots, then free ones up to memory_size (default: the file's M); a smaller
    size keeps the last slots (last_slots). The memory's dtype is the file's."""
    M = memory.header["slots"]
    size = M if memory_size is None else memory_size
    try:
        config = config.replace(memory_size=size, memory_dtype=memory.header["dtype"])
    except ValueError as e:
        raise cli.UsageError(f"--memory-size {size} does not fit the run: {e}") from None
    runs.check_fits(config, 1)  # before the free slots are allocated
    if size < M:
        memory = last_slots(memory, size)
        M = size
    T = config.segment_length
    small = config.replace(memory_size=-(-config.num_neighbors // T) * T)
    state = mt.init_state(small, 1)  # the XL cache's zeros; the memory is the file's
    pos = memory.header["position"]
    if pos == 0 and size > M and memory.arrays["valid"].any():  # a full file: free slots next
        pos = M
    state = state._replace(
        mem_k=jax.device_put(grown(memory, "keys", size)),  # [1, Lm, H, size, D]
        mem_v=jax.device_put(grown(memory, "values", size)),  # [1, Lm, H, size, D]
        mem_valid=jnp.asarray(grown(memory, "valid", size)),  # [1, size]
        mem_pos=jnp.full(1, pos, jnp.int32),
    )
    return config, state


def grown(memory, name, size):
    """The memory's array as one row with free slots (zeros) after its M: [1,
    ..., size, ...]."""
    a = memory.arrays[name]
    axis = 2 if name in ("keys", "values") else 0  # the slot axis: [Lm, H, M, D] or [M]
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return np.pad(a, pad)[None]


def held_tokens(memory):
    """The memorized token ids still held, in the order they were streamed: [n].
    """
    return np.asarray(memory.arrays["token"])[np.asarray(memory.arrays["valid"])]

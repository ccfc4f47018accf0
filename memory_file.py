"""A memorized code base on disk: the memory layers' (key, value) pairs, what each slot came
from, and what they were made with, in one checked file (memorize.py writes it; sample.py and
evaluate.py take it with --load-memory).

  write(path, header, arrays)                 # atomically
  memory = read(path, config, params_hash, tokenizer_hash)   # checked, memory-mapped

The layout, every part aligned to 64 bytes:
  MAGIC (8 bytes), the format VERSION (uint32), the header's length (uint64), the header
  (JSON, padded with spaces), the arrays (raw, little-endian, in ARRAYS' order), and last a
  SHA-256 over all the bytes before it.
The header names the run's Config, the hashes of its parameters and tokenizer, the memory
layers, H, D, the dtype, the slot count M, the write position, the memorized files' names
(relative to the memorized PATH), and each array's dtype, shape and offset.
"""

import hashlib
import json
import mmap
import os
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
VERSION = 1
ALIGN = 64
CHUNK = 1 << 22  # bytes hashed at a time: the check reads the file once, in bounded memory
# name: what each slot holds; keys and values are [Lm, H, M, D], the others [M]: the
# token id, the index of its file in the header's list, its token offset in the file's
# text, and its line there (1-based; 0 is the header line that names the file)
ARRAYS = ("keys", "values", "valid", "token", "file", "offset", "line")
SLOT_DTYPES = {"valid": "bool", "token": "int32", "file": "int32", "offset": "int64",
               "line": "int32"}
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "bool": np.dtype(bool), "int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
PREFIX = struct.Struct("<8sIQ")  # magic, version, header length


class Memory(NamedTuple):
    """A read memory file: its header (dict), arrays (read-only, memory-mapped) and path."""

    header: dict
    arrays: dict
    path: str


def params_hash(params):
    """A short hash of a model's parameters: every leaf's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)} {x.dtype} {x.shape}".encode())
        h.update(x.tobytes())
    return h.hexdigest()[:16]


def _padded(n):
    return -(-n // ALIGN) * ALIGN


def write(path, header, arrays):
    """Write header (a dict) and arrays (name -> numpy array, all of ARRAYS) to path,
    atomically (runs.atomic_write), the checksum computed as the bytes are written."""
    layout, offset = [], 0
    for name in ARRAYS:
        a = arrays[name]
        layout.append({"name": name, "dtype": _dtype_name(a.dtype), "shape": list(a.shape),
                       "offset": offset})
        offset += _padded(a.nbytes)
    text = json.dumps(dict(header, arrays=layout), sort_keys=True).encode()
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

    runs.atomic_write(path, content)


def _dtype_name(dtype):
    return next(k for k, v in DTYPES.items() if v == dtype)


def _refuse(path, why):
    raise cli.UsageError(f"--load-memory {path} {why}")


def read_header(path):
    """The header of a memory file, its bytes checked against the checksum; the file
    not being one, another version, truncated or changed anywhere is a cli.UsageError."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size or prefix[:8] != MAGIC:
                _refuse(path, "is not a memory file (memorize.py writes them).")
            _, version, length = PREFIX.unpack(prefix)
            if version != VERSION:
                _refuse(path, f"has format version {version}; this code reads version "
                        f"{VERSION}: memorize the code again.")
            if size < PREFIX.size + length + 32:
                _refuse(path, "is truncated: memorize the code again.")
            h = hashlib.sha256(prefix)
            text = f.read(length)
            h.update(text)
            left = size - 32 - PREFIX.size - length
            while left > 0:
                b = f.read(min(CHUNK, left))
                if not b:
                    break
                h.update(b)
                left -= len(b)
            if h.digest() != f.read(32):
                _refuse(path, "fails its checksum: it is truncated or changed; memorize the "
                        "code again.")
    except OSError as e:
        _refuse(path, f"cannot be read: {e.strerror}.")
    try:
        header = json.loads(text)
        header["data_start"] = _padded(PREFIX.size + length)
    except (ValueError, TypeError):
        _refuse(path, "has a header that is not JSON: it is not a memory file.")
    return header


def read(path, config, params_hash_, tokenizer_hash):
    """The checked memory file at path, for a run of this config, parameters and
    tokenizer: Memory(header, arrays memory-mapped read-only). Whatever would make it
    wrong for the run is a cli.UsageError naming the difference."""
    header = read_header(path)
    for field, ours in (("params_hash", params_hash_), ("tokenizer_hash", tokenizer_hash)):
        if header.get(field) != ours:
            _refuse(path, f"was made by another run: its {field.replace('_', ' ')} is "
                    f"{header.get(field)}, this run's is {ours}.")
    layers = list(config.active_memory_layers)
    expected = {"memory_layers": layers, "heads": config.num_heads,
                "head_dim": config.head_dim, "segment_length": config.segment_length}
    for field, ours in expected.items():
        if header.get(field) != ours:
            _refuse(path, f"was made for {field} {header.get(field)}, this run has {ours}.")
    M, pos, T = header["slots"], header["position"], config.segment_length
    if not (0 <= pos < M and pos % T == 0 and M % T == 0):
        _refuse(path, f"has a write position of {pos} in {M} slots, where writes land at "
                f"multiples of {T} below M: it is corrupt.")
    shapes = {"keys": [len(layers), config.num_heads, M, config.head_dim]}
    shapes["values"] = shapes["keys"]
    arrays = {}
    for entry in header["arrays"]:
        name = entry["name"]
        wanted = SLOT_DTYPES.get(name, header["dtype"])
        if entry["dtype"] != wanted or entry["shape"] != shapes.get(name, [M]):
            _refuse(path, f"has a {name} array of {entry['dtype']} {entry['shape']}, "
                    f"not {wanted} {shapes.get(name, [M])}: it is corrupt.")
        arrays[name] = np.memmap(path, DTYPES[entry["dtype"]], "r",
                                 header["data_start"] + entry["offset"], tuple(entry["shape"]))
    if [e["name"] for e in header["arrays"]] != list(ARRAYS):
        _refuse(path, "does not hold the arrays of a memory file: it is corrupt.")
    return Memory(header, arrays, path)


def start_state(memory, config, memory_size=None):
    """The config and the one-row state that a document starts from: the file's slots,
    then free ones up to memory_size (default: the file's M; a smaller one is refused).
    The memory's dtype is the file's."""
    M = memory.header["slots"]
    size = M if memory_size is None else memory_size
    if size < M:
        raise cli.UsageError(f"--memory-size {size} is smaller than the loaded memory's {M} "
                             "slots: memorize again with a smaller --memory-size.")
    try:
        config = config.replace(memory_size=size, memory_dtype=memory.header["dtype"])
    except ValueError as e:
        raise cli.UsageError(f"--memory-size {size} does not fit the run: {e}") from None
    runs.check_fits(config, 1)  # before the free slots are allocated
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
    """The file's array read straight into its final buffer, one row with free slots after
    the file's M (zeros): [1, ..., size, ...]. Read, not mapped: the file's pages are not
    kept as a second copy of it."""
    entry = next(e for e in memory.header["arrays"] if e["name"] == name)
    shape, M = entry["shape"], memory.header["slots"]
    axis = 2 if name in ("keys", "values") else 0  # the slot axis: [Lm, H, M, D] or [M]
    dims, dtype = [1] + shape[:axis] + [size] + shape[axis + 1 :], DTYPES[entry["dtype"]]
    # Pages of their own, zeros until read (the free slots stay so): aligned, a CPU device
    # takes the buffer as it is, and else it goes back to the system once copied.
    pages = mmap.mmap(-1, max(int(np.prod(dims)) * dtype.itemsize, 1))
    out = np.frombuffer(pages, dtype, int(np.prod(dims))).reshape(dims)
    lead = int(np.prod(shape[:axis]))  # the (layer, head) blocks before the slot axis
    blocks = out.reshape(lead, size, -1)  # [Lm * H, size, D] or [1, size, 1]
    with open(memory.path, "rb") as f:
        f.seek(memory.header["data_start"] + entry["offset"])
        for block in blocks:
            view = block[:M].view(np.uint8).reshape(-1)  # the file's slots of this block
            if f.readinto(view) != view.size:
                raise cli.UsageError(f"{memory.path} was cut short while it was read.")
    return out


def held_tokens(memory):
    """The memorized token ids still held, in the order they were streamed: [n]."""
    return np.asarray(memory.arrays["token"])[np.asarray(memory.arrays["valid"])]

"""Several processes, one run: data parallelism past one machine, on JAX's own multi-process
runtime.

Every process runs train.py with the same flags but its --process-id (one process per host, each
with its local devices). jax.distributed connects them; the devices of all processes form one
mesh, in the order (process, device), and the global batch's rows are split over it in that
order, so process p holds the rows [p B/P, (p+1) B/P) and their memories. Every process reads the
same data stream and places only its own rows; the parameters are replicated. The global batch,
and so the run, is the same whatever the number of processes. Process 0 writes the run's files.
"""

import contextlib
import functools
import hashlib
import io
import os
import socket
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import cli
import corpora

# What SLURM's srun sets in each task (a variable only its tasks have, their count, this one's
# rank),
# read where no flag is given; JAX finds the coordinator from the job's nodes and id itself.
SLURM = ("SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")


def settings(args):
    """(coordinator or None, number of processes, process id, whether a launcher
    gave them) from the flags, else from the environment:
    JAX_COORDINATOR_ADDRESS, and a launcher's task count and rank."""
    coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    n, pid = args.num_processes, args.process_id
    present, count, rank = SLURM
    if (
        n is None
        and pid is None
        and present in os.environ
        and os.environ.get(count, "").isdigit()
        and os.environ.get(rank, "").isdigit()
    ):
        return coordinator, int(os.environ[count]), int(os.environ[rank]), True
    return coordinator, n, pid, False


def start(args):
    """Join the run's other processes, before JAX starts its backend. Alone (no
    flag, no launcher) nothing happens. Refused in one sentence: flags or --out
    missing, a process id out of range, a coordinator that cannot be reached
    within --coordinator-timeout, or its port taken on process 0's host."""
    coordinator, n, pid, launched = settings(args)
    if args.coordinator is None and n is None and pid is None:
        return
    if n is None or pid is None:
        raise cli.UsageError(
            "several processes need --num-processes and --process-id, both (or a launcher's "
            "SLURM_NTASKS and SLURM_PROCID)."
        )
    if pid >= n:
        raise cli.UsageError(
            f"--process-id {pid} is out of range for --num-processes {n}: the ids are 0 to {n - 1}."
        )
    args.num_processes, args.process_id = n, pid  # (config.json records them: process 0's)
    if n == 1:
        return
    if coordinator is None and not launched:
        raise cli.UsageError(
            "several processes need --coordinator HOST:PORT, process 0's host and a free port, "
            "the same for every process."
        )
    if args.out is None:  # (each process would name its own runs/<time>)
        raise cli.UsageError(
            "several processes train one run: give --out, the same directory for every process."
        )
    timeout = args.coordinator_timeout
    if coordinator and pid == 0:
        check_port_free(coordinator)
    elif coordinator:
        wait_for(coordinator, timeout)
    if coordinator and {"http_proxy", "https_proxy", "grpc_proxy"} & {
        k.lower() for k in os.environ
    }:
        host = _address(coordinator)[
            0
        ]  # (gRPC, which joins the processes, would go through the proxy)
        os.environ["no_grpc_proxy"] = ",".join(
            filter(None, [os.environ.get("no_grpc_proxy"), host])
        )
    native_output_to_stderr()
    # Where the others do not all join within the timeout, or one stops answering later, JAX's
    # runtime ends this process itself, with its own message.
    jax.distributed.initialize(
        coordinator,
        n,
        pid,
        initialization_timeout=int(timeout),
        heartbeat_timeout_seconds=int(timeout),
        shutdown_timeout_seconds=int(timeout),
    )


def native_output_to_stderr():
    """Gloo, the CPU collectives, prints its connections on the C library's
    stdout: send what native code prints to stderr, and keep stdout for the
    run's own lines."""
    sys.stdout.flush()
    own = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(
        os.fdopen(own, "wb"),
        encoding=sys.stdout.encoding,
        errors=sys.stdout.errors,
        line_buffering=True,
    )


def _address(coordinator):
    host, _, port = coordinator.rpartition(":")
    return host.strip("[]"), int(port)


def check_port_free(coordinator):
    """Process 0 serves the coordinator: its port must be free on this host."""
    _, port = _address(coordinator)
    try:
        with (
            socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
            if socket.has_dualstack_ipv6()
            else socket.create_server(("", port))
        ):
            pass
    except OSError:
        raise cli.UsageError(
            f"the coordinator's port {port} is in use on this host: choose another port in "
            f"--coordinator, the same for every process."
        ) from None


def wait_for(coordinator, timeout):
    """Wait until the coordinator accepts connections: process 0 may start after
    the others."""
    host, port = _address(coordinator)
    end = time.monotonic() + timeout
    while True:
        try:
            answer = http2_answer(host, port, max(0.1, min(2.0, end - time.monotonic())))
            if answer and answer[3:4] != b"\x04":  # JAX's runtime would end this process on it
                raise cli.UsageError(
                    f"{coordinator} answers, but not as the run's coordinator (gRPC) would: "
                    "another program listens on that port; check --coordinator."
                )
            return
        except OSError:
            if time.monotonic() >= end:
                raise cli.UsageError(
                    f"cannot reach the coordinator {coordinator} within {timeout:g} s "
                    f"(--coordinator-timeout): start process 0 there, or check the host and "
                    f"port."
                ) from None
            time.sleep(0.2)


def http2_answer(host, port, timeout):
    """The first 9 bytes a server at host:port answers HTTP/2's client preface
    with: a gRPC server (the coordinator) sends a frame header whose 4th byte is
    4, SETTINGS; an HTTP/1 server, "HTTP/1.1 400" or a page; b"" if none in time
    (nothing to judge it by)."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    answer = b""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(preface)
        with contextlib.suppress(OSError):
            while len(answer) < 9:
                more = s.recv(9 - len(answer))
                if not more:
                    break
                answer += more
    return answer


def several():
    return jax.process_count() > 1


def is_main():
    return jax.process_index() == 0


@functools.lru_cache(maxsize=1)  # one mesh for every step's batch
def mesh():
    """Every process's devices, process 0's first: the rows of the batch go to
    them in this order."""
    return Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))), ("data",))


def place(tree, rows):
    """Global arrays from host values that every process holds whole: split by
    rows (batch-leading) over the mesh, or replicated. Each process places only
    what its own devices hold."""
    sharding = NamedSharding(mesh(), P("data") if rows else P())

    def one(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, tree)


def distribute(params, opt_state, state):
    """With several devices (of one process or of several), data parallelism:
    the batch's rows and their memories split over the devices, the params
    replicated. Returns the three, and how to place a batch."""
    if jax.device_count() == 1:
        return params, opt_state, state, lambda batch: batch
    return (
        place(params, False),
        place(opt_state, False),
        place(state, True),
        lambda batch: place(batch, True),
    )


def gather(tree):
    """Host (numpy) values of global arrays, whole, on every process; a
    collective where rows lie on other processes, so every process calls it at
    the same point."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def _texts(text):
    """Every process's text, gathered (utf-8, at most 4096 bytes)."""
    raw = text.encode()[:4096]
    buffer = np.zeros(4098, np.uint8)
    buffer[:2], buffer[2 : 2 + len(raw)] = divmod(len(raw), 256), np.frombuffer(raw, np.uint8)
    return [
        bytes(b[2 : 2 + 256 * int(b[0]) + int(b[1])]).decode(errors="replace")
        for b in np.asarray(multihost_utils.process_allgather(buffer))
    ]


def agree(fn):
    """fn() on every process; where any process refuses (bad input), every
    process refuses, with the first refusal's sentence, instead of waiting for
    the one that left."""
    if not several():
        return fn()
    try:
        result, error = fn(), None
    except (cli.UsageError, corpora.DataError, OSError) as e:
        result, error = None, e
    said = _texts("" if error is None else str(error) or type(error).__name__)
    if error is not None:
        raise error
    for i, text in enumerate(said):
        if text:
            raise cli.UsageError(f"process {i}: {text.removeprefix('error: ')}")
    return result


def check_same(what):
    """Refuse where the processes differ in `what`, a text of their flags and
    data: they would train different runs."""
    if several():
        texts = _texts(hashlib.sha256(what.encode()).hexdigest())
        other = next((i for i, t in enumerate(texts) if t != texts[0]), None)
        if other is not None:
            raise cli.UsageError(
                f"process {other} has other flags or data than process 0: start every process "
                f"with the same flags but --process-id, on the same corpus."
            )


def any_of(flag):
    """Whether `flag` holds on any process (a Ctrl-C that reached only one of
    them)."""
    if not several():
        return bool(flag)
    return bool(np.asarray(multihost_utils.process_allgather(np.array(bool(flag)))).any())


def stop():
    """Leave the run together: the coordinator (process 0) waits for the others
    before it goes."""
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()

"""The command line of every script: one table of flags, the parsers built from it, usage
errors (one sentence, exit code 2), interrupts (one line, exit code 130) and the exit.

  p = cli.parser(__doc__)
  cli.add(p, ["run_dir", "--memory-size", "--data"], unset="the run's")   # rows of FLAGS
  return cli.run_main(p, command, argv)

A flag's name, type, default and help are written once, in FLAGS; a RunConfig
field's flag takes its type from the field (CONFIG). A script picks its flags by
name, and may give a flag another default (a script's own: finetune's --preset) or
none (unset: the run's, the preset's).
"""

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import re
import signal
import sys
import traceback
from typing import NamedTuple

import corpora
import presets


class UsageError(Exception):
    """Bad input from the user: printed as one sentence, exit code 2."""


# ----------------------------------------------------------------------------- value types
def int_at_least(low, high=None):
    """An argparse type: an integer in [low, high]."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            words = {0: "must not be negative", 1: "must be positive"}.get(
                low, f"must be at least {low}"
            )
            raise argparse.ArgumentTypeError(
                f"{words}, got {value}" if value < low else f"must be at most {high}, got {value}"
            )
        return value

    return parse


positive_int, count = int_at_least(1), int_at_least(0)


def finite_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def fraction(text):
    value = finite_float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {text}")
    return value


def path_arg(text):
    """A path, but not the empty string (an unset shell variable would pass as
    the default)."""
    if not text:
        raise argparse.ArgumentTypeError("needs a path, got an empty string")
    return text


def host_port(text):
    """HOST:PORT, the port a number from 1 to 65535 (an IPv6 host in brackets:
    [::1]:8476)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(
            f"takes HOST:PORT with a port from 1 to 65535, got {text!r}"
        )
    return text


def positive_seconds(text):
    value = finite_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text}")
    return value


def int_list(low, distinct=True):
    """An argparse type: comma-separated integers of at least `low`, e.g.
    512,2048; distinct: none twice (each names a row of a result)."""

    def parse(text):
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes comma-separated integers, got {text!r}"
            ) from None
        if min(values) < low:
            words = "positive integers" if low == 1 else f"integers of at least {low}"
            raise argparse.ArgumentTypeError(f"takes {words}, got {text!r}")
        if distinct and len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"names a value twice: {text!r}")
        return values

    return parse


def layer_list(text):
    """--memory-layers "1,3" -> (1, 3)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes comma-separated layer indices, got {text!r}"
        ) from None


# ----------------------------------------------------------------------------- the table
class Flag(NamedTuple):
    """A row of FLAGS. name: "--memory-size", "--init-from RUN_DIR" (its
    metavar) or a positional's name; type: a parser of the text, a tuple of
    choices, SWITCH or CONFIG; default; help."""

    name: str
    type: object
    default: object
    help: str


CONFIG = "the RunConfig field's"  # the type of a field's flag: from the field (config_type)
SWITCH = "true when given"  # a flag without a value: store_true
FORMATS = ("auto", "repo", "repo-deps", "text", "jsonl")

FLAGS = [
    # ------------------------------------------------------------------------- what is trained
    Flag(
        "--preset",
        tuple(sorted(presets.PRESETS)),
        "tiny",
        """named config: tiny (2-core CPU), small (one GPU), paper (Sec. 4.2), synthetic
        (the 2-layer recipe that learns the synthetic task, docs/results.md)""",
    ),
    Flag(
        "--data",
        path_arg,
        "stdlib",
        """stdlib (the running Python's standard library), synthetic (4000 generated
        documents with near and far references; synthetic:N for N), or a PATH""",
    ),
    Flag(
        "--data-format",
        FORMATS,
        "auto",
        """how to read PATH: repo = a directory per document, repo-deps = same in import
        order, text = one .txt file per document, jsonl = one {'text': ...} per line""",
    ),
    Flag(
        "--suffixes",
        str,
        None,
        """for a repository PATH, read only files ending in these, comma-separated, e.g.
        .py,.c,.h (Sec. 4.1 keeps a repository's source files); default: every file""",
    ),
    Flag(
        "--min-doc-tokens",
        count,
        0,
        "drop documents shorter than this (4096 gives the paper's C4(4K+))",
    ),
    # ------------------------------------------------------------------------- a run's files
    Flag(
        "--out",
        path_arg,
        None,
        """output directory (default runs/<timestamp>); train.py refuses one that already
        holds a run unless --resume is given""",
    ),
    Flag(
        "--resume",
        SWITCH,
        False,
        """continue the run in --out from its checkpoint, with its config, data and
        intervals (--log-every, --eval-every and --save-every may be given anew); a
        finished run with its eval.json: nothing to do, unless --steps goes further""",
    ),
    Flag(
        "--init-from RUN_DIR",
        path_arg,
        None,
        """fine-tune another run (Sec. 4.4): its weights, and its step count,
        learning-rate schedule and Adafactor statistics continue, for --steps more steps
        (a different memory size, or a run without memory: new parameters start fresh; the
        model's layers and widths must stay the run's); the data stream starts anew. Its
        config and data flags are the new run's, changed by each flag given (with
        --preset: that preset's config, as without --init-from)""",
    ),
    Flag(
        "--fresh-start",
        SWITCH,
        False,
        """fine-tune from the weights alone: the step count, the warmup and Adafactor's
        statistics start from 0 (train.py: with --init-from)""",
    ),
    Flag("--log-every", positive_int, 10, "steps between printed lines"),
    Flag("--eval-every", count, 500, "steps between evaluations (0 = only at the end)"),
    Flag("--save-every", positive_int, 100, "steps between checkpoints"),
    Flag("--eval-docs", positive_int, 4, "validation documents to evaluate"),
    Flag(
        "--eval-tokens",
        count,
        0,
        """tokens scored from each validation document's start by the final evaluation
        (eval.json) and evaluate.py; 0 = the whole document""",
    ),
    Flag(
        "--curve-tokens",
        count,
        4096,
        """the same for the evaluations every --eval-every steps, at most
        --eval-tokens (0 = as many)""",
    ),
    Flag("--valid-fraction", fraction, 0.05, "share of documents held out"),
    Flag(
        "--tokenizer",
        path_arg,
        None,
        "an existing SentencePiece .model (default: train one and cache it)",
    ),
    Flag(
        "--cache-dir",
        path_arg,
        None,  # cache_dir(): $MT_CACHE or CACHE, read when a parser is built
        """tokenizer and token cache (keyed on the corpus, the vocabulary size and
        the validation split), and in its jax/ folder the compiled programs, which a
        later run with the same config loads instead of compiling (--resume: the
        run's, if it still exists)""",
    ),
    # ------------------------------------------------------------------------- several processes
    Flag(
        "--coordinator HOST:PORT",
        host_port,
        None,
        "process 0's host and a free port, the same for every process",
    ),
    Flag("--num-processes", positive_int, None, "processes in the run"),
    Flag(
        "--process-id",
        count,
        None,
        """this process's id, 0 to --num-processes - 1; process 0 serves the coordinator
        and writes the run's files""",
    ),
    Flag(
        "--coordinator-timeout",
        positive_seconds,
        60.0,
        """seconds to wait for the coordinator and the other processes; a process that
        stops answering ends the others after as long""",
    ),
    # ------------------------------------------------------------------------- a trained run
    Flag("run_dir", path_arg, None, "a train.py output directory"),
    # ------------------------------------------------------------------- a memorized code base
    Flag("path", path_arg, None, "a directory of code, or one file, to memorize"),
    Flag(
        "file",
        path_arg,
        None,
        "the memory file to write (replaced atomically where it exists)",
    ),
    Flag(
        "--order",
        ("sorted", "deps"),
        "sorted",
        """the files' order: sorted by path, or deps (each after the files it imports, as
        --data-format repo-deps)""",
    ),
    Flag(
        "--load-memory FILE",
        path_arg,
        None,
        """start every document from this memory file (memorize.py's) instead of an empty
        memory; a document's own tokens are appended to it, FIFO""",
    ),
    Flag(
        "--score PATH",
        path_arg,
        None,
        """the files under PATH (a directory, or one file) instead of the run's validation
        set: each file whole, its own document, in sorted order""",
    ),
    Flag(
        "--json",
        path_arg,
        None,
        """write the result to this JSON file (an existing file is replaced atomically; a
        run's own files, and files in a corpus or a cache, are refused)""",
    ),
    Flag("--doc", count, 0, "document index (of the validation set, or of --score's files)"),
    Flag("--max-tokens", count, 8192, "tokens from the document's start (0 = all)"),
    Flag(
        "--memory-sizes",
        int_list(0, distinct=False),  # compare may compare a size with itself
        None,
        "comma-separated memory sizes M, multiples of T (0 = no memory)",
    ),
    Flag(
        "--band-memory",
        count,
        None,
        """the repeat bands by the reach of a memory of this many slots
        (default: the evaluated memory's), so that an XL-only run is scored on a
        memory run's far-repeat tokens""",
    ),
    Flag(
        "--csv",
        path_arg,
        None,
        """per-token output (an existing file is replaced atomically; a run's own files, and
        files in a corpus or a cache, are refused)""",
    ),
    Flag(
        "--plot",
        path_arg,
        None,
        """a PNG of delta per token (needs matplotlib) (an existing file is replaced
        atomically; a run's own files, and files in a corpus or a cache, are refused)""",
    ),
    Flag("--top", positive_int, 10, "tokens to show"),
    Flag("--memories", positive_int, 4, "memories kept per query and head"),
    Flag(
        "--html",
        path_arg,
        None,
        """the HTML file to write (an existing file is replaced atomically; a run's own
        files, and files in a corpus or a cache, are refused)""",
    ),
    Flag(
        "--distances",
        int_list(1),
        "1024,4096,16384,61440",
        "comma-separated: how many tokens back each probe's value was defined",
    ),
    Flag("--docs", positive_int, 8, "documents per distance, 8 probes each"),
    Flag("--probe-seed", count, 0, "seed of the generated probe documents"),
    Flag("--pretrain-steps", positive_int, 1500, "steps of the run trained without memory"),
    Flag(
        "--finetune-steps",
        positive_int,
        500,
        "steps of fine-tuning with memory after them",
    ),
    Flag(
        "--out-root",
        path_arg,
        None,
        """where the runs go; a run that finished at its steps is reused, an unfinished one
        resumed""",
    ),
    Flag(
        "--rows",
        str,
        None,
        """comma-separated subset of the rows (default: all): no memory, XL cache, memory
        4T, memory 4T + XL, memory 16T + XL""",
    ),
    Flag(
        "--seeds",
        positive_int,
        1,
        """train each row with seeds 0..N-1 (init and data order) and report the mean and
        standard deviation""",
    ),
    # ------------------------------------------------------------------------- generation
    Flag("--prompt", str, None, "the prompt text"),
    Flag("--prompt-file", path_arg, None, "a UTF-8 file whose whole text is the prompt"),
    Flag(
        "--prompt-doc N",
        count,
        None,
        """validation document N of the run's corpus (as evaluate.py numbers them), cut at
        --prompt-tokens""",
    ),
    Flag(
        "--prompt-tokens",
        positive_int,
        None,
        """with --prompt-doc: the first this many tokens are the prompt
        (default: the whole document)""",
    ),
    Flag("--tokens", positive_int, 100, "tokens to generate"),
    Flag("--temperature", finite_float, 1.0, "0 = greedy (argmax)"),
    Flag(
        "--top-k",
        positive_int,
        None,
        "draw only from the K most likely tokens (default: from all of them)",
    ),
    Flag("--draw-seed", int_at_least(0, 2**32 - 1), 0, "seed of the draws"),
    Flag(
        "--memory-off",
        SWITCH,
        False,
        "force every gate to 0: local attention and XL cache only, the memory-off ablation",
    ),
    Flag("--echo", SWITCH, False, "print the prompt before the continuation"),
    # ------------------------------------------------------------------------- the benchmark
    Flag(
        "--timed-steps",
        positive_int,
        5,
        "timed steps per row (median reported)",
    ),
    Flag(
        "--profile DIR",
        path_arg,
        None,
        """also trace --timed-steps steps of each row; print the XLA operations that took
        the most time and the largest arrays the step's operations write, and keep the
        trace, the HLO and the tables in DIR""",
    ),
    Flag(
        "--train-only",
        SWITCH,
        False,
        """time the train step only: no forward-pass or gradient table (three
        programs fewer to compile per row)""",
    ),
    Flag(
        "--search",
        SWITCH,
        False,
        """time the memory search alone, in its forms (the kernel's and the plain binned
        search, and the exact one), with the binned answer's recall, and its final top-k
        alone, by lax.top_k and in passes; memory size 0 is skipped""",
    ),
    Flag(
        "--memorize",
        SWITCH,
        False,
        """time memorize.py's step (tokens/s) and scoring's, batch 1, against a forward
        without memory and its arithmetic floor; memory size 0 is skipped""",
    ),
    Flag(
        "--rounds",
        count,
        0,
        """also call every row's train step in turn in one process for this many rounds,
        and give each row's median ratio to the no-memory step of the same round
        (`paired`; steadier on a shared machine than `ratio`); 0: not done""",
    ),
    Flag(
        "--compile-jobs",
        positive_int,
        1,
        """first compile every row's train step, this many rows at a time in parallel
        processes, into a JAX compilation cache that the timed rows then load from (for a
        GPU, where a paper row compiles for minutes)""",
    ),
    Flag(
        "--peer PYTHON",
        path_arg,
        None,
        """also time lucidrains' memorizing-transformers-pytorch in this Python
        (peer_benchmark.py) and give the side-by-side table; tiny preset, float32""",
    ),
    Flag(
        "--repeats",
        positive_int,
        1,
        """with --peer: both sides this many times in turn, each ratio taken within a
        repeat, the medians reported""",
    ),
    Flag("--row", int, None, "internal: measure one row in this process"),
    Flag("--compile-only", SWITCH, False, "internal: compile --row's step"),
    Flag("--alternate", SWITCH, False, "internal: --rounds in this process"),
]


# --cache-dir's default, wherever a script is run from: .cache beside the scripts
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")


def cache_dir():
    """--cache-dir's default: $MT_CACHE, or CACHE."""
    return os.environ.get("MT_CACHE") or CACHE


def config_type(field):
    """The argparse type of a RunConfig field's flag: the text read as the
    field's type, then held to the field's rule, whose sentence is the error."""
    rule = field.metadata["rule"]
    if field.type is bool:
        return argparse.BooleanOptionalAction
    if rule.choices:
        return tuple(c for c in rule.choices if c is not None)
    read, kind = {int: (int, "an integer"), float: (float, "a number"),
                  tuple: (layer_list, "layer indices")}[field.type]

    def parse(text):
        try:
            value = read(text)
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        problem = rule(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(presets.RunConfig)}
# Every field of RunConfig is a flag, its help the field's: a new field needs no row here.
CONFIG_FLAGS = ["--" + name.replace("_", "-") for name in CONFIG_FIELDS]
FLAGS += [Flag(flag, CONFIG, None, f.metadata["help"]) for flag, f in
          zip(CONFIG_FLAGS, CONFIG_FIELDS.values())]
BY_NAME = {f.name.split()[0]: f for f in FLAGS}
assert len(BY_NAME) == len(FLAGS), "a flag is defined twice"


# ----------------------------------------------------------------------------- parsers
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except where the help says it or there
    is none (None)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, with a bad flag in one line on stderr, and `-1e3` read as a
    number, not a flag (Python 3.11's argparse knows only -3 and -.5; no flag of
    ours starts with "-" and a digit)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)
        self._negative_number_matcher = re.compile(r"-\.?\d")

    def error(self, message):
        self.exit(2, f"error: {message} (see --help).\n")


def parser(description, **kwargs):
    """A script's parser: its description is the docstring's first paragraph."""
    return Parser(description=description.split("\n\n")[0], **kwargs)


def add(target, names, defaults=None, unset=None, required=False, helps=None):
    """Add the FLAGS rows `names` to a parser (or group, or subparser).
    defaults: {name: value}, a script's own default of a flag; unset: each of
    these flags defaults to None, which means `unset` ("the run's": the run's
    value), said in its help; required: each must be given; helps: {name: text},
    a script's own help of a flag."""
    for name in names:
        row = BY_NAME[name]
        flag, *metavar = row.name.split()
        kind, default, text = row.type, row.default, (helps or {}).get(name, row.help)
        text = " ".join(text.split())
        if flag == "--cache-dir":
            default = cache_dir()
        if defaults and name in defaults:
            default = defaults[name]
        if unset:
            default, text = None, f"{text} (default: {unset})"
        options = {"help": argparse.SUPPRESS if text.startswith("internal:") else text}
        if kind == CONFIG:
            kind = config_type(CONFIG_FIELDS[flag[2:].replace("-", "_")])
        if kind == SWITCH:
            options.update(action="store_true", default=default)
        elif kind is argparse.BooleanOptionalAction:
            options.update(action=kind, default=default)
        elif isinstance(kind, tuple):
            options.update(choices=kind, default=default)
        else:
            options.update(type=kind, default=default)
        if metavar:
            options["metavar"] = metavar[0]
        if required:
            options["required"] = True
        target.add_argument(flag, **options)


def config_from_args(args, base, base_name):
    """`base` (a RunConfig, named `base_name` in messages) with every config
    flag that was set."""
    changes = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS and v is not None}
    n = changes.get("num_layers", base.num_layers)
    if "memory_layers" not in changes and any(layer >= n for layer in base.memory_layers):
        raise UsageError(
            f"{base_name}'s memory layer {max(base.memory_layers)} is out of range for "
            f"--num-layers {n}; give --memory-layers too, a 0-based index below {n} (the "
            "paper's is near the top: 8 of 12)."
        )
    try:
        return base.replace(**changes)
    except ValueError as e:
        raise UsageError(str(e)) from None


def given_flags(build, argv):
    """The flags that argv gives to the parser build() makes, by their names in
    args: parsed, a flag left out and one given at its default value look alike.
    """
    blank = build()
    blank.set_defaults(**dict.fromkeys(vars(blank.parse_args([])), None))
    return {name for name, value in vars(blank.parse_args(argv)).items() if value is not None}


# ----------------------------------------------------------------------------- signals
@contextlib.contextmanager
def interrupt_flag():
    """Ctrl-C and SIGTERM set flag["signal"] instead of stopping: the
    training loop saves and exits."""
    flag = {"signal": None}
    old = {
        s: signal.signal(s, lambda signum, _: flag.update(signal=signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def dropped_interrupts_raised_again(delay=0.01):
    """Deliver again the Ctrl-Cs that Python and JAX drop. A KeyboardInterrupt
    raised in a garbage collection callback or a __del__ (JAX runs one at every
    collection) is printed and dropped by Python: here SIGALRM delivers it again
    `delay` seconds later, to what SIGINT does then. JAX starts its plugins
    under a bare `except:` and logs what they raise: such a record is raised
    again from the logging call (_raise_logged_interrupt). Without setitimer
    (Windows): neither."""

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            signal.setitimer(signal.ITIMER_REAL, delay)
        else:
            previous_hook(unraisable)

    def again(_, frame):
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):
            raise KeyboardInterrupt
        handler(signal.SIGINT, frame)

    jax_log = logging.getLogger("jax._src.xla_bridge")
    jax_log.addFilter(_raise_logged_interrupt)
    alarm = hasattr(signal, "setitimer")
    if alarm:
        previous_hook, previous_alarm = sys.unraisablehook, signal.signal(signal.SIGALRM, again)
        sys.unraisablehook = hook
    try:
        yield
    finally:
        jax_log.removeFilter(_raise_logged_interrupt)
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_alarm)
            sys.unraisablehook = previous_hook


def _raise_logged_interrupt(record):
    """A logging filter: a KeyboardInterrupt that logging caught is raised
    again, not printed."""
    if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
        raise record.exc_info[1]
    return True


# ----------------------------------------------------------------------------- running a command
def _backend_failed(e):
    """Whether e was raised where JAX starts its backend (a JAX_PLATFORMS that
    cannot start)."""
    frames = traceback.extract_tb(e.__traceback__)
    return any(
        f.filename.endswith(os.path.join("jax", "_src", "xla_bridge.py")) for f in frames[-3:]
    )


def _out_of_memory(e):
    """Whether e is the host or the device running out of memory."""
    return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)


def run_command(command, args):
    """Run a command the way every script here does: bad input (flags,
    files, data) is one sentence on stderr and exit code 2; Ctrl-C or
    SIGTERM is one line and exit code 130."""
    old = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with dropped_interrupts_raised_again():
            return command(args)
    except (UsageError, corpora.DataError) as e:
        say(f"error: {e}")
        return 2
    except BrokenPipeError:  # stdout's reader stopped reading (`| head`): stop as shell tools do
        return _stdout_gone()
    except OSError as e:  # a file the checks did not foresee: say which, and why
        say(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename is not None else ""))
        return 2
    except (MemoryError, RuntimeError, AssertionError) as e:  # (JaxRuntimeError: a RuntimeError)
        if _out_of_memory(e):
            say(
                "error: the device ran out of memory; lower --batch-size, --segment-length or "
                "--memory-size."
            )
        elif _backend_failed(e):
            say(
                "error: JAX could not start its backend "
                f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}): "
                f"{' '.join(str(e).split()) or 'no backend'}; unset JAX_PLATFORMS to let JAX "
                "choose one, or see the README's 'On a GPU'."
            )
        else:
            raise
        return 2
    except KeyboardInterrupt:
        say("interrupted; no file was left half-written.")
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def say(line):
    """One line on stderr (an error or a note), where nothing fails if stderr is
    closed or broken."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        print(line, file=sys.stderr, flush=True)


def run_main(parser, command, argv):
    """A script's main(): parse argv (--help, or a bad flag in one line, end
    here with 0 or 2), then run_command."""
    for name in ("stdout", "stderr"):  # started with a stream closed (`>&-`): Python has None there
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))
    if sys.stdout is sys.__stdout__ and getattr(sys.stdout, "errors", None) == "strict":
        sys.stdout.reconfigure(errors="surrogateescape")  # a path that is not UTF-8: its bytes
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code
    # XLA reads XLA_FLAGS when it starts, and a word that is no flag ends the process there.
    words = os.environ.get("XLA_FLAGS", "").split()
    bad = [w for w in words if not re.fullmatch(r"--[A-Za-z0-9_]+(=\S*)?", w)]
    if bad:
        say(
            f"error: XLA_FLAGS holds {bad[0]!r}, which is not an XLA flag (--name or --name=value)."
        )
        return 2
    return run_command(command, args)


def _stdout_gone():
    """Point stdout at /dev/null, so that nothing more fails on it; the exit
    code of SIGPIPE."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a file (a test's capture), or closed
        pass
    return 141


def exit_with(code):
    """Leave with `code` at once, once stdout and stderr are flushed: without
    the interpreter's teardown, which can crash while JAX's threads still run
    (after an interrupt), and during which a signal would kill the process
    without a word."""

    def interrupted(*_):
        os.write(2, b"interrupted; no file was left half-written.\n")
        os._exit(130)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, interrupted)
    try:
        if sys.stdout is not None:  # (None: started with stdout closed)
            sys.stdout.flush()
    except BrokenPipeError:
        gone = _stdout_gone()
        code = code or gone  # a failure keeps its own code
    except (OSError, ValueError):  # a stdout that cannot take what is left: the code stands
        pass
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.flush()
    os._exit(code or 0)

"""The commands the documentation shows are commands the scripts take.

Every `python SCRIPT.py ...` in README.md and docs/ (code blocks and inline code) and in the
scripts' own usage lines is read here without being run: each flag it names must be one of
that script's (or that evaluate.py command's) flags, spelled out in full, and a command
without alternatives (`|`) or elisions (`...`) must parse as a whole, with its placeholders
(RUN_DIR, M, FILE, ...) read as a value. And the files a newcomer reads first stay short and plain.
"""

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess

import pytest

import benchmark
import evaluate
import memorize
import sample
import train

HERE = os.path.dirname(os.path.abspath(__file__))
PARSERS = {
    "train.py": train.build_parser,
    "evaluate.py": evaluate.build_parser,
    "sample.py": sample.build_parser,
    "benchmark.py": benchmark.build_parser,
    "memorize.py": memorize.build_parser,
}
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*\b")  # RUN_DIR, PATH, M, A,B, FILE(.png)


def readme_commands(text):
    """Every `python X.py ...` of a Markdown text: (line number, command after `python `)."""
    found = []
    fenced = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    for block in fenced.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        for i, line in enumerate(block.group(1).splitlines()):
            found += [(first + i, c) for c in commands_in(line)]
    rest = fenced.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # keep the line numbers
    for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", rest):
        found += [
            (rest.count("\n", 0, span.start()) + 1, c)
            for c in commands_in(span.group(1).replace("\n", " "))
        ]
    return found


def commands_in(line):
    """The commands in one line of shell: after `python `, up to a `&&`, a `;` or a comment."""
    return [
        re.split(r"&&|;|\s#", m.group(1))[0].strip()
        for m in re.finditer(r"(?<![\w/.-])python3? ((?:[a-z_]+)\.py\b.*)", line)
    ]


def usage_commands(script):
    """The usage lines of a script's docstring."""
    with open(os.path.join(HERE, script), encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return [(script, c) for line in doc.splitlines() for c in commands_in(line)]


def options(parser):
    return set(parser._option_string_actions)


def subcommands(parser):
    return next(a.choices for a in parser._actions if a.choices and isinstance(a.choices, dict))


def check_command(command):
    """None if `command` (after `python `) names only flags its script takes, else why not."""
    script, _, rest = command.partition(" ")
    if script not in PARSERS:
        return f"{script} is not one of the scripts"
    parser = PARSERS[script]()
    words = rest.replace("[", " ").replace("]", " ").split()
    name, known = script, options(parser)
    if script == "evaluate.py" and words and not words[0].startswith("-"):
        if words[0] not in subcommands(parser):
            return f"evaluate.py has no command {words[0]!r}"
        name, known = f"{script} {words[0]}", options(subcommands(parser)[words[0]])
    unknown = [
        w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in known
    ]
    if unknown:
        return f"{name} has no flag {', '.join(unknown)}"
    if "|" in rest or "..." in rest or "…" in rest or "-h" in words or "--help" in words:
        return None  # alternatives, elisions or help: the flags' names are all there is to check
    argv = shlex.split(PLACEHOLDER.sub("1", rest.replace("[", " ").replace("]", " ")))
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            parser.parse_args(argv)
    except SystemExit:
        return f"{script} refuses {' '.join(argv)!r}: {said.getvalue().strip()}"
    return None


PAGES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(HERE, "docs")) if f.endswith(".md")
)


def test_the_readme_shows_commands_and_finds_them_all():
    """The README shows every script; with the pages of docs/, the reader finds them all."""
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        found = readme_commands(f.read())
    scripts = {c.split()[0] for _, c in found}
    assert set(PARSERS) <= scripts, f"the README never shows {set(PARSERS) - scripts}"
    for page in PAGES[1:]:
        with open(os.path.join(HERE, page), encoding="utf-8") as f:
            found += readme_commands(f.read())
    assert len(found) >= 40
    # Both kinds of place, and a command whose inline code runs over a line break.
    text = (
        "a\n```\n$ python train.py --steps 3  # x\npip install -r r.txt && python sample.py R "
        "--prompt x\n```\n"
        "b `python evaluate.py reach RUN [--distances\n64]` c `train.py` d\n"
    )
    assert readme_commands(text) == [
        (3, "train.py --steps 3"),
        (4, "sample.py R --prompt x"),
        (6, "evaluate.py reach RUN [--distances 64]"),
    ]


@pytest.mark.parametrize("source", PAGES + sorted(PARSERS))
def test_every_command_the_documentation_shows_names_flags_the_script_takes(source):
    if source.endswith(".md"):
        with open(os.path.join(HERE, source), encoding="utf-8") as f:
            found = [(f"{source}:{n}", c) for n, c in readme_commands(f.read())]
    else:
        found = usage_commands(source)
        assert found, f"{source}'s docstring shows no usage"
    wrong = [f"{where}: python {c}: {why}" for where, c in found if (why := check_command(c))]
    assert not wrong, "\n".join(wrong)


def test_a_wrong_flag_an_unknown_command_or_a_bad_value_is_caught():
    assert check_command("train.py --steps 10 --memory-size 2048") is None
    assert check_command("evaluate.py perplexity RUN_DIR [--memory-size M] [--json FILE]") is None
    assert check_command("sample.py RUN --prompt TEXT | --prompt-file F [--tokens N]") is None
    assert "--memory-sizes" in check_command("train.py --memory-sizes 64")
    assert "--mem" in check_command("train.py --mem 64")  # an abbreviation that argparse would take
    assert "--plot" in check_command(
        "evaluate.py perplexity RUN --plot F"
    )  # compare's flag, not perplexity's
    assert "'perplexty'" in check_command("evaluate.py perplexty RUN")
    assert "refuses" in check_command("train.py --preset huge")
    assert "refuses" in check_command("sample.py RUN --prompt x --prompt-doc 0")  # two of one group
    assert "refuses" in check_command("benchmark.py --timed-steps 0")
    assert "refuses" in check_command(
        "evaluate.py compare RUN_DIR --doc 1"
    )  # --memory-sizes and --csv are required
    assert "nothing.py" in check_command("nothing.py --x")


def test_the_reading_path_stays_plain():
    """The model file is the paper in plain jax.numpy, in at most 640 lines with no docstring over
    6; the faster forms live in kernels.py. train.py is at most 500 lines, conftest.py at most 80;
    startup.py alone manages the C heap. The README guides in at most 250 lines and 2,500 words,
    its prose in lines of at most 100 characters (tables and code blocks aside)."""

    def read(name):
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            return f.read()

    model = read("memorizing_transformer.py")
    assert model.count("\n") <= 640
    assert read("train.py").count("\n") <= 500
    readme = read("README.md")
    assert readme.count("\n") <= 250
    assert len(readme.split()) <= 2500
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.S | re.M)
    wide = [line for line in prose.splitlines() if len(line) > 100 and line[:1] != "|"]
    assert not wide, wide
    assert read("conftest.py").count("\n") <= 80
    assert not re.findall(r"custom_vjp|default_backend|bitcast", model)
    long = [
        (getattr(node, "name", "the module"), node.body[0].end_lineno - node.body[0].lineno + 1)
        for node in ast.walk(ast.parse(model))
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and ast.get_docstring(node) is not None
    ]
    assert all(n <= 6 for _, n in long), [x for x in long if x[1] > 6]
    scripts = [f for f in sorted(os.listdir(HERE)) if f.endswith(".py") and f[:5] != "test_"]
    heap = [f for f in scripts if re.search(r"\b(mallopt|malloc_trim)\(", read(f))]
    assert heap == ["startup.py"]


def test_no_python_line_is_wider_than_100_characters():
    """Width, not count: every .py file, tests included, one operation a line."""
    wide = []
    for name in sorted(os.listdir(HERE)):
        if name.endswith(".py"):
            for number, line in enumerate(read_lines(name), 1):
                if len(line.rstrip("\n")) > 100:
                    wide.append(f"{name}:{number}")
    assert not wide, wide


def read_lines(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.readlines()


def test_no_module_imports_itself_through_others():
    """The modules' imports, at the top or inside a function, form no circle."""
    modules = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py") and f[:5] != "test_"}
    imports = {}
    for name in modules:
        with open(os.path.join(HERE, name + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        named = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                named.add(node.module)
        imports[name] = named & modules
    assert imports["runs"] and imports["train"], imports  # the parse sees imports

    def circle(path):
        for other in sorted(imports[path[-1]]):
            if other in path:
                return path[path.index(other) :] + [other]
            found = circle(path + [other])
            if found:
                return found
        return None

    circles = [c for c in (circle([name]) for name in sorted(modules)) if c]
    assert not circles, " -> ".join(circles[0])


MEMORIZE_EXAMPLES = {
    # The code example of the README's "Memorize a code base" on runs/stdlib.
    "code": ("README.md", "numpy.linalg", "runs/stdlib"),
    # The bindings of docs/memorize.md's "The mechanism, on the synthetic task".
    "synthetic": (
        os.path.join("docs", "memorize.md"),
        "write_synthetic_halves",
        "runs/synthetic/memory",
    ),
}


@pytest.mark.parametrize("example", sorted(MEMORIZE_EXAMPLES))
def test_a_memorize_example_runs_as_the_documentation_writes_it(
    example, finished_run, tmp_path, monkeypatch, capsys
):
    """The commands of a memorize example, line by line, in a fresh directory, on the
    command-line tests' finished synthetic run in place of the run it names (its 2 steps answer
    nothing: the commands are what is checked)."""
    from test_cli import SCRIPTS

    page, marker, run = MEMORIZE_EXAMPLES[example]
    with open(os.path.join(HERE, page), encoding="utf-8") as f:
        text = f.read()
    pattern = rf"```\n(python -c [^\n]*{re.escape(marker)}.*?)```"
    block = re.search(pattern, text, re.S).group(1)
    os.makedirs(tmp_path / os.path.dirname(run))
    os.symlink(finished_run, tmp_path / run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(HERE)
    for line in block.splitlines():
        words = shlex.split(line)
        if words[:2] == ["python", "-c"]:
            exec(words[2], {})
        elif words[0] == "python":
            assert SCRIPTS[words[1][:-3]](words[2:]) == 0, (line, capsys.readouterr())
        else:  # a shell line
            assert subprocess.run(["bash", "-c", line]).returncode == 0, line
    said = capsys.readouterr()
    out = said.out + said.err
    if example == "synthetic":
        assert "memorized tokens: loss" in out and os.path.getsize("halves.csv") > 0, out
    else:
        # Two modules memorized, and the sample ran on the file's slots, not the run's own M.
        slots = re.search(r"memorized 2 files, \d+ tokens into (\d+) slots", out)
        assert slots and f"generated, memory {slots.group(1)})" in out, out

# SPDX-License-Identifier: Apache-2.0
"""Comments say why, briefly: module docstrings of the library of at most 8 lines, and no measured figures or machine
names in the comments and docstrings of shmcomm/ and csrc/ (results belong in benchmarks/). The cost model
(shmcomm/sim/) speaks in bandwidths and latencies by design and is left out of the figures check."""
import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shmcomm"
MACHINE_NAMES = re.compile(r"\b(EPYC|Xeon|KVM|this VM)\b")
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ns|us|µs|ms|[KMGT]i?B/s|steps/s)\b|\b\d+(?:\.\d+)?x(?![\w])")
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)


def _docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield text


def _python_comments(source):
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.string


def _prose():
    """(file, text) for every comment and docstring of the library and the C core."""
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for text in list(_docstrings(ast.parse(source))) + list(_python_comments(source)):
            yield path, text
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix in (".c", ".h", ".cu", ".cuh"):
            for text in C_COMMENT.findall(path.read_text()):
                yield path, text


def _findings(pattern, skip=()):
    found = set()
    for path, text in _prose():
        if not any(part in skip for part in path.relative_to(ROOT).parts):
            found.update("%s: %s" % (path.relative_to(ROOT), hit.group(0)) for hit in pattern.finditer(text))
    return sorted(found)


def test_module_docstrings_are_at_most_8_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(text.splitlines()) > 8:
            long.append("%s: %d lines" % (path.relative_to(ROOT), len(text.splitlines())))
    assert long == []


def test_no_machine_names_in_comments():
    assert _findings(MACHINE_NAMES) == []


def test_no_measured_figures_in_comments():
    assert _findings(FIGURE, skip={"sim"}) == []


def test_the_checks_find_what_they_look_for():
    """The patterns themselves: a figure, a ratio and a machine name are found; sizes and counts are not."""
    assert FIGURE.findall("took 0.32 ms, 1.5x faster, 40 GB/s, 12 us") == ["0.32 ms", "1.5x", "40 GB/s", "12 us"]
    assert FIGURE.findall("pieces of 256 KiB, 2 ranks, a 4x4 grid, 0x10, SMC_MAX") == []
    assert MACHINE_NAMES.findall("on an AMD EPYC, then a Xeon") == ["EPYC", "Xeon"]

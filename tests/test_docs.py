# SPDX-License-Identifier: Apache-2.0
"""The documentation: the site builds strictly, every Python snippet of the README and the docs runs as written on
two ranks, and every public name has a docstring that names its arguments, result and exceptions."""
import glob
import inspect
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def test_the_site_builds_strictly(tmp_path):
    """mkdocs --strict fails on a broken link, a page missing from the navigation, or an API entry it cannot
    resolve; the launcher's flags are written into the launching page from its parser (docs/hooks.py)."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    launching = (tmp_path / "site" / "launching" / "index.html").read_text()
    assert "--fusion-threshold-mb" in launching and "--kill-grace-seconds" in launching


def _snippets():
    """Each page's python code blocks, each a whole program, with the API it needs; those that import torch or jax
    (two heavy processes each) run in the second tier."""
    snippets = []
    for page in PAGES:
        with open(page) as f:
            blocks = f.read().split("```python\n")[1:]
        for number, block in enumerate(blocks):
            source = block.split("```", 1)[0]
            needs = next((module for module in ("torch", "jax") if f"import {module}" in source), None)
            name = os.path.relpath(page, ROOT).replace(os.sep, "/")
            snippets.append(pytest.param(source, needs, id=f"{name}-{number}-{needs or 'numpy'}",
                                         marks=[pytest.mark.long] if needs else []))
    return snippets


@pytest.mark.parametrize("source,needs", _snippets())
def test_every_snippet_runs_as_written_on_two_ranks(tmp_path, source, needs):
    if needs:
        pytest.importorskip(needs)
    program = tmp_path / "snippet.py"
    program.write_text(source)
    run = subprocess.run([sys.executable, "-m", "shmcomm.runner", "-np", "2", sys.executable, str(program)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, source + run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def _public(module_name):
    import importlib

    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    for name in names:
        thing = getattr(module, name)
        if inspect.ismodule(thing) or not (inspect.isclass(thing) or callable(thing)):
            continue
        yield "%s.%s" % (module_name, name), thing
        if inspect.isclass(thing) and not issubclass(thing, BaseException):
            for member, value in vars(thing).items():
                if member.startswith("_") or not (callable(value) or isinstance(value, property)):
                    continue
                yield "%s.%s.%s" % (module_name, name, member), value


@pytest.mark.parametrize("module_name", ["shmcomm", "shmcomm.torch", "shmcomm.jax"])
def test_every_public_name_has_a_docstring(module_name):
    pytest.importorskip(module_name.split(".")[-1] if module_name != "shmcomm" else "numpy")
    missing = []
    for name, thing in _public(module_name):
        own = thing.__dict__.get("__doc__") if inspect.isclass(thing) else getattr(thing, "__doc__", None)
        if not (own or "").strip():
            missing.append(name)
    assert not missing, "no docstring: " + ", ".join(missing)


_SECTIONS = ("Args:", "Returns:", "Raises:", "Example:", "Examples:", "Yields:", "Attributes:")


def _section(doc, title):
    """The text of a Google-style section of `doc` (empty when it has none)."""
    lines, inside = [], False
    for line in doc.splitlines():
        if line.strip() in _SECTIONS and not line.startswith(" "):
            inside = line.strip() == title
        elif inside:
            lines.append(line)
    return "\n".join(lines)


def _returns_a_value(function):
    """Whether `function`'s own body returns something other than None."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError):
        return False
    body = tree.body[0]
    nested = {id(n) for f in ast.walk(body) if f is not body and isinstance(f, (ast.FunctionDef, ast.Lambda,
                                                                                 ast.AsyncFunctionDef, ast.ClassDef))
              for n in ast.walk(f)}
    return any(isinstance(n, ast.Return) and n.value is not None and id(n) not in nested
               and not (isinstance(n.value, ast.Constant) and n.value.value is None) for n in ast.walk(body))


def _shortfalls(name, thing):
    """What a public function's or class's docstring gets wrong: an Args section naming every parameter and nothing
    else (an entry may name several: "op, name: as allreduce()."), a Returns section for a function that returns a
    value, and an exception's name at the start of each Raises entry."""
    if inspect.isclass(thing) and issubclass(thing, BaseException):
        return []
    function = thing.__init__ if inspect.isclass(thing) else thing
    if isinstance(thing, property) or not inspect.isfunction(getattr(function, "__func__", function)):
        return []
    doc = inspect.getdoc(thing) or ""
    if inspect.isclass(thing):
        doc += "\n" + (function.__doc__ and inspect.cleandoc(function.__doc__) or "")
    parameters = [p.name for p in inspect.signature(function).parameters.values()
                  if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    described = _section(doc, "Args:")
    found = []
    missing = [p for p in parameters if not re.search(r"(?<![\w.])%s(?!\w)" % re.escape(p), described)]
    if missing:
        found.append("%s: Args leaves out %s" % (name, ", ".join(missing)))
    named = [n for line in described.splitlines() if re.match(r"    [\w*]", line) and ":" in line
             for n in line.split(":", 1)[0].replace("*", "").split(", ")]
    unknown = [n.strip() for n in named if n.strip() not in parameters]
    if unknown and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                           for p in inspect.signature(function).parameters.values()):
        found.append("%s: Args names what is no parameter: %s" % (name, ", ".join(unknown)))
    if not inspect.isclass(thing) and _returns_a_value(function) and not _section(doc, "Returns:").strip():
        found.append("%s: no Returns section" % name)
    found += ["%s: a Raises entry that names no exception (the site would drop it): %s" % (name, line.strip())
              for line in _section(doc, "Raises:").splitlines()
              if line.strip() and not line.startswith("        ") and not re.match(r"    [A-Z]\w*(, [A-Z]\w*)*: ", line)]
    return found


@pytest.mark.parametrize("module_name", ["shmcomm", "shmcomm.torch", "shmcomm.jax"])
def test_every_public_function_describes_its_arguments_and_result(module_name):
    pytest.importorskip(module_name.split(".")[-1] if module_name != "shmcomm" else "numpy")
    found = [line for name, thing in _public(module_name) for line in _shortfalls(name, thing)]
    assert not found, "\n".join(found)


def test_the_docstring_check_finds_what_is_left_out():
    def complete(tensor, root_rank, name=None):
        """Does it.

        Args:
            tensor: the data.
            root_rank, name: as broadcast().

        Returns:
            The data.

        Raises:
            InvalidArgumentError: a bad root; TimeoutError: a late rank.
        """
        return tensor

    def lacking(tensor, root_rank):
        """Does it.

        Args:
            tensor: the data.
            rot_rank: misspelt.

        Raises:
            As broadcast().
        """
        return tensor

    assert _shortfalls("complete", complete) == []
    assert _shortfalls("lacking", lacking) == [
        "lacking: Args leaves out root_rank", "lacking: Args names what is no parameter: rot_rank",
        "lacking: no Returns section",
        "lacking: a Raises entry that names no exception (the site would drop it): As broadcast()."]


def test_the_architecture_follows_one_call_from_each_api_in_ten_lines():
    """docs/architecture.md walks one call from each API down to the wire, each in at most 10 lines."""
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        text = f.read()
    section = text.split("## One call from each API", 1)[1].split("\n## ", 1)[0]
    walks = {m.group(1): m.group(2).strip().splitlines() for m in
             re.finditer(r"\*\*([^*]+)\*\*(.*?)(?=\n\*\*|\Z)", section, re.S)}
    assert sorted(walks) == ["JAX", "Soft Memory Box", "numpy", "torch (DDP)", "torch (Horovod's API)"]
    assert {api: len(lines) for api, lines in walks.items() if len(lines) > 10} == {}

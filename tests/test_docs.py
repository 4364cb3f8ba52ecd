# SPDX-License-Identifier: Apache-2.0
"""The documentation: the site builds strictly, every Python snippet of the README and the docs runs as written on
two ranks, and every public name has a docstring."""
import glob
import inspect
import os
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

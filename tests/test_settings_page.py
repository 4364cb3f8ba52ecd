# SPDX-License-Identifier: Apache-2.0
"""docs/settings.md and the settings the code reads agree: every SHMCOMM_ name read in shmcomm/env/ stands in exactly
one of the page's lists (the settings a job may set, at most 30; Horovod's names that map onto them; those that force
a path for tests and benchmarks; those the launchers set), the page names no setting that nothing reads, and the
defaults it gives a job's settings are the ones the code takes."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = ("Settings a job may set", "Horovod's names that map onto these", "For tests and benchmarks",
            "Set by the launchers")


def _read_by_the_code():
    names = set()
    for path in (ROOT / "shmcomm" / "env").glob("*.py"):
        text = path.read_text()
        readers = r"(?<![.\w])(?:_get|_number|_flag|switch|is_set|get|number|flag)\(\"([A-Z][A-Z0-9_]+)\""
        names |= set(re.findall(readers, text))
        names |= set(re.findall(r"\"SHMCOMM_([A-Z][A-Z0-9_]+)\"", text))
        for group in re.findall(r"PATH_SETTINGS = \(([^)]*)\)", text):
            names |= set(re.findall(r"\"([A-Z][A-Z0-9_]+)\"", group))
    return names


def _page():
    """{section: [names in its tables' first column, or in its text where it has no table]}."""
    text = (ROOT / "docs" / "settings.md").read_text()
    found = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        rows = [line.split("|")[1] for line in body.splitlines() if line.startswith("| `")]
        found[title.strip()] = re.findall(r"`SHMCOMM_([A-Z][A-Z0-9_]+)`", " ".join(rows) if rows else body)
    return found


def test_every_setting_read_is_on_the_page_once_and_a_job_has_at_most_30():
    page = _page()
    assert tuple(page) == SECTIONS
    listed = [name for section in SECTIONS for name in page[section]]
    assert sorted(set(listed)) == sorted(listed), "a name in two places"
    assert set(listed) == _read_by_the_code()
    assert len(page["Settings a job may set"]) <= 30


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _documented_default(text):
    """The page's default as a value: a number (with a unit: 64 MiB), None for `unset`, else the text itself."""
    text = text.strip().strip("`")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(?: ([KMG]iB))?", text)
    if match:
        number = float(match.group(1)) * _UNITS.get(match.group(2), 1)
        return int(number) if number.is_integer() else number
    return None if text == "unset" else text


def _defaults_in_code(monkeypatch):
    """{name: default} of the numbers and yes/no settings shmcomm/env/ reads, with none of them set: each reader
    records the default it is given."""
    import importlib
    import inspect

    import shmcomm.env as env
    from shmcomm.env import values

    tuning = importlib.import_module("shmcomm.env.tuning")  # shmcomm.env.tuning is also a function's name

    seen = {}

    def recording(reader):
        unset = inspect.signature(reader).parameters["default"].default

        def read(name, *args, **kwargs):
            seen.setdefault(name, args[0] if args else kwargs.get("default", unset))
            return reader(name, *args, **kwargs)
        return read

    for module in (env, tuning):
        for attr in ("_number", "_flag"):
            monkeypatch.setattr(module, attr, recording(getattr(module, attr)))
    with values.reading_from({}):
        env.validate()
        tuning.tuning(2), tuning.thread_affinity(0), env.paths(4), env.grid(4)
        for module in (env, tuning):
            for name, function in vars(module).items():
                if inspect.isfunction(function) and not name.startswith("_") and function.__module__ == module.__name__:
                    if all(p.default is not p.empty for p in inspect.signature(function).parameters.values()):
                        function()
    return seen


def test_every_documented_default_is_the_one_the_code_takes(monkeypatch):
    """The default column of the settings a job may set, against what the code reads with nothing set (the numbers
    and yes/no settings; the others' defaults are words)."""
    text = (ROOT / "docs" / "settings.md").read_text()
    section = text.split("## Settings a job may set", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.split("|")[1:3]] for line in section.splitlines() if line.startswith("| `")]
    code = _defaults_in_code(monkeypatch)
    compared, wrong = 0, []
    for name_cell, default_cell in rows:
        name = name_cell.strip("`")[len("SHMCOMM_"):]
        documented = _documented_default(default_cell)
        if name in code and (documented is None or isinstance(documented, (int, float))):
            compared += 1
            taken = code[name]
            if not (documented == taken or (isinstance(taken, bool) and documented == int(taken))):
                wrong.append("%s: the page says %s, the code takes %r" % (name, default_cell, taken))
    assert not wrong, "\n".join(wrong)
    assert compared >= 15, compared

# SPDX-License-Identifier: Apache-2.0
"""docs/settings.md and the settings the code reads agree: every SHMCOMM_ name read in shmcomm/env/ stands in exactly
one of the page's lists (the settings a job may set, at most 30; Horovod's names that map onto them; those that force
a path for tests and benchmarks; those the launchers set), and the page names no setting that nothing reads."""
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

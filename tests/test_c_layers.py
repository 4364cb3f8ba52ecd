# SPDX-License-Identifier: Apache-2.0
"""The C core's layers, checked from the source: core -> reduce -> shm -> coll -> net / mpi / py / jax. A file
includes and calls only its own folder and the layers below it (the four at the top not one another), include/ is
the public header every layer may read, and no files call one another in a loop."""
import pathlib
import re

from test_architecture import _cycles

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
LAYERS = {"core": 0, "reduce": 1, "shm": 2, "coll": 3, "net": 4, "mpi": 4, "py": 4, "jax": 4}
# A definition at the start of a line: type words, the name, the parameters, the body's brace.
_DEFINITION = re.compile(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)
_CALL = re.compile(r"\b(\w+)\s*\(")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _code(text):
    """The text without comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def _allowed(source_folder, target_folder):
    return target_folder == source_folder or target_folder == "include" or (
        target_folder in LAYERS and LAYERS[target_folder] < LAYERS[source_folder])


def breaches(files):
    """{path relative to csrc: text} -> what goes up or sideways a layer, and loops of files calling one another."""
    found = []
    definitions = {}
    for path, text in files.items():
        for name in _DEFINITION.findall(_code(text)):
            definitions.setdefault(name, path)
    calls = {path: set() for path in files}
    for path, text in sorted(files.items()):
        folder = path.split("/")[0]
        if folder not in LAYERS:
            continue
        for target in _INCLUDE.findall(text):
            target_folder = target.split("/")[0] if "/" in target else folder
            if target_folder in LAYERS and not _allowed(folder, target_folder):  # else the public header, or XLA's
                found.append("%s includes %s" % (path, target))
        for name in sorted(set(_CALL.findall(_code(text)))):
            home = definitions.get(name)
            if home is None or home == path:
                continue
            calls[path].add(home)
            if not _allowed(folder, home.split("/")[0]):
                found.append("%s calls %s of %s" % (path, name, home))
    found += ["a loop: " + " -> ".join(loop) for loop in _cycles(calls)]
    return found


def _sources():
    return {str(p.relative_to(CSRC)): p.read_text() for p in sorted(CSRC.rglob("*")) if p.suffix in (".c", ".h")}


def test_no_c_include_or_call_goes_up_a_layer_and_no_files_call_in_a_loop():
    files = _sources()
    assert {path.split("/")[0] for path in files} >= set(LAYERS)  # the walk found every layer
    assert breaches(files) == []


def test_the_layer_check_finds_a_call_and_an_include_going_up_and_a_loop():
    files = {
        "shm/segment.c": '#include "coll/comm.h"\nint smc_segment_open(void) { return smc_sync(); }\n',
        "coll/step.c": "int smc_sync(void) { return smc_window_peer(); }\n",
        "coll/window.c": "int smc_window_peer(void) {\n  return smc_sync(); /* smc_segment_open() */\n}\n",
        "net/wire.c": '#include "py/quick_crossing.h"\nint smc_wire_recv(void) { return smc_sync(); }\n',
    }
    assert breaches(files) == ["net/wire.c includes py/quick_crossing.h", "shm/segment.c includes coll/comm.h",
                               "shm/segment.c calls smc_sync of coll/step.c",
                               "a loop: coll/step.c -> coll/window.c"]

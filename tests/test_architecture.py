# SPDX-License-Identifier: Apache-2.0
"""The layering docs/architecture.md describes, checked from the source: no import cycles (function-level imports
included), the C core's communication calls only inside the transports, no parsing of error text, the environment
read and changed only in shmcomm/env/, no file over 400 lines."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shmcomm"


def _modules():
    """{module name: path} of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name, path, modules):
    """The package's modules that `name` imports, anywhere in its code (top level, functions, methods)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 more
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                  else []))
            for alias in node.names:
                submodule = "%s.%s" % (base, alias.name)
                targets.add(submodule if submodule in modules else base)
    return {t for t in targets if t in modules and t != name}


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_the_package_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["shmcomm.basics"]  # the walk found the package and its imports
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The check itself: a function-level import that closes a loop is found."""
    pkg = tmp_path / "shmcomm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from shmcomm import b\n")
    (pkg / "b.py").write_text("def f():\n    from shmcomm.a import thing\n")
    (pkg / "c.py").write_text("import shmcomm.a\n")
    modules = {"shmcomm": pkg / "__init__.py", "shmcomm.a": pkg / "a.py", "shmcomm.b": pkg / "b.py",
               "shmcomm.c": pkg / "c.py"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycles(graph) == [["shmcomm.a", "shmcomm.b"]]


def test_only_the_transports_call_the_c_core():
    """Communication and kernels go through shmcomm/transport/, boxes through the Soft Memory Box's own modules
    (shmcomm/smb/); _native.py only turns failures into exceptions (constants such as lib.SMC_FLOAT32 may be read
    anywhere)."""
    calls = [str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
             if "lib.smc_" in path.read_text() and not {"transport", "smb"} & set(path.relative_to(PACKAGE).parts)
             and path.name != "_native.py"]
    assert calls == []


def _core_pointers(source):
    """Lines of `source` that take the core's cffi: its ffi object (which makes and reads addresses), or the compiled
    module itself."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module, names = (node.module or "").rpartition(".")[2], {a.name for a in node.names}
            if (module in ("_native", "_C") and "ffi" in names) or "_C" in names:
                lines.append(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.endswith("._C") for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "ffi" and isinstance(node.value, ast.Name) \
                and node.value.id == "_native":
            lines.append(node.lineno)
    return lines


def test_only_the_transports_make_addresses():
    """Addresses are made, viewed and copied in shmcomm/transport/ (memory.py for the layers above), the Soft Memory
    Box's own modules and the loader of the core; other modules read constants from the loader and hand addresses
    down as they got them."""
    takers = ["%s:%d" % (path.relative_to(PACKAGE.parent), line) for path in sorted(PACKAGE.rglob("*.py"))
              if not {"transport", "smb"} & set(path.relative_to(PACKAGE).parts) and path.name != "_native.py"
              for line in _core_pointers(path.read_text())]
    assert takers == []


def test_the_address_check_finds_every_way_to_the_core_cffi():
    source = ("from shmcomm._native import ffi, lib\nfrom .._native import ffi\nfrom shmcomm import _C\n"
              "import shmcomm._C\nfrom shmcomm import _native\nx = _native.ffi.NULL\n"
              "from shmcomm._native import lib\nfrom shmcomm.transport import memory\n")
    assert _core_pointers(source) == [1, 2, 3, 4, 6]


KINDS = {"allreduce", "broadcast", "allgather", "reducescatter", "alltoall", "barrier"}


def _kind_tested(test):
    """The collective kind an `if` tests for with ==, a name ("allreduce") or a core code (lib.SMC_COLL_BROADCAST),
    or None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    for side in (test.left, test.comparators[0]):
        if isinstance(side, ast.Constant) and side.value in KINDS:
            return side.value
        if isinstance(side, ast.Attribute) and side.attr.startswith("SMC_COLL_"):
            return side.attr[len("SMC_COLL_"):].lower()
    return None


def _python_dispatch_tables(source):
    """Functions of `source` that branch to three or more collective kinds (if/elif on the kind)."""
    tables = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kinds = {_kind_tested(n.test) for n in ast.walk(function) if isinstance(n, ast.If)} - {None}
            if len(kinds) >= 3:
                tables.append(function.name)
    return tables


def _c_dispatch_tables(source):
    """The number of switch statements in C `source` with three or more collective kinds among their cases."""
    import re

    tables = 0
    for body in re.split(r"\bswitch\s*\(", source)[1:]:
        depth, end = 0, 0
        for end, char in enumerate(body):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if char == "}" and depth == 0:
                break
        tables += len(set(re.findall(r"case\s+SMC_COLL_(\w+)", body[:end]))) >= 3
    return tables


def test_dispatch_is_one_table():
    """Each API builds a Request and engine/request.py's _dispatch is the one place that turns a kind into a call;
    in C, the XLA handler's direct calls into the core (csrc/jax/handler.c) are the one switch on the kind. JAX's
    transpose rule branches on the kind too, but to say which collective is each one's derivative, not how it runs."""
    python = {"%s:%s" % (path.relative_to(PACKAGE.parent), name) for path in sorted(PACKAGE.rglob("*.py"))
              for name in _python_dispatch_tables(path.read_text())}
    assert python == {"shmcomm/engine/request.py:_dispatch", "shmcomm/jax/primitive.py:_transpose"}
    csrc = PACKAGE.parent / "csrc"
    c = {str(path.relative_to(csrc)) for path in sorted(csrc.rglob("*.[ch]")) if _c_dispatch_tables(path.read_text())}
    assert c == {"jax/handler.c"}


def test_the_dispatch_check_finds_a_second_table():
    source = ("def run(kind):\n    if kind == 'allreduce':\n        a()\n    elif kind == lib.SMC_COLL_BROADCAST:\n"
              "        b()\n    elif 'alltoall' == kind:\n        c()\n"
              "def shape(kind):\n    if kind == 'allreduce' and quick:\n        a()\n    if kind == 'alltoall':\n"
              "        b()\n")
    assert _python_dispatch_tables(source) == ["run"]
    c = ("switch (k) {\n case SMC_COLL_ALLREDUCE: { a(); break; }\n case SMC_COLL_BROADCAST: b();\n"
         " case SMC_COLL_BARRIER: c();\n}\nswitch (op) { case SMC_SUM: case SMC_COLL_BARRIER: break; }\n")
    assert _c_dispatch_tables(c) == 1


def test_the_folders_show_the_layers():
    """The top of the package holds the public entry points (and the loader of the core) only; the Soft Memory Box,
    the vocabulary, the settings and start-up have folders of their own, and transport/ holds transports and what
    they alone use."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "_native.py", "asynchronous.py", "basics.py", "collectives.py", "elastic.py",
                   "process_sets.py", "quick_path.py", "shared_arrays.py"]
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == ["algorithms", "engine", "env", "jax", "runner", "sim", "smb", "startup", "testing", "torch",
                       "transport", "vocabulary"]
    transports = sorted(p.stem for p in (PACKAGE / "transport").glob("*.py"))
    assert transports == ["__init__", "build_cache", "crossing", "cuda_kernels", "deadline", "handshake", "kernels",
                          "memory", "mpi", "nccl", "nccl_library", "shm", "tcp", "tcp_connect"]


def test_no_regular_expression_reads_an_error_message():
    """Failures are data (exceptions carry .rank and .field from the core): only the modules that parse user input
    or file names (the launcher, the cost model's command line, the simulated hosts) use regular expressions."""
    allowed = {"runner", "sim", "testing"}
    users = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) else []
            if "re" in names and not allowed & set(path.relative_to(PACKAGE).parts):
                users.append(str(path.relative_to(PACKAGE.parent)))
    assert users == []


def test_the_core_is_rebuilt_when_any_file_it_reads_changes():
    """setuptools rebuilds an extension only when a file it names is newer than the library: every header and every
    C file that the core's sources or the cffi module include must be named (csrc/ffi_build.py, depends)."""
    import sys

    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    sys.path.insert(0, str(csrc))
    try:
        import ffi_build
    finally:
        sys.path.remove(str(csrc))
    named = {pathlib.Path(p).resolve() for p in ffi_build.ffibuilder._assigned_source[3]["depends"]}
    named |= {pathlib.Path(p).resolve() for p in ffi_build.ffibuilder._assigned_source[3]["sources"]}
    read = {p.resolve() for p in csrc.rglob("*.[ch]") if p.relative_to(csrc).parts[0] not in ("jax", "mpi")}
    assert read and not read - named, sorted(str(p) for p in read - named)


SETTINGS = PACKAGE / "env"
_ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
_CHANGES = {"__setitem__", "__delitem__", "setdefault", "update", "pop", "popitem", "clear"}


def _environment_uses(source):
    """[(line, 'read' or 'change')] of every use of the process environment in `source` (os.environ, os.getenv and
    their kin, however imported)."""
    tree = ast.parse(source)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os" and _ENVIRONMENT & {a.name for a in node.names}:
            uses.append((node.lineno, "read"))
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in _ENVIRONMENT):
            continue
        uses.append((node.lineno, "change" if node.attr in ("putenv", "unsetenv") else "read"))
    for node in ast.walk(tree):  # os.environ[...] = ..., del os.environ[...], os.environ.update(...)
        target = node.value if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) else \
            node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr in _CHANGES else None
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "os" and \
                target.attr in _ENVIRONMENT:
            uses.append((node.lineno, "change"))
    return uses


def test_only_the_settings_read_the_environment():
    """Settings are read in one place (shmcomm/env/), where their names, defaults and checks are; the launcher hands
    its ranks a copy of its environment from there too."""
    outside = ["%s:%d" % (path.relative_to(PACKAGE.parent), line) for path in sorted(PACKAGE.rglob("*.py"))
               if SETTINGS not in path.parents for line, _ in _environment_uses(path.read_text())]
    assert outside == []


def test_the_environment_changes_only_for_mpich_and_the_secret():
    """Nothing changes the environment of the whole process, but for MPICH's network module before MPI starts (MPICH
    reads its settings there only) and the job's secret, which leaves it when first read (no child inherits it)."""
    changes = []
    for path in sorted(SETTINGS.glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        allowed = {n for f in ast.walk(tree)
                   if isinstance(f, ast.FunctionDef) and f.name in ("prefer_mpich_network", "job_secret")
                   for n in range(f.lineno, f.end_lineno + 1)}
        changes += ["%s:%d" % (path.name, line) for line, kind in _environment_uses(source)
                    if kind == "change" and line not in allowed]
    assert changes == []


def test_the_environment_check_finds_reads_and_changes():
    source = """
import os
from os import getenv
a = os.environ.get("X")
os.environ["Y"] = "1"
del os.environ["Y"]
os.environ.setdefault("Z", "2")
os.putenv("W", "3")
b = {}.get("X")
"""
    assert sorted(_environment_uses(source)) == [(3, "read"), (4, "read"), (5, "change"), (5, "read"),
                                                 (6, "change"), (6, "read"), (7, "change"), (7, "read"),
                                                 (8, "change")]


def test_no_file_is_over_400_lines():
    """A file a reader can hold in mind: one job each, in the library and the C core."""
    root = PACKAGE.parent
    long = ["%s: %d" % (path.relative_to(root), n) for folder in (PACKAGE, root / "csrc")
            for path in sorted(folder.rglob("*")) if path.suffix in (".py", ".c", ".h", ".cu", ".cuh")
            for n in [len(path.read_text().splitlines())] if n > 400]
    assert long == []

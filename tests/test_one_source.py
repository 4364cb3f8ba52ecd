# SPDX-License-Identifier: Apache-2.0
"""What both languages need is written once: a constant of the C sources (an enum member or a #define) is read from
the core through cffi, never retyped in Python. A Python constant that is a literal and has the value of a C constant
whose name ends with its name (HEADER_BYTES = 32 beside SMC_AGREEMENT_HEADER_BYTES = 32), or whose comment names a C
constant, fails."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
_DEFINE = re.compile(r"^\s*#define\s+([A-Z][A-Z0-9_]*)\s+(.+?)\s*(?:/\*.*)?$", re.M)
_ENUM = re.compile(r"\benum\b[^{;]*\{([^}]*)\}", re.S)
_MEMBER = re.compile(r"([A-Z][A-Z0-9_]*)\s*(?:=\s*([^,/]+?))?\s*(?:,|$|/\*)", re.M)


def _value(text):
    """A C constant expression of literals as Python evaluates it, or None."""
    text = re.sub(r"\((?:u?int\d+_t|size_t|unsigned|long)\)", "", text.strip())
    text = re.sub(r"(?<=[0-9])[uUlL]+\b", "", text)
    if not re.fullmatch(r'[0-9xa-fA-F .eE<>()+*-]+|"[^"]*"', text):
        return None
    try:
        return eval(text, {"__builtins__": {}})
    except Exception:
        return None


def c_constants(sources):
    """{name: value} of the constants in C sources ({path: text}): #defines of literals and enum members."""
    found = {}
    for text in sources.values():
        text = re.sub(r"//[^\n]*", "", text)
        for name, value in _DEFINE.findall(text):
            if _value(value) is not None:
                found[name] = _value(value)
        for body in _ENUM.findall(re.sub(r"/\*.*?\*/", "", text, flags=re.S)):
            following = -1
            for name, value in _MEMBER.findall(body):
                following = _value(value) if value else following + 1
                if following is not None:
                    found[name] = following
    return found


def _literal(node):
    try:
        value = ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.Mult, ast.Add, ast.Sub)):
            left, right = _literal(node.left), _literal(node.right)
            if isinstance(left, int) and isinstance(right, int):
                return {ast.LShift: lambda a, b: a << b, ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b,
                        ast.Sub: lambda a, b: a - b}[type(node.op)](left, right)
        return None
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None


def python_constants(path, text):
    """(where, name, value, comment) of the module-level constants of a Python source that are literals."""
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = [(target, value)]
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            pairs = list(zip(target.elts, value.elts))
        comment = lines[node.end_lineno - 1].partition("#")[2]
        for name, literal in pairs:
            if isinstance(name, ast.Name) and name.id.lstrip("_").isupper() and _literal(literal) is not None:
                yield "%s:%d" % (path, node.lineno), name.id.lstrip("_"), _literal(literal), comment


def copies(c, python):
    """The Python constants that copy a C one: (where, name, the C constant)."""
    found = []
    for where, name, value, comment in python:
        named = re.findall(r"\bSMC_[A-Z0-9_]+", comment)
        same = [n for n, v in c.items()
                if (n == name or n.endswith("_" + name)) and v == value and type(v) is type(value)]
        if named or same:
            found.append((where, name, (named or same)[0]))
    return found


def test_no_python_constant_copies_one_of_the_c_sources():
    sources = {p: p.read_text() for p in sorted((ROOT / "csrc").rglob("*.[ch]"))}
    python = [found for p in sorted((ROOT / "shmcomm").rglob("*.py"))
              for found in python_constants(p.relative_to(ROOT), p.read_text())]
    assert not copies(c_constants(sources), python), "read these from the core (shmcomm._native's lib) instead"


def test_the_check_finds_a_copy_and_passes_a_read():
    c = c_constants({"a.h": "enum { SMC_AGREEMENT_OK = 0, SMC_AGREEMENT_MISMATCH, SMC_HEADER_BYTES = 32 };\n"
                             "#define SMC_HALVING_BYTES (64 << 10) /* data of at least this */\n"
                             '#define SMC_SUFFIX "@stripes"\n#define SMC_MAX_BYTES ((uint64_t)1 << 57)\n'})
    assert c == {"SMC_AGREEMENT_OK": 0, "SMC_AGREEMENT_MISMATCH": 1, "SMC_HEADER_BYTES": 32,
                 "SMC_HALVING_BYTES": 65536, "SMC_SUFFIX": "@stripes", "SMC_MAX_BYTES": 1 << 57}
    python = list(python_constants("m.py", 'OK, MISMATCH = 0, 1\nHALVING_BYTES = 64 << 10\nSUFFIX = "@stripes"\n'
                                           "LIMIT = 479  # SMC_REASON_MAX, less the NUL\n"
                                           "HEADER_BYTES = lib.SMC_HEADER_BYTES\nTIMEOUT = 32\n"))
    assert [(name, constant) for _, name, constant in copies(c, python)] == [
        ("OK", "SMC_AGREEMENT_OK"), ("MISMATCH", "SMC_AGREEMENT_MISMATCH"), ("HALVING_BYTES", "SMC_HALVING_BYTES"),
        ("SUFFIX", "SMC_SUFFIX"), ("LIMIT", "SMC_REASON_MAX")]


def test_the_digests_ranks_compare_are_the_cores():
    """A step's tag and the agreement's signature are computed by the core (csrc/core/digest.c), which the quick calls
    in C and description.py both call: neither hashes a layout of its own, which would then be written twice."""
    hashing = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.[ch]")
                     if "PyObject_Hash" in p.read_text())
    assert hashing == []
    source = (ROOT / "shmcomm" / "vocabulary" / "description.py").read_text()
    calls = [n.lineno for n in ast.walk(ast.parse(source))
             if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "hash"]
    assert calls == []


def test_the_digests_tell_descriptions_apart():
    from shmcomm._native import lib
    from shmcomm.vocabulary import description

    tags = {description.tag(lib.SMC_FLOAT32, shape) for shape in [(6,), (2, 3), (3, 2), (6, 1), (), (0,)]}
    assert len(tags) == 6 and description.tag(lib.SMC_INT32, (6,)) not in tags
    base = description.describe("allreduce", lib.SMC_FLOAT32, (4,), 1, 1.0, 1.0)
    others = [base._replace(kind="reducescatter"), base._replace(op=3), base._replace(prescale=2.0),
              base._replace(postscale=0.5), base._replace(shape=(2, 2)), base._replace(root=0)]
    signatures = {c.signature(4, 1) for c in [base] + others} | {base.signature(4, 2), base.signature(4, 1, 1)}
    assert len(signatures) == len(others) + 3
    assert base._replace(prescale=-0.0).signature() == base._replace(prescale=0.0).signature()

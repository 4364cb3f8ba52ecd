# SPDX-License-Identifier: Apache-2.0
"""No repeated code in the library (shmcomm/ and the C sources of csrc/): no 6 statements in a row that stand again
elsewhere, the same or differing only in names, strings and numbers. A run without a call is a declaration or data (an
enum, a table of flags, a data class's fields under its decorator, a property and its setter) and does not count; nor do C headers, which only declare."""
import io
import keyword
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = 6
_C_KEYWORDS = {"if", "else", "for", "while", "do", "return", "switch", "case", "default", "break", "continue",
               "goto", "sizeof", "static", "const", "struct", "typedef", "enum", "union", "void", "int", "long",
               "unsigned", "char", "double", "float", "size_t", "uint64_t", "uint32_t", "int32_t", "int64_t",
               "uint8_t", "_Atomic", "inline", "NULL"}
_C_TOKEN = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|0[xX][0-9a-fA-F]+[uUlL]*|\d+\.?\d*(?:[eE][-+]?\d+)?'
                      r'[uUlLfF]*|[A-Za-z_]\w*|->|\+\+|--|<<|>>|[<>=!]=|&&|\|\||\S')


def _python_statements(text):
    """[(first line, shape)] of every logical line but docstrings: names become N, strings and numbers L; a
    module-level definition's first line is marked ^."""
    statements, shape, first, first_kind, column = [], [], None, None, 0
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if shape and not (len(shape) == 1 and shape[0] == "L" and first_kind == tokenize.STRING):
                top = column == 0 and shape[0] in ("def", "class", "@")  # where a module-level definition starts
                statements.append((first, ("^ " if top else "") + " ".join(shape)))
            shape, first = [], None
        elif tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            pass
        else:
            if first is None:
                first, first_kind, column = tok.start[0], tok.type, tok.start[1]
            if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
                shape.append("N")
            elif tok.type in (tokenize.STRING, tokenize.NUMBER):
                shape.append("L")
            else:
                shape.append(tok.string)
    return statements


def _c_statements(text):
    """[(line, shape)] of every line of C with code, comments and preprocessor lines left out; a line that starts at
    the margin (a function's or a global's definition) is marked ^."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    statements = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("//")[0].strip()
        if not line or line.startswith("#") or line in ("{", "}", "};"):
            continue
        shape = []
        for token in _C_TOKEN.findall(line):
            if token[0] in "\"'" or token[0].isdigit():
                shape.append("L")
            elif (token[0].isalpha() or token[0] == "_") and token not in _C_KEYWORDS:
                shape.append("N")
            else:
                shape.append(token)
        statements.append((number, ("^ " if raw[:1].strip() else "") + " ".join(shape)))
    return statements


def _calls(shape):
    """Whether a statement calls something: a definition's or a decorator's parentheses do not count."""
    return not shape.lstrip("^ ").startswith(("@", "def ", "class ")) and re.search(r"[N)\]] \(", shape) is not None


def repeated(files):
    """{path: text} -> ["a:line ~ b:line"] for every run of RUN statements of the same shape, with a call in it, that
    stands in two places (not overlapping). A run lies inside a definition: its first line, the name and parameters,
    is where two definitions differ by design."""
    seen, found, reported = {}, [], set()
    for path, text in sorted(files.items()):
        statements = _python_statements(text) if path.endswith(".py") else _c_statements(text)
        for i in range(len(statements) - RUN + 1):
            window = tuple(shape for _, shape in statements[i:i + RUN])
            if any(shape.startswith("^") for shape in window) or not any(map(_calls, window)):
                continue
            here = (path, i, statements[i][0])
            for other in seen.get(window, []):
                if other[0] == path and i - other[1] < RUN:
                    continue
                pair = (other[0], path)
                if pair + (other[1] - i,) in reported:  # the same pair of runs, one statement further on
                    continue
                reported.add(pair + (other[1] - i,))
                found.append("%s:%d ~ %s:%d" % (other[0], other[2], path, here[2]))
            seen.setdefault(window, []).append(here)
    return found


def _library():
    files = {}
    for path in sorted((ROOT / "shmcomm").rglob("*.py")) + sorted((ROOT / "csrc").rglob("*.c")):
        files[str(path.relative_to(ROOT))] = path.read_text()
    return files


def test_the_library_repeats_no_code():
    files = _library()
    assert len(files) > 100
    assert repeated(files) == []


def test_the_check_finds_code_repeated_with_other_names_and_not_a_table():
    twice = """
def first(x, what):
    src = wrap(x, what)
    shape = tuple(src.shape) or (1,)
    size = row_bytes(src, shape)
    rows = self._every
    tag = description.tag(src.dtype_key(), shape[1:])
    self._step(self.shm.allgather_begin, src, what, rows, tag)


def second(y, name):
    '''Another, with other names and values.'''
    buf = wrap(y, name)
    dims = tuple(buf.shape) or (2,)
    count = row_bytes(buf, dims)
    matrix = self._matrix
    key = description.tag(buf.dtype_key(), dims[2:])  # a comment does not count
    self._step(self.shm.alltoall_begin, buf, name, matrix, key)
"""
    table = "FLAGS = [\n" + "".join('    ("--flag-%d", int, "N", "help %d"),\n' % (i, i) for i in range(12)) + "]\n"
    enum = "typedef enum {\n" + "".join("  SMC_X%d = %d,\n" % (i, i) for i in range(12)) + "} smc_x_t;\n"
    c_twice = "".join("static int f%d(int a) {\n  int b = g(a);\n  if (b < 0) return b;\n  b += h(a, 1);\n"
                      "  b *= 2;\n  b -= a;\n  return k(b);\n}\n" % i for i in range(2))
    assert repeated({"a.py": twice, "b.py": table, "c.c": enum}) == ["a.py:3 ~ a.py:13"]
    assert repeated({"d.c": c_twice}) == ["d.c:2 ~ d.c:10"]

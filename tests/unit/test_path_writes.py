"""Only csrc/path.c writes a kvl_path field (csrc/path.h says why).

A static check over the C sources: in every function outside path.c, an
assignment, increment, string or memory copy, atomic store or out-buffer
argument that targets a field of kvl_path (the field names are read from the
struct in path.h) through a `kvl_path *` declared in that function, through
`paths[...]` or through `ctrl_path` fails the test, naming file and line.
Reads are fine: the scheduler and the monitor read the fields freely.
"""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"

# functions whose first argument they write
WRITERS = (
    r"snprintf|vsnprintf|sprintf|vsprintf|memcpy|memmove|memset|strcpy|strncpy|strcat|strncat|"
    r"__atomic_store_n|__atomic_store|__atomic_exchange_n|__atomic_exchange|"
    r"__atomic_fetch_\w+|__atomic_\w+_fetch|__atomic_compare_exchange\w*|"
    r"atomic_store\w*|atomic_fetch_\w+|atomic_exchange\w*|atomic_compare_exchange\w*"
)
ASSIGN = r"\s*(?:(?:<<|>>|[-+*/%&|^])?=(?!=)|\+\+|--)"


def strip(text: str) -> str:
    """text without comments, string and character literals; newlines kept (line numbers)."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)

    def blank(m: re.Match[str]) -> str:
        s = m.group(0)
        keep = '""' if s.startswith('"') else "''" if s.startswith("'") else " "
        return keep + "\n" * s.count("\n")

    return pattern.sub(blank, text)


def path_fields(header: str) -> list[str]:
    """The field names of struct kvl_path, from its definition."""
    m = re.search(r"\bstruct\s+kvl_path\s*\{(.*?)\}\s*(?:kvl_path\s*)?;", strip(header), re.S)
    assert m, "struct kvl_path not found in csrc/path.h"
    fields = []
    for decl in m.group(1).split(";"):
        for part in decl.split(","):
            name = re.search(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$", part.strip())
            if name:
                fields.append(name.group(1))
    return fields


def functions(code: str) -> list[tuple[int, str]]:
    """(offset, text) of each top-level braced block with what precedes it
    back to the previous top-level `;` or `}`: a function with its signature."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(code):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                out.append((start, code[start : i + 1]))
                start = i + 1
        elif ch == ";" and depth == 0:
            start = i + 1
    return out


def writes(source: str, fields: list[str]) -> list[tuple[int, str]]:
    """(line, text) of every write to a kvl_path field in C source text."""
    code = strip(source)
    field = r"(?:" + "|".join(fields) + r")\b"
    found: dict[int, str] = {}
    for offset, fn in functions(code):
        names = set(re.findall(r"(?<!const )\bkvl_path\s*\*\s*(\w+)", fn))
        bases = [r"\bpaths\s*\[[^\]]*\]\s*\.", r"\bctrl_path\s*\."]
        if names:
            bases.append(r"\b(?:" + "|".join(sorted(names)) + r")\s*->")
        lval = r"(?:" + "|".join(bases) + r")\s*" + field
        whole = [r"\bpaths\s*\[[^\]]*\](?!\s*\.)", r"\bctrl_path\b(?!\s*\.)"]
        if names:
            whole.append(r"\b(?:" + "|".join(sorted(names)) + r")\b(?!\s*->)")
        obj = r"(?:" + "|".join(whole) + r")"
        rules = [
            lval + ASSIGN,  # pa->x = / += / ++
            r"(?:\+\+|--)\s*" + lval,  # ++pa->x
            r"\b(?:" + WRITERS + r")\s*\(\s*&?\s*[\w>.\[\]-]*?" + lval,  # snprintf(pa->x, ...)
            # f(..., pa->x, sizeof pa->x): an out-buffer
            r"(?:" + "|".join(bases) + r")\s*(?P<f>" + field + r")\s*,\s*sizeof\s*\(?"
            r"\s*[\w>.\[\]-]*?(?:->|\.)\s*(?P=f)\b",
            r"(?:[(,=]|\breturn)\s*&\s*[\w>.\[\]-]*?" + lval,  # &pa->x handed on (loads aside)
            r"(?:^|[;{}])\s*\*\s*(?:" + "|".join(sorted(names) or ["$^"]) + r")\s*=(?!=)",  # *pa =
            r"(?:\bpaths\s*\[[^\]]*\]|\bctrl_path)\s*=(?!=)",  # p->paths[i] = ...
            r"\b(?:memset|memcpy|memmove)\s*\(\s*&?\s*[\w>.\[\]-]*?" + obj,  # memset(pa, ...)
        ]
        for rule in rules:
            for m in re.finditer(rule, fn):
                before = fn[max(0, m.start() - 40) : m.start() + 1]
                if re.search(r"(?:__atomic_load_n|__atomic_load|atomic_load\w*)\s*\(\s*$", before):
                    continue
                line = code.count("\n", 0, offset + m.end() - 1) + 1
                found.setdefault(line, source.splitlines()[line - 1].strip())
    return sorted(found.items())


def test_fields_parsed():
    fields = path_fields((CSRC / "path.h").read_text())
    some = "index conn state inflight_bytes seen_acked seen_received tnote last_error"
    assert set(some.split()) | {"mover_off_until_ns", "mover_died_kind"} <= set(fields)
    assert len(fields) >= 45


def test_rule_catches_every_write_form():
    """The check itself: each of these writes is found, and none of the reads."""
    fields = ["conn", "tnote", "hedges", "mover_off_until_ns", "rport", "state"]
    src = """
static void f(kvl_peer *p, kvl_path *pa, kvl_conn *c)
{
    kvl_path *idle = &p->paths[0];
    pa->conn = c;
    idle->hedges += 2;
    pa->hedges++;
    --idle->hedges;
    p->paths[1].rport = 7;
    p->ctrl_path.state = 3;
    snprintf(pa->tnote, sizeof pa->tnote, "%s", "x");
    tp(c)->note(c->ep, pa->tnote, sizeof pa->tnote);
    __atomic_store_n(&pa->mover_off_until_ns, 1, __ATOMIC_RELAXED);
    memset(pa, 0, sizeof *pa);
    p->paths[2] = p->paths[3];
    *idle = *pa;
}
static int g(const kvl_peer *p, kvl_path *pa, kvl_conn *c)
{
    uint64_t off = __atomic_load_n(&pa->mover_off_until_ns, __ATOMIC_RELAXED);
    char died[sizeof pa->tnote];
    memcpy(died, pa->tnote, sizeof died);
    c->conn = NULL; /* not a kvl_path: c is a connection here */
    pa = &p->paths[1];
    return pa->conn == c && pa->hedges >= 1 && p->paths[0].state == 2 && off;
}
"""
    hits = [line for line, _ in writes(src, fields)]
    assert hits == list(range(5, 17)), hits


def test_only_path_c_writes_a_path():
    fields = path_fields((CSRC / "path.h").read_text())
    bad = []
    for f in sorted(CSRC.rglob("*.[ch]")):
        if f == CSRC / "path.c":
            continue
        for line, text in writes(f.read_text(), fields):
            bad.append(f"{f.relative_to(CSRC.parent)}:{line}: {text}")
    assert not bad, "kvl_path fields written outside csrc/path.c (add a path.c function):\n" + (
        "\n".join(bad)
    )

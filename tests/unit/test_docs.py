"""The documents stay a front page plus their references: the README is short, every
relative link in the documents resolves (files and heading anchors), every result file
under benchmarks/ is quoted by a document, and every test a document names exists."""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCUMENTS = [
    "README.md",
    "benchmarks/README.md",
    "scripts/README.md",
    *glob.glob("docs/*.md", root_dir=ROOT),
]


def test_the_readme_is_a_front_page_under_250_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.readlines()) < 250


def test_every_relative_link_of_the_documents_resolves():
    result = subprocess.run(
        [sys.executable, "scripts/check_doc_links.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_every_committed_result_file_is_quoted_by_a_document():
    text = ""
    for document in DOCUMENTS:
        with open(os.path.join(ROOT, document), encoding="utf-8") as f:
            text += f.read()
    results = glob.glob("benchmarks/results/**/*.*", root_dir=ROOT, recursive=True)
    results += glob.glob("benchmarks/gpu-logs/*", root_dir=ROOT)
    assert results
    unquoted = [path for path in results if os.path.basename(path) not in text]
    assert not unquoted, f"result files no document quotes: {unquoted}"


# A file mention, optionally followed by `::name` parts (`file.py::test_x[param]`,
# `file.py::TestClass::test_y`), or a lone `::name` continuing the last file mentioned before it
# in the same paragraph or table row (`a.py::test_x`, `::test_y`).
TEST_REFERENCE = re.compile(
    r"(?<![\w./-])(?P<path>[\w./-]+\.py)(?P<names>(?:::\w+(?:\[[^\]\n]*\])?)*)"
    r"|(?<![\w\]:])(?P<continued>(?:::[A-Za-z_]\w*(?:\[[^\]\n]*\])?)+)"
)
TESTS = os.path.join(ROOT, "tests")


def resolve_test_file(path: str) -> str | None:
    """The file under tests/ that a document's path names (`tests/unit/x.py`, `unit/x.py`,
    or a bare `test_x.py` found anywhere under tests/), or None if it names no test file."""
    path = path.removeprefix("./")
    if path.startswith("tests/"):
        return os.path.join(ROOT, path)
    if path.split("/")[0] in os.listdir(TESTS) and "/" in path:
        return os.path.join(TESTS, path)
    if "/" not in path and path.startswith("test_"):
        found = glob.glob(f"**/{path}", root_dir=TESTS, recursive=True)
        return os.path.join(TESTS, found[0]) if len(found) == 1 else os.path.join(TESTS, path)
    return None


@functools.cache
def definitions(path: str) -> dict[str, ast.AST]:
    """Every function and class a test file defines at its top level, and the functions and
    classes inside those classes, by name (what a `file::name` test id can name)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    return {
        node.name: node
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }


def defines(path: str, names: list[str]) -> bool:
    """Whether `file::names[0]::names[1]...` resolves; a single name may also be a method."""
    scope = definitions(path)
    if len(names) == 1 and names[0] not in scope:
        classes = [node for node in scope.values() if isinstance(node, ast.ClassDef)]
        while classes:
            body = classes.pop().body
            if any(getattr(node, "name", None) == names[0] for node in body):
                return True
            classes += [node for node in body if isinstance(node, ast.ClassDef)]
        return False
    for i, name in enumerate(names):
        node = scope.get(name)
        if node is None or (i < len(names) - 1 and not isinstance(node, ast.ClassDef)):
            return False
        scope = {n.name: n for n in getattr(node, "body", []) if hasattr(n, "name")}
    return True


def references_to_tests(document: str):
    """(line number, reference as written, test file or None, [names]) for every test file
    and test named in the document; a lone `::name` takes the file last named in its
    paragraph or table row."""
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        lines = f.read().splitlines()
    last_file = last_path = None
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("|"):
            last_file = last_path = None
        for match in TEST_REFERENCE.finditer(line):
            if match["path"]:
                path = resolve_test_file(match["path"])
                if path is None:
                    last_file = last_path = None
                    continue
                last_file, last_path = path, match["path"]
                names, written = match["names"], match[0]
            elif last_file is not None:
                path, names, written = last_file, match["continued"], f"({last_path}){match[0]}"
            else:
                continue
            names = [re.sub(r"\[.*\]$", "", name) for name in names.split("::")[1:]]
            yield number, written, path, names


def test_every_test_the_documents_name_exists():
    stale = []
    checked = 0
    for document in DOCUMENTS:
        for number, written, path, names in references_to_tests(document):
            checked += 1
            where, relative = f"{document}:{number}: {written}", os.path.relpath(path, ROOT)
            if not os.path.isfile(path):
                stale.append(f"{where} (no file {relative})")
            elif names and not defines(path, names):
                stale.append(f"{where} ({relative} defines no {'::'.join(names)})")
    assert checked > 100, f"only {checked} test references found: is the pattern still right?"
    assert not stale, "stale test references in the documents:\n" + "\n".join(stale)

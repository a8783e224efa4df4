"""The documents stay a front page plus their references: the README is short, every
relative link in the documents resolves (files and heading anchors), and every result file
under benchmarks/ is quoted by a document."""

from __future__ import annotations

import glob
import os
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

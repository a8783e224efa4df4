"""Check the documents' relative Markdown links: every target file exists, and every
``#anchor`` names a heading of its target (GitHub's heading slugs).

Usage: python scripts/check_doc_links.py [FILE.md ...]   (default: README.md,
benchmarks/README.md, scripts/README.md, docs/*.md). Exits 1 and lists the broken links."""

import glob
import os
import re
import sys

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose_lines(path: str) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line.lstrip()):
                fenced = not fenced
            elif not fenced:
                lines.append(line)
    return lines


def anchors(path: str) -> set[str]:
    found: set[str] = set()
    for line in prose_lines(path):
        if line.startswith("#"):
            base, n = slug(line.lstrip("#")), 1
            name = base
            while name in found:  # repeated headings get -1, -2, ...
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def broken_links(path: str) -> list[str]:
    problems = []
    for line in prose_lines(path):
        for match in LINK.finditer(re.sub(r"`[^`]*`", "``", line)):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part or "."))
            if file_part and not os.path.exists(resolved):
                problems.append(f"{path}: {target} (no such file {resolved})")
            elif anchor:
                heading_file = resolved if file_part else path
                if heading_file.endswith(".md") and anchor not in anchors(heading_file):
                    problems.append(f"{path}: {target} (no heading #{anchor})")
    return problems


def main(paths: list[str]) -> int:
    paths = paths or ["README.md", "benchmarks/README.md", "scripts/README.md"] + sorted(
        glob.glob("docs/*.md")
    )
    problems = [p for path in paths for p in broken_links(path)]
    print("\n".join(problems) or f"{len(paths)} files: every relative link resolves")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

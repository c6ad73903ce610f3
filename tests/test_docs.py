"""The documents name files that exist: every repository path in the README, DEVELOPERS.md
and docs/*.md (a path under src/, tests/, docs/, scripts/ or .ci/) is there, so the
"Design in one screen" and the layout stay true as files move."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path with at least one slash under a top-level folder of the repository, ending in a
# file name with a suffix or in a slash (a folder)
PATH = re.compile(r"(?<![\w./-])((?:src|tests|docs|scripts|\.ci)/[\w./*-]*[\w/*])")


def _paths(text: str) -> set[str]:
    return {m.rstrip(".") for m in PATH.findall(text)}


def test_every_repository_path_in_the_documents_exists():
    missing = []
    for document in DOCUMENTS:
        for path in sorted(_paths(document.read_text())):
            if not any(ROOT.glob(path)):   # a glob (tests/test_contracts_*.py): one match
                missing.append(f"{document.relative_to(ROOT)}: {path}")
    assert not missing, "documents name paths that do not exist:\n" + "\n".join(missing)


def test_the_layout_trees_name_real_files():
    """The indented trees (`src/xrec/` then `  area/` then `    file.py`) in the README and
    DEVELOPERS.md: each file or folder name at the start of a line exists where the tree
    puts it."""
    missing = []
    for document in (ROOT / "README.md", ROOT / "DEVELOPERS.md"):
        for block in re.findall(r"```\n(src/xrec/\n.*?)```", document.read_text(), re.S):
            stack: list[tuple[int, str]] = []   # (indent, folder) of the enclosing folders
            for line in block.splitlines():
                match = re.match(r"( *)([\w./]+)(?:\s|$)", line)
                if not match or not match.group(2).strip():
                    continue
                indent, name = len(match.group(1)), match.group(2)
                if indent >= 20:            # a continuation of the line above
                    continue
                while stack and stack[-1][0] >= indent:
                    stack.pop()
                path = Path(stack[-1][1] if stack else ".") / name
                if not (ROOT / path).exists():
                    missing.append(f"{document.relative_to(ROOT)}: {path}")
                if name.endswith("/"):
                    stack.append((indent, str(path)))
    assert not missing, "layout trees name files that do not exist:\n" + "\n".join(missing)


def test_the_engine_options_table_lists_every_option():
    """docs/serving.md's "Engine options" table has one row per `EngineOptions` field, and no
    row for an option that does not exist (`adaptive_threads` was missing from it)."""
    from dataclasses import fields

    from xrec.config.engine import EngineOptions

    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("## Engine options", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    names = {f.name for f in fields(EngineOptions)}
    assert rows == names, (f"options without a row: {sorted(names - rows)}; rows without an "
                           f"option: {sorted(rows - names)}")

"""Mutation score per module from mutmut's results in mutants/ (`make mutate` prints it).

    python tests/mutation_score.py [--survivors]

Score = killed / (killed + survived), per source file and per area (search/, model/,
catalog/, engine/, server/schemas.py); a timeout counts as killed (the mutant hung the
tests). Mutants no selected test reaches ("no tests") are counted apart: they are not in
the score, they are a gap in test selection. Not a test module (pytest collects test_*.py).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

KILLED = {1, 3, 24, -24, 152, 255, 36}   # mutmut's exit codes: killed, or timed out
SURVIVED = {0}
NO_TESTS = {5, 33}


def area(path: str) -> str:
    relative = path.removeprefix("src/xrec/")
    if "/" in relative:
        return relative.split("/")[0] + "/"
    return relative


def main(argv: list[str]) -> int:
    metas = sorted(Path("mutants").glob("src/**/*.py.meta"))
    if not metas:
        print("no results in mutants/: run `make mutate` first", file=sys.stderr)
        return 1
    rows: dict[str, collections.Counter] = {}
    survivors: list[str] = []
    for meta in metas:
        path = str(meta.relative_to("mutants")).removesuffix(".meta")
        counts = collections.Counter()
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            kind = ("killed" if code in KILLED else "survived" if code in SURVIVED
                    else "no tests" if code in NO_TESTS else "not checked" if code is None
                    else "other")
            counts[kind] += 1
            if kind == "survived":
                survivors.append(name)
        rows[path] = counts
    areas: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path, counts in rows.items():
        areas[area(path)] += counts
    print(f"{'module':42} {'killed':>7} {'survived':>8} {'score':>6} {'no tests':>8} {'other':>6}")
    for name, counts in [*sorted(rows.items()), ("", None), *sorted(areas.items()),
                         ("all", sum(areas.values(), collections.Counter()))]:
        if counts is None:
            print()
            continue
        checked = counts["killed"] + counts["survived"]
        score = f"{100 * counts['killed'] / checked:5.1f}%" if checked else "    -"
        other = counts["not checked"] + counts["other"]
        print(f"{name:42} {counts['killed']:7} {counts['survived']:8} {score:>6} "
              f"{counts['no tests']:8} {other:6}")
    if "--survivors" in argv:
        print("\nsurvivors (`mutmut show NAME` for the diff):")
        for name in survivors:
            print(" ", name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

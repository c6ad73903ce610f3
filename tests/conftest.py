"""Test order under `make mutate` only: fastest first, so a mutant dies on its cheapest test.

mutmut passes each mutant's tests as an unordered set of node ids and stops at the first
failure (-x). Modules stay contiguous (their module-scoped fixtures are built once),
ordered by their fastest test, then tests by their duration in mutmut's stats run.
A normal run (no MUTANT_UNDER_TEST in the environment) keeps pytest's order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

STATS = Path("mutmut-stats.json")   # mutmut runs the tests inside mutants/


def pytest_collection_modifyitems(config, items) -> None:
    if "MUTANT_UNDER_TEST" not in os.environ or not STATS.is_file():
        return
    duration = json.loads(STATS.read_text()).get("duration_by_test", {})
    seconds = {item.nodeid: duration.get(item.nodeid, 0.0) for item in items}
    fastest: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        fastest[module] = min(fastest.get(module, float("inf")), seconds[item.nodeid])
    items.sort(key=lambda item: (fastest[item.nodeid.split("::", 1)[0]],
                                 item.nodeid.split("::", 1)[0], seconds[item.nodeid]))

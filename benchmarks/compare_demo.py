"""Compare two `fivefold demo` outputs: the same rows, in the same order, with the same quality
columns (a refactor must not change what the demo measures; its speed columns are noise between
two sittings and are shown, not compared).

    .venv/bin/python benchmarks/compare_demo.py BEFORE.txt AFTER.txt

Each file is the demo's printed output (its last JSON line is read). Prints a table and one JSON
line; exits 1 when a row or a quality column differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMPARED = ("lever", "change", "metric", "accuracy", "status")


def demo_rows(path: Path) -> list[dict]:
    """The rows of the demo's JSON line (the last line of the file that parses as one)."""
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)["rows"]
    raise SystemExit(f"compare_demo: no demo JSON line in {path}")


def main() -> int:
    from rich.console import Console

    from fivefold.bench.report import json_line, results_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args()
    before, after = demo_rows(args.before), demo_rows(args.after)
    rows, num_same = [], 0
    for i in range(max(len(before), len(after))):
        a = before[i] if i < len(before) else {}
        b = after[i] if i < len(after) else {}
        diffs = [k for k in COMPARED if a.get(k) != b.get(k)]
        num_same += not diffs
        rows.append((b.get("change", a.get("change", "?"))[:48], b.get("accuracy", "-")[:44],
                     f"{a.get('ratio', 0):.2f}x -> {b.get('ratio', 0):.2f}x", ", ".join(diffs) or "same"))
    Console(width=160).print(results_table(f"fivefold demo: {args.before.name} vs {args.after.name}",
                                           ("row", "accuracy cost (after)", "ratio before -> after", "differs in"),
                                           rows))
    print(json_line({"benchmark": "compare_demo", "rows_before": len(before), "rows_after": len(after),
                     "rows_same": num_same, "compared": list(COMPARED)}))
    return 0 if num_same == len(before) == len(after) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The run registry: every benchmark run, stored in SQLite, comparable and reversible.

A run is (name, configuration, metrics) plus where it ran: model fingerprint, package
version, git commit, machine description. ``compare`` gives the configuration diff
and the metric deltas as ratios, and warns when more than one variable changed (the
"change one variable at a time" rule); ``rollback`` writes a run's configuration as a
recipe file from which the same benchmark can be run again.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fivefold.errors import FivefoldError

DEFAULT_REGISTRY = Path(".fivefold") / "runs.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created REAL NOT NULL,
    name TEXT NOT NULL,
    config TEXT NOT NULL,
    metrics TEXT NOT NULL,
    model_fingerprint TEXT,
    package_version TEXT,
    git_commit TEXT,
    machine TEXT
);
CREATE TABLE IF NOT EXISTS baselines (name TEXT PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id));
"""


@dataclass(frozen=True)
class Run:
    id: int
    created: float
    name: str
    config: dict[str, Any]
    metrics: dict[str, Any]
    model_fingerprint: str | None
    package_version: str | None
    git_commit: str | None
    machine: dict[str, Any]


@dataclass(frozen=True)
class Comparison:
    config_diff: dict[str, tuple[Any, Any]]  # key -> (value in A, value in B)
    metric_ratios: dict[str, tuple[float, float, float | None]]  # key -> (A, B, B / A)

    @property
    def num_changed_variables(self) -> int:
        return len(self.config_diff)

    @property
    def warning(self) -> str | None:
        if self.num_changed_variables > 1:
            return (f"{self.num_changed_variables} variables changed ({', '.join(sorted(self.config_diff))}): "
                    f"the effect cannot be attributed to one of them")
        return None


def machine_description() -> dict[str, Any]:
    """OS, torch and this CPU as the kernels see it (ISA level, VNNI, bf16, forcing: ``fivefold.platform``)."""
    import torch

    from fivefold.platform import current_platform

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": current_platform().describe()}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Changed keys, descending into sub-configs present on both sides: a sub-config
    switched on (None -> {...}) is one variable, not one per field, and so is one replaced by a
    sub-config of another kind (its ``scheme`` differs: W8A16 -> W4A16 is one choice, whose
    fields are not comparable one by one)."""
    out: dict[str, tuple[Any, Any]] = {}
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict) and va.get("scheme") != vb.get("scheme"):
            out[f"{prefix}{k}"] = (va, vb)
        elif isinstance(va, dict) and isinstance(vb, dict):
            out.update(config_diff(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out[f"{prefix}{k}"] = (va, vb)
    return out


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _run(row: tuple) -> Run:
    return Run(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]), row[5], row[6], row[7],
               json.loads(row[8] or "{}"))


class RunRegistry:
    def __init__(self, path: str | Path = DEFAULT_REGISTRY) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path)
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def record(self, name: str, config: dict[str, Any], metrics: dict[str, Any],
               model_fingerprint: str | None = None) -> int:
        """Store a run; return its id."""
        from fivefold import __version__

        cur = self._db.execute(
            "INSERT INTO runs (created, name, config, metrics, model_fingerprint, package_version, git_commit, machine)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time(), name, json.dumps(config, sort_keys=True), json.dumps(metrics, sort_keys=True),
             model_fingerprint, __version__, git_commit(), json.dumps(machine_description(), sort_keys=True)),
        )
        self._db.commit()
        return int(cur.lastrowid)

    def get(self, run_id: int) -> Run:
        row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise FivefoldError(f"no run {run_id} in {self.path}")
        return _run(row)

    def list(self, name: str | None = None) -> list[Run]:
        query = "SELECT id FROM runs" + (" WHERE name = ?" if name else "") + " ORDER BY id"
        return [self.get(r[0]) for r in self._db.execute(query, (name,) if name else ())]

    def page(self, offset: int, limit: int, name: str | None = None) -> tuple[list[Run], int]:
        """Runs ``offset`` .. ``offset + limit`` (newest first; of workload ``name`` only, if given)
        and how many there are in all: one page of a long registry without reading the rest."""
        where, args = (" WHERE name = ?", (name,)) if name else ("", ())
        total = int(self._db.execute("SELECT COUNT(*) FROM runs" + where, args).fetchone()[0])
        rows = self._db.execute("SELECT * FROM runs" + where + " ORDER BY id DESC LIMIT ? OFFSET ?",
                                (*args, limit, offset)).fetchall()
        return [_run(r) for r in rows], total

    def baselines(self) -> dict[str, int]:
        """Workload name -> its baseline run's id."""
        return {name: int(run_id) for name, run_id in self._db.execute("SELECT name, run_id FROM baselines")}

    def set_baseline(self, run_id: int) -> None:
        run = self.get(run_id)
        self._db.execute("INSERT OR REPLACE INTO baselines (name, run_id) VALUES (?, ?)", (run.name, run_id))
        self._db.commit()

    def baseline(self, name: str) -> Run | None:
        row = self._db.execute("SELECT run_id FROM baselines WHERE name = ?", (name,)).fetchone()
        return self.get(row[0]) if row else None

    def compare(self, a_id: int, b_id: int) -> Comparison:
        a, b = self.get(a_id), self.get(b_id)
        diff = config_diff(a.config, b.config)
        ma, mb = _flatten(a.metrics), _flatten(b.metrics)
        ratios = {}
        for k in sorted(set(ma) & set(mb)):
            if isinstance(ma[k], (int, float)) and isinstance(mb[k], (int, float)) and not isinstance(ma[k], bool):
                ratios[k] = (ma[k], mb[k], mb[k] / ma[k] if ma[k] else None)
        return Comparison(diff, ratios)

    def rollback(self, run_id: int, recipe_path: str | Path) -> Path:
        """Write the run's configuration as a recipe file (JSON) to re-run it."""
        path = Path(recipe_path)
        path.write_text(json.dumps(self.recipe(run_id), indent=2, sort_keys=True))
        return path

    def recipe(self, run_id: int) -> dict[str, Any]:
        """The recipe that re-runs ``run_id``: its benchmark and configuration."""
        run = self.get(run_id)
        return {"benchmark": run.name, "config": run.config, "from_run": run_id}

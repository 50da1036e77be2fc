"""The soak benchmark, short, on a tiny model: every fault kind fires, and the script's own
checks (nothing lost, no block leaked, the engine fault answered and exit 1) hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import save_random_hf_model

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def test_short_soak_loses_nothing(tmp_path):
    save_random_hf_model("llama", tmp_path, max_position_embeddings=2048)
    proc = subprocess.run([sys.executable, str(SOAK), "--model", str(tmp_path), "--minutes", "0.3",
                           "--fault-every", "3", "--concurrency", "6", "--kv-cache-memory-bytes", str(1 << 20)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["ok"] and figures["lost"] == 0 and figures["kv_blocks_leaked"] == 0
    assert figures["finished"] > 0 and figures["aborted"] > 0 and figures["sent"] == sum(
        figures[k] for k in ("finished", "aborted", "failed", "lost"))
    assert [f.split(" ")[0] for f in figures["faults"]] == ["server", "burst", "20"]
    assert figures["fault_internal_error"] == figures["fault_requests"] == 8 and figures["fault_exit_code"] == 1

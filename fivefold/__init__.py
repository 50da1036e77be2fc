"""Fivefold: fast model inference along five levers, each gain measured.

``from fivefold import LLM, SamplingParams``. Heavy modules load on first use so
that ``fivefold --help`` stays fast.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from fivefold.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fivefold.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'fivefold' has no attribute '{name}'")

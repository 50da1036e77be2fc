"""Fivefold: fast model inference along five levers, each gain measured.

``from fivefold import LLM, SamplingParams`` (and ``StructuredOutputs``). Heavy modules load on first use so
that ``fivefold --help`` stays fast.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from fivefold.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputs"):
        from fivefold import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(f"module 'fivefold' has no attribute '{name}'")

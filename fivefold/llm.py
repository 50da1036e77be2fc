"""The Python entry point: ``from fivefold import LLM, SamplingParams``."""

from __future__ import annotations

from typing import Iterator, Sequence as Seq

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.engine.memory_plan import planned_form
from fivefold.engine.outputs import RequestOutput
from fivefold.models.loader import LoadedModel, load_model, parse_dtype
from fivefold.models.registry import DEFAULT_LLM
from fivefold.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # vLLM's forms: text, token ids, {"prompt": ...}, {"prompt_token_ids": [...]}


class LLM:
    """Offline generation on the continuous-batching engine.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str | LoadedModel = DEFAULT_LLM, dtype: str = "float32",
                 draft: LoadedModel | None = None, quantization: str | None = None, **engine_options) -> None:
        """``engine_options``: EngineConfig's fields (e.g. ``speculative="ngram"``). ``draft``: an
        already loaded draft model for ``speculative="draft"`` (else ``draft_model`` is loaded).
        ``quantization="w8a16"``: int8 weights quantized tensor by tensor while loading (as
        ``fivefold quantize --scheme w8a16`` writes them, without the float model in memory);
        ``"w4a16"``: 4-bit weights the same way (round to nearest, groups of 128 with a minimum);
        ``"w4a8"``: the same 4-bit weights times int8 activations (per row and block of 32, integer
        dot products: faster, 0.1-0.4% more held-out perplexity on SmolLM2); ``"gguf"``: a GGUF
        file's Q4_0/Q4_1 blocks served as they are, times int8 activations as llama.cpp does.

        Given a name or path, the engine owns the model: it is loaded tensor by tensor straight into
        the served layout (one copy of every weight). Given a :class:`LoadedModel`, the caller keeps
        its dense weights and the engine serves a packed view beside them."""
        config = EngineConfig.from_options(**engine_options)
        if isinstance(model, LoadedModel):
            if quantization is not None:
                from fivefold.errors import FivefoldError

                raise FivefoldError("quantization= applies while loading: pass a model name or path, or quantize "
                                    "the LoadedModel with fivefold.quant.quantize_")
            self.loaded = model
        else:  # refused before any weight is read when model + KV pool + runtime cannot fit in RAM
            torch_dtype = parse_dtype(dtype)
            self.loaded = load_model(model, torch_dtype, planned_form(model, torch_dtype, config, quantization),
                                     quantization=quantization, weight_layout=config.weight_layout)
        self.engine = LLMEngine(self.loaded, config, draft=draft)
        self.tokenizer = self.loaded.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        show_progress: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if not show_progress:
            return self.engine.run_to_completion(list(prompts), list(params))
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task("generating", total=len(prompts))
            return self.engine.run_to_completion(list(prompts), list(params), lambda _: progress.advance(task))

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation with the model's chat template and a generation prompt."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None) -> RequestOutput:
        return self.generate([self.chat_prompt(messages)], sampling_params)[0]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that added a token."""
        request_id = self.engine.add_request(prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

"""``/v1/embeddings`` for BERT-style encoders, through the dynamic batcher.

Each input of a request is queued on its own (so inputs of different requests share
batches) and the request answers when all of its inputs are embedded. Inputs: a
string, a list of strings, a list of token ids, or a list of token-id lists (token ids
are used as given: include [CLS] and [SEP]). ``encoding_format="base64"`` returns the
float32 little-endian bytes, base64-encoded, as OpenAI does. ``dimensions`` keeps the
first d components and re-normalises them (Matryoshka-style truncation; this model was
not trained for it, so quality drops as d shrinks, but the caller asked for it).
Errors: 400 for an empty or too-long input, too many inputs, bad token ids or a bad
``dimensions`` (each naming the limit); 413, 422, 429 and 503 as on the LLM server. An input
over the model's limit is cut instead when the request asks: vLLM's ``truncate_prompt_tokens``
(k tokens, or -1 for the limit) on /v1/embeddings, TEI's ``truncate`` on /embed; the end goes
and the closing [SEP] stays (right truncation, as sentence-transformers and TEI cut).

``POST /embed`` is TEI's: ``{"inputs": str | [str], "truncate", "normalize"}`` answers a JSON
list of vectors; ``normalize: false`` gives the pooled vectors as they are. /v1/embeddings
normalises as the model's sentence-transformers files say.
"""

from __future__ import annotations

import asyncio
import base64

import torch
from fastapi import FastAPI, Request

from fivefold.batching.batcher import DynamicBatcher
from fivefold.batching.config import BatcherConfig
from fivefold.batching.encoder import EncoderModel, measure_auto_delay
from fivefold.batching.metrics import BatcherMetrics
from fivefold.errors import FivefoldError
from fivefold.serve.config import DEFAULT_MAX_BODY_BYTES
from fivefold.serve.http_base import (
    APIError,
    await_unless_disconnected,
    build_base_app,
    check_model,
    registry_text,
)
from fivefold.serve.protocol import EmbeddingRequest, EmbedRequest

MAX_INPUTS_PER_REQUEST = 2048  # OpenAI's limit


def encode_vector(vector: torch.Tensor, dimensions: int | None, encoding: str):
    """One embedding as answered: cut to ``dimensions`` and re-normalised, as floats or base64."""
    if dimensions is not None and dimensions < vector.numel():
        vector = torch.nn.functional.normalize(vector[:dimensions], dim=0)
    if encoding == "base64":
        return base64.b64encode(vector.float().contiguous().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


class EmbeddingsAPI:
    """The embeddings surface over an encoder and its dynamic batcher."""

    def __init__(self, encoder: EncoderModel, batcher: DynamicBatcher, model_name: str) -> None:
        self.encoder, self.batcher, self.model_name = encoder, batcher, model_name

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/embeddings", self.embeddings, methods=["POST"])
        app.add_api_route("/embed", self.embed, methods=["POST"])

    def truncation(self, k: int | None, param: str) -> int | None:
        """Tokens to cut each input to (None: refuse long inputs), from truncate_prompt_tokens."""
        limit = self.encoder.max_length
        if k is None:
            return None
        if k == -1:
            return limit
        if not 1 <= k <= limit:
            raise APIError(400, f"{param} must be -1 or in [1, {limit}] (this model's limit), got {k}", param)
        return k

    def token_lists(self, raw, truncate_to: int | None = None) -> list[list[int]]:
        """The token ids of each input (400 naming the input that is empty or invalid), cut to
        ``truncate_to`` tokens when given."""
        if isinstance(raw, str):
            raw = [raw]
        elif raw and isinstance(raw[0], int):
            raw = [raw]
        if not raw:
            raise APIError(400, "input is empty; give a string, strings, or token ids", "input")
        if len(raw) > MAX_INPUTS_PER_REQUEST:
            raise APIError(400, f"{len(raw)} inputs in one request; the limit is {MAX_INPUTS_PER_REQUEST}", "input")
        lists = []
        for i, item in enumerate(raw):
            try:
                if isinstance(item, str):
                    if not item:
                        raise FivefoldError("input is an empty string")
                    lists.append(self.encoder.encode(item, truncate_to))
                else:
                    item = list(item)[:truncate_to] if truncate_to else list(item)
                    self.encoder.check_ids(item)
                    lists.append(item)
            except FivefoldError as exc:
                where = "" if len(raw) == 1 else f"input[{i}]: "
                raise APIError(400, f"{where}{exc}", "input") from None
        return lists

    async def embeddings(self, req: EmbeddingRequest, request: Request):
        check_model(req.model, self.model_name)
        hidden_size = self.encoder.hidden_size
        if req.dimensions is not None and not 1 <= req.dimensions <= hidden_size:
            raise APIError(400, f"dimensions must be in [1, {hidden_size}], got {req.dimensions}", "dimensions")
        lists = self.token_lists(req.input, self.truncation(req.truncate_prompt_tokens, "truncate_prompt_tokens"))
        vectors = await self.vectors(lists, request, self.encoder.normalize)
        num_tokens = sum(len(ids) for ids in lists)
        return {"object": "list", "model": self.model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": encode_vector(v, req.dimensions, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


    async def vectors(self, lists: list[list[int]], request: Request, normalize: bool) -> list[torch.Tensor]:
        """Each input's pooled vector through the batcher, L2-normalised when asked."""
        futures = [asyncio.wrap_future(f) for f in self.batcher.submit_many([(ids, len(ids)) for ids in lists])]
        try:
            vectors = await await_unless_disconnected(request, futures)
        except Exception:
            for f in futures:
                f.cancel()  # the request failed (e.g. one input timed out): drop its other inputs
            raise
        return [torch.nn.functional.normalize(v, dim=0) for v in vectors] if normalize else list(vectors)

    async def embed(self, req: EmbedRequest, request: Request):
        """TEI's /embed: a list of vectors, one per input."""
        inputs = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        if not inputs:
            raise APIError(400, "inputs is empty; give a string or strings", "inputs")
        lists = self.token_lists(inputs, self.encoder.max_length if req.truncate else None)
        return [v.tolist() for v in await self.vectors(lists, request, req.normalize)]


def build_embeddings_app(encoder: EncoderModel, batcher: DynamicBatcher, model_name: str, metrics_registry=None,
                         api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The embeddings server: the base app and ``/v1/embeddings``."""
    app = build_base_app(model_name, registry_text(metrics_registry), api_key, max_body_bytes,
                         is_healthy=lambda: batcher.is_running)
    EmbeddingsAPI(encoder, batcher, model_name).register(app)
    return app


def sample_ids(encoder: EncoderModel, num_tokens: int = 32) -> list[int]:
    """A ``num_tokens``-token input ([CLS] text [SEP]) cut from held-out text: the request the
    "auto" delay is measured on (a sentence; inputs run from a few words to a paragraph)."""
    from fivefold.eval.text import pydoc_text

    words = encoder.tokenizer.encode(pydoc_text("heldout")[:4000], add_special_tokens=False)[: num_tokens - 2]
    hf = encoder.tokenizer.hf
    return [hf.cls_token_id, *words, hf.sep_token_id]


def create_embeddings_server(path, config: BatcherConfig, model_name: str, api_key: str | None = None,
                             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log=None):
    """(app, batcher, delay in seconds): the encoder loaded, the delay resolved, the batcher running."""
    encoder = EncoderModel(path)
    delay = config.max_queue_delay
    if delay == "auto":
        delay = measure_auto_delay(encoder.embed, sample_ids(encoder), config.auto_delay_factor)
        if log is not None:
            log(f"fivefold: max_queue_delay auto = {config.auto_delay_factor} x single-request forward "
                f"({delay / config.auto_delay_factor * 1e3:.1f} ms) = {delay * 1e3:.1f} ms "
                "(--max-queue-delay SECONDS overrides)")
    metrics = BatcherMetrics(model_name)
    batcher = DynamicBatcher(encoder.pooled, config, delay, metrics.on_batch, metrics.on_reject)
    app = build_embeddings_app(encoder, batcher, model_name, metrics.registry, api_key, max_body_bytes)
    return app, batcher, delay

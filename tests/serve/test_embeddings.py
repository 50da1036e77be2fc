"""/v1/embeddings through the dynamic batcher, against transformers with the same weights."""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from fivefold.batching.batcher import DynamicBatcher
from fivefold.batching.config import BatcherConfig
from fivefold.batching.encoder import EncoderModel
from fivefold.eval.text import pydoc_text
from fivefold.models.registry import resolve_model_path
from fivefold.serve.embeddings import build_embeddings_app, create_embeddings_server
from tests.serve.conftest import running_server

NAME = "all-minilm-l6-v2"


def _sentences(num: int) -> list[str]:
    """Held-out text cut into inputs of 3 to 72 words, so that batches mix short and long ones."""
    words = pydoc_text("heldout").split()
    out, pos = [], 0
    for i in range(num):
        n = 3 + (i * 37) % 70
        out.append(" ".join(words[pos:pos + n]))
        pos += n
    return out


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' recipe with transformers: tokenize (max 256), mean-pool, normalise."""
    from transformers import AutoModel, AutoTokenizer

    path = resolve_model_path(NAME)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()

    def embed(texts):
        batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1), batch["attention_mask"]

    return embed


@pytest.mark.parametrize("max_batch_size", [1, 32])
def test_openai_client_embeddings_equal_transformers(reference, max_batch_size):
    from openai import OpenAI

    config = BatcherConfig(max_batch_size=max_batch_size, max_queue_delay=0.02)
    app, batcher, _ = create_embeddings_server(resolve_model_path(NAME), config, NAME)
    texts = _sentences(24)
    expected, mask = reference(texts)
    with running_server(app) as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        # 12 concurrent requests of 2 inputs each: with batching they share batches.
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda i: client.embeddings.create(model=NAME, input=texts[i:i + 2]),
                                    range(0, 24, 2)))
        one = client.embeddings.create(model=NAME, input=texts[5])
    got = torch.tensor([d.embedding for r in results for d in r.data])
    assert [d.index for d in results[0].data] == [0, 1]
    cosine = (got * expected).sum(-1)
    assert cosine.min().item() >= 0.99999, cosine.min()
    assert torch.tensor(one.data[0].embedding) @ expected[5] >= 0.99999
    assert sum(r.usage.prompt_tokens for r in results) == int(mask.sum())
    sizes = [r.size for r in batcher.history]
    assert max(sizes) == 1 if max_batch_size == 1 else max(sizes) > 1
    batcher.shutdown()


@pytest.fixture(scope="module")
def server():
    app, batcher, _ = create_embeddings_server(resolve_model_path(NAME), BatcherConfig(max_queue_delay=0.005), NAME,
                                               max_body_bytes=200_000)
    with running_server(app) as url:
        yield url, batcher
    batcher.shutdown()


def test_input_forms_base64_and_dimensions(server):
    url, _ = server
    text = "The quick brown fox jumps over the lazy dog."

    def post(**body):
        r = httpx.post(url + "/v1/embeddings", json={"model": NAME, **body}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    plain = np.array(post(input=text)["data"][0]["embedding"])
    packed = post(input=[text], encoding_format="base64")["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(packed), dtype="<f4"), plain.astype("<f4"))
    ids = EncoderModel(resolve_model_path(NAME)).encode(text)
    by_ids = post(input=ids)
    assert np.allclose(by_ids["data"][0]["embedding"], plain, atol=1e-6) and by_ids["usage"]["prompt_tokens"] == len(ids)
    assert len(post(input=[ids, ids])["data"]) == 2
    short = np.array(post(input=text, dimensions=64)["data"][0]["embedding"])
    assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.allclose(short, plain[:64] / np.linalg.norm(plain[:64]), atol=1e-6)


def test_bad_input_gets_openai_errors(server):
    url, _ = server
    cases = [({"input": ""}, 400, "input is an empty string"),
             ({"input": []}, 400, "input is empty"),
             ({"input": "word " * 400}, 400, "this model's limit is 256 tokens"),
             ({"input": ["ok", ""]}, 400, "input[1]: input is an empty string"),
             ({"input": [101, 99999, 102]}, 400, "token ids must be in [0, 30522)"),
             ({"input": "x", "dimensions": 0}, 400, "dimensions must be in [1, 384]"),
             ({"input": "x", "dimensions": 385}, 400, "dimensions must be in [1, 384]"),
             ({"input": "x", "model": "gpt"}, 404, "model 'gpt' is not served here"),
             ({"input": ["x"] * 2049}, 400, "the limit is 2048"),
             ({"input": "x", "encoding_format": "int8"}, 422, "encoding_format"),
             ({"input": {"a": 1}}, 422, "input")]
    for body, status, message in cases:
        r = httpx.post(url + "/v1/embeddings", json={"model": NAME, **body}, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert message in r.json()["error"]["message"], (body, r.json())
    big = httpx.post(url + "/v1/embeddings", content=b"x" * 300_000, headers={"content-type": "application/json"})
    assert big.status_code == 413 and "the limit is 200000 bytes" in big.json()["error"]["message"]


def test_metrics_carry_the_batcher(server):
    url, batcher = server
    httpx.post(url + "/v1/embeddings", json={"input": ["a b c", "d e f g"]}, timeout=30).raise_for_status()
    text = httpx.get(url + "/metrics").text
    for name in ("fivefold:batch_size_bucket", "fivefold:batch_tokens_bucket", "fivefold:batch_padding_efficiency",
                 "fivefold:request_queue_time_seconds", "fivefold:batch_execution_seconds",
                 "fivefold:batch_real_tokens_total", "fivefold:batch_padded_tokens_total"):
        assert name in text, name
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == NAME


def test_overload_is_429_and_queue_timeout_503():
    encoder = EncoderModel(resolve_model_path(NAME))
    gate, started = threading.Event(), threading.Event()

    def held(batch):
        started.set()
        gate.wait(20)
        return encoder.embed(batch)

    batcher = DynamicBatcher(held, BatcherConfig(max_queue_delay=0.0, max_queued_requests=1, request_timeout=0.5))
    app = build_embeddings_app(encoder, batcher, NAME)
    with running_server(app) as url, ThreadPoolExecutor(2) as pool:
        post = lambda body: httpx.post(url + "/v1/embeddings", json=body, timeout=30)  # noqa: E731
        running = pool.submit(post, {"input": "first"})
        assert started.wait(10)  # the worker holds "first" at the gate
        queued = pool.submit(post, {"input": "second"})  # waits in the queue
        while batcher.num_queued < 1:
            time.sleep(0.01)
        refused = post({"input": "third"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "the limit is 1 (max_queued_requests)" in refused.json()["error"]["message"]
        timed_out = queued.result(10)
        assert timed_out.status_code == 503 and "request_timeout" in timed_out.json()["error"]["message"]
        gate.set()
        assert running.result(20).status_code == 200
    batcher.shutdown()


def test_fivefold_serve_runs_an_encoder_with_auto_delay():
    from tests.serve.conftest import serve_process

    with serve_process("--model", NAME, "--max-batch-size", "16") as (proc, url):
        r = httpx.post(url + "/v1/embeddings", json={"input": ["hello world", "a second input"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        assert len(r.json()["data"][0]["embedding"]) == 384
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 404
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "max_queue_delay auto = 0.3 x single-request forward" in err
    bad = subprocess.run([sys.executable, "-m", "fivefold", "serve", "--model", NAME, "--max-queue-delay", "soon"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --max-queue-delay must be 'auto' or seconds, got 'soon'"


def test_truncation_when_asked_and_tei_embed(server):
    """vLLM's truncate_prompt_tokens and TEI's /embed with truncate: a long input is cut (its end,
    the closing [SEP] kept) and embedded as the cut text is, instead of refused; /embed answers
    TEI's list of vectors, normalised unless normalize is false."""
    url, _ = server
    encoder = EncoderModel(resolve_model_path(NAME))
    long_text = "word " * 400
    cut = encoder.encode(long_text, truncate_to=256)
    assert len(cut) == 256 and cut[0] == encoder.tokenizer.hf.cls_token_id and cut[-1] == encoder.tokenizer.hf.sep_token_id
    want = torch.nn.functional.normalize(encoder.pooled([cut])[0], dim=0)

    def post(path, body):
        r = httpx.post(url + path, json=body, timeout=60)
        return r.status_code, r.json()

    for k in (-1, 256):
        status, body = post("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": k})
        assert status == 200 and body["usage"]["prompt_tokens"] == 256
        assert np.allclose(body["data"][0]["embedding"], want.numpy(), atol=1e-5)
    status, body = post("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 16})
    assert status == 200 and body["usage"]["prompt_tokens"] == 16
    status, body = post("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 300})
    assert status == 400 and "truncate_prompt_tokens must be -1 or in [1, 256]" in body["error"]["message"]

    status, body = post("/embed", {"inputs": [long_text, "short one"], "truncate": True})
    assert status == 200 and len(body) == 2 and np.allclose(body[0], want.numpy(), atol=1e-5)
    status, body = post("/embed", {"inputs": long_text})
    assert status == 400 and "this model's limit is 256 tokens" in body["error"]["message"]
    _, normalised = post("/embed", {"inputs": "short one"})
    _, raw = post("/embed", {"inputs": "short one", "normalize": False})
    assert abs(np.linalg.norm(normalised[0]) - 1) < 1e-5 and abs(np.linalg.norm(raw[0]) - 1) > 1e-3
    assert np.allclose(np.array(raw[0]) / np.linalg.norm(raw[0]), normalised[0], atol=1e-6)

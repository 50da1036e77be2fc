"""``fivefold bench serve``: a load generator for any OpenAI-compatible server.

Open loop (Poisson arrivals at ``--request-rate``) or closed loop (``--max-concurrency``
clients, each sending its next request when the last one finished). Every request streams
``--endpoint`` (/v1/completions, or /v1/chat/completions with the prompt as one user message)
with ``ignore_eos`` (vLLM's field) so output lengths are the ones asked for, and the API key of
``--api-key`` (default $OPENAI_API_KEY); TTFT, TPOT (mean time per output token after the
first), ITL (every gap between chunks) and E2E latency are measured on the client.

Prompts: synthetic token ids (``random``, ``shared-prefix``: ids drawn from the vocabulary of
``--tokenizer``, else below 49152, SmolLM2's; completions only), pydoc text, or
``--dataset-path``: a JSONL file (one object per line with ``prompt`` or ``text``, or
``messages``, whose first user message is taken) or a ShareGPT JSON (a list of
``{"conversations": [{"from": "human", "value": ...}, ...]}``: each first human turn). Prompt
tokens are counted with ``--tokenizer`` (a model name or directory) when given, else by the
server's ``/tokenize`` before the run, else from the stream's usage.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from fivefold.serve.metrics import latency_stats

DATASETS = ("random", "shared-prefix", "pydoc")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def load_pydoc_tokenizer():
    """The built-in model's tokenizer (the pydoc dataset's token ids are its)."""
    from fivefold.models.gguf_file import open_gguf
    from fivefold.models.registry import resolve_model_path
    from fivefold.models.tokenizer import load_gguf_tokenizer

    path = resolve_model_path("smollm2-135m-instruct")
    return load_gguf_tokenizer(path, open_gguf(path))


def make_prompts(dataset: str, num: int, input_len: int, seed: int, vocab_size: int = 49152,
                 num_prefixes: int = 1) -> list[list[int]]:
    """Token-id prompts (sent as token ids, so no tokenizer is needed on the client).

    shared-prefix: ``num_prefixes`` distinct prefixes (system prompts) of 3/4 of
    ``input_len``; each request takes one at random and adds its own tokens."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size - 100) for _ in range(n)]

    if dataset == "random":
        return [tokens(input_len) for _ in range(num)]
    if dataset == "shared-prefix":
        prefixes = [tokens(input_len * 3 // 4) for _ in range(num_prefixes)]
        return [p + tokens(input_len - len(p)) for p in (rng.choice(prefixes) if num_prefixes > 1 else prefixes[0] for _ in range(num))]
    if dataset == "pydoc":  # the default model's tokenizer over pydoc_data's English
        from fivefold.eval.text import corpus_ids

        ids = corpus_ids(load_pydoc_tokenizer())
        starts = [rng.randrange(0, len(ids) - input_len) for _ in range(num)]
        return [ids[s:s + input_len] for s in starts]
    raise ValueError(f"dataset must be one of {', '.join(DATASETS)}")


def read_dataset(path: str, num: int, seed: int) -> list[str]:
    """``num`` text prompts from a JSONL or ShareGPT file (see the top), drawn in a seeded order,
    cycling when the file has fewer; one line naming the problem when it has none."""
    from pathlib import Path

    from fivefold.errors import FivefoldError

    file = Path(path)
    if not file.is_file():
        raise FivefoldError(f"--dataset-path: no such file {path}")
    text = file.read_text(encoding="utf-8", errors="replace")
    prompts: list[str] = []
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:  # JSONL
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise FivefoldError(f"--dataset-path {path}: line {i} is not JSON") from None
    for row in rows:
        if not isinstance(row, dict):
            continue
        if isinstance(row.get("conversations"), list):  # ShareGPT
            turn = next((t for t in row["conversations"] if isinstance(t, dict) and t.get("from") in ("human", "user")), None)
            value = turn.get("value") if turn else None
        elif isinstance(row.get("messages"), list):
            turn = next((m for m in row["messages"] if isinstance(m, dict) and m.get("role") == "user"), None)
            value = turn.get("content") if turn else None
        else:
            value = row.get("prompt", row.get("text"))
        if isinstance(value, str) and value.strip():
            prompts.append(value)
    if not prompts:
        raise FivefoldError(f"--dataset-path {path}: no prompts found (JSONL with prompt/text/messages, or ShareGPT "
                            "conversations with a human turn)")
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(num)]


def request_body(endpoint: str, model: str, prompt: list[int] | str, output_len: int) -> dict:
    """The streaming request of one prompt for ``endpoint``."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if endpoint == "/v1/chat/completions":
        return body | {"messages": [{"role": "user", "content": prompt}]}
    return body | {"prompt": prompt}


def chunk_text(event: dict) -> str:
    """The new text of a completions or chat stream chunk."""
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def count_with_server(client, url: str, model: str, endpoint: str, prompts: list) -> list[int] | None:
    """Prompt tokens as the server's /tokenize counts them (vLLM's and fivefold's shape: a prompt
    or chat messages -> {"count"}), or None where the server has no /tokenize."""
    counts = []
    for prompt in prompts:
        body = {"model": model} | ({"messages": [{"role": "user", "content": prompt}]}
                                   if endpoint == "/v1/chat/completions" else {"prompt": prompt})
        try:
            r = await client.post(url + "/tokenize", json=body)
        except Exception:
            return None
        if r.status_code != 200 or "count" not in r.json():
            return None
        counts.append(int(r.json()["count"]))
    return counts


async def _one(client, url: str, model: str, prompt: list[int] | str, output_len: int,
               endpoint: str = "/v1/completions", prompt_tokens: int | None = None) -> RequestResult:
    body = request_body(endpoint, model, prompt, output_len)
    start = time.perf_counter()
    result = RequestResult(ok=False, prompt_tokens=prompt_tokens if prompt_tokens is not None else
                           len(prompt) if isinstance(prompt, list) else 0)
    last = None
    try:
        async with client.stream("POST", url + endpoint, json=body,
                                 headers={"Cache-Control": "no-cache"}) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    if prompt_tokens is None and isinstance(prompt, str):  # no tokenizer, no /tokenize
                        result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                if not event.get("choices") or not chunk_text(event):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens == output_len
        if not result.ok:
            result.error = f"got {result.output_tokens} tokens, asked {output_len}"
    except Exception as exc:  # a failed request is counted, never fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(url: str, model: str, prompts: list, output_len: int, request_rate: float | None,
                   max_concurrency: int | None, seed: int, progress=None, endpoint: str = "/v1/completions",
                   api_key: str | None = None, prompt_tokens: list[int] | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Every prompt (token ids, or text) through ``endpoint``; prompt_tokens: their counts (None:
    /tokenize, else the stream's usage)."""
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max(64, max_concurrency or 0) + 16)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
        if prompt_tokens is None and any(isinstance(p, str) for p in prompts):
            prompt_tokens = await count_with_server(client, url, model, endpoint, prompts)
        counts = prompt_tokens or [None] * len(prompts)
        start = time.perf_counter()
        if max_concurrency:
            pending = list(zip(prompts, counts))
            results: list[RequestResult] = []

            async def worker():
                while pending:
                    prompt, count = pending.pop(0)
                    r = await _one(client, url, model, prompt, output_len, endpoint, count)
                    results.append(r)
                    if progress:
                        progress()

            await asyncio.gather(*(worker() for _ in range(max_concurrency)))
        else:
            async def delayed(delay: float, prompt, count):
                await asyncio.sleep(delay)
                r = await _one(client, url, model, prompt, output_len, endpoint, count)
                if progress:
                    progress()
                return r

            t, tasks = 0.0, []
            for prompt, count in zip(prompts, counts):
                tasks.append(asyncio.ensure_future(delayed(t, prompt, count)))
                t += rng.expovariate(request_rate) if request_rate else 0.0
            results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], elapsed: float, slo: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if r.ttft <= slo.get("ttft", float("inf")) and r.tpot <= slo.get("tpot", float("inf"))]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed, "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / elapsed,
        "goodput_req_s": len(good) / elapsed if slo else None,
        "ttft_s": latency_stats([r.ttft for r in ok]), "tpot_s": latency_stats([r.tpot for r in ok]),
        "itl_s": latency_stats([x for r in ok for x in r.itls]), "e2e_s": latency_stats([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "samples": {"ttft_s": [r.ttft for r in ok], "e2e_s": [r.e2e for r in ok]},  # for the latency CDF
    }


def parse_slo(text: str | None) -> dict[str, float]:
    from fivefold.errors import FivefoldError

    slo = {}
    for part in (text or "").split(","):
        if not part:
            continue
        name, _, value = part.partition("=")
        if name not in ("ttft", "tpot") or not value:
            raise FivefoldError(f"--slo takes ttft=SECONDS,tpot=SECONDS; got '{part}'")
        slo[name] = float(value)
    return slo


def main(args) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from fivefold.errors import FivefoldError

    if (args.request_rate is None) == (args.max_concurrency is None):
        raise FivefoldError("give exactly one of --request-rate R or --max-concurrency C")
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        raise FivefoldError("--num-requests, --input-len and --output-len must be >= 1")
    slo = parse_slo(args.slo)
    if args.num_prefixes < 1:
        raise FivefoldError(f"--num-prefixes must be >= 1, got {args.num_prefixes}")
    if args.endpoint not in ENDPOINTS:
        raise FivefoldError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {args.endpoint}")
    tokenizer = None
    if args.tokenizer:
        from fivefold.models.loader import load_tokenizer

        tokenizer, _ = load_tokenizer(args.tokenizer)
    if args.dataset_path:
        prompts = read_dataset(args.dataset_path, args.num_requests, args.seed)
    else:
        vocab = tokenizer.vocab_size if tokenizer is not None else 49152
        prompts = make_prompts(args.dataset, args.num_requests, args.input_len, args.seed, vocab_size=vocab,
                               num_prefixes=args.num_prefixes)
        if args.endpoint == "/v1/chat/completions":
            if args.dataset != "pydoc":
                raise FivefoldError("--endpoint /v1/chat/completions sends text: use --dataset pydoc or --dataset-path")
            decoder = load_pydoc_tokenizer()  # pydoc's ids are the built-in model's
            prompts = [decoder.decode(p) for p in prompts]
    counts = None
    if tokenizer is not None and isinstance(prompts[0], str):
        counts = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    url = args.url.rstrip("/").removesuffix("/v1")
    with Progress(transient=True) as bar:
        task = bar.add_task("requests", total=len(prompts))
        results, elapsed = asyncio.run(run_load(url, args.model, prompts, args.output_len, args.request_rate,
                                                args.max_concurrency, args.seed, lambda: bar.advance(task),
                                                args.endpoint, args.api_key, counts))
    summary = summarize(results, elapsed, slo)
    mode = f"rate {args.request_rate}/s" if args.request_rate else f"concurrency {args.max_concurrency}"
    ok = [r for r in results if r.ok]
    mean_in = sum(r.prompt_tokens for r in ok) / max(1, len(ok))
    source = args.dataset_path or args.dataset
    table = Table(title=f"{args.endpoint}, {source}, {args.num_requests} requests, {mean_in:.0f} in (mean) / "
                        f"{args.output_len} out, {mode}")
    for col in ("metric", "mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = summary[name]
        table.add_row(name.removesuffix("_s") + " (ms)", *(f"{s[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99")))
    console = Console(width=120)
    console.print(table)
    console.print(f"completed {summary['completed']}, failed {summary['failed']} in {elapsed:.1f} s: "
                  f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} output tok/s"
                  + (f", goodput {summary['goodput_req_s']:.2f} req/s" if slo else ""))
    config = {"url": url, "model": args.model, "endpoint": args.endpoint,
              "dataset": args.dataset_path or args.dataset, "num_requests": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len, "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, "seed": args.seed, "slo": args.slo}
    from fivefold.bench.report import record_run

    record_run(args.registry, "bench serve", config, {k: v for k, v in summary.items() if k != "errors"}, console)
    print(json.dumps({"benchmark": "serve", **config, **summary}))
    return 0 if summary["completed"] else 1

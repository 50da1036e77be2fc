"""``fivefold bench serve``: a load generator for any OpenAI-compatible server.

Open loop (Poisson arrivals at ``--request-rate``) or closed loop (``--max-concurrency``
clients, each sending its next request when the last one finished). Every request
streams /v1/completions with ``ignore_eos`` so output lengths are the ones asked for;
TTFT, TPOT (mean time per output token after the first), ITL (every gap between
chunks) and E2E latency are measured on the client.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from fivefold.bench.report import latency_stats

DATASETS = ("random", "shared-prefix", "pydoc")


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
        from fivefold.models.gguf_file import open_gguf
        from fivefold.models.registry import resolve_model_path
        from fivefold.models.tokenizer import load_gguf_tokenizer

        path = resolve_model_path("smollm2-135m-instruct")
        tok = load_gguf_tokenizer(path, open_gguf(path))
        ids = corpus_ids(tok)
        starts = [rng.randrange(0, len(ids) - input_len) for _ in range(num)]
        return [ids[s:s + input_len] for s in starts]
    raise ValueError(f"dataset must be one of {', '.join(DATASETS)}")


async def _one(client, url: str, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
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
                if not event.get("choices") or not event["choices"][0].get("text"):
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


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, request_rate: float | None,
                   max_concurrency: int | None, seed: int, progress=None) -> tuple[list[RequestResult], float]:
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=max(64, max_concurrency or 0) + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        if max_concurrency:
            pending = list(prompts)
            results: list[RequestResult] = []

            async def worker():
                while pending:
                    r = await _one(client, url, model, pending.pop(0), output_len)
                    results.append(r)
                    if progress:
                        progress()

            await asyncio.gather(*(worker() for _ in range(max_concurrency)))
        else:
            async def delayed(delay: float, prompt):
                await asyncio.sleep(delay)
                r = await _one(client, url, model, prompt, output_len)
                if progress:
                    progress()
                return r

            t, tasks = 0.0, []
            for prompt in prompts:
                tasks.append(asyncio.ensure_future(delayed(t, prompt)))
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
    prompts = make_prompts(args.dataset, args.num_requests, args.input_len, args.seed,
                           num_prefixes=args.num_prefixes)
    url = args.url.rstrip("/").removesuffix("/v1")
    with Progress(transient=True) as bar:
        task = bar.add_task("requests", total=len(prompts))
        results, elapsed = asyncio.run(run_load(url, args.model, prompts, args.output_len, args.request_rate,
                                                args.max_concurrency, args.seed, lambda: bar.advance(task)))
    summary = summarize(results, elapsed, slo)
    mode = f"rate {args.request_rate}/s" if args.request_rate else f"concurrency {args.max_concurrency}"
    table = Table(title=f"{args.dataset}, {args.num_requests} requests, {args.input_len} in / {args.output_len} out, {mode}")
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
    config = {"url": url, "model": args.model, "dataset": args.dataset, "num_requests": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len, "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, "seed": args.seed, "slo": args.slo}
    from fivefold.bench.report import record_run

    record_run(args.registry, "bench serve", config, {k: v for k, v in summary.items() if k != "errors"}, console)
    print(json.dumps({"benchmark": "serve", **config, **summary}))
    return 0 if summary["completed"] else 1

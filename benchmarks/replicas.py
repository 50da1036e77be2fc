"""Routing across replicas: prefix-aware vs round-robin, 2 replicas on Ray Serve.

The shared-prefix dataset with several distinct system prompts (``--num-prefixes``,
each 3/4 of ``--input-len``; every request takes one at random and adds its own
tokens) is sent to ``fivefold serve --replicas 2`` once per routing policy, each on a
fresh cluster (cold prefix caches), closed loop at ``--concurrency``. Each replica's KV
pool (``--kv-cache-memory-bytes``) holds only some of the prefixes, as a real replica's does
under load: the question is whether routing keeps each prefix on one replica.

Reported per policy, from the replicas' own metrics: the prefix-cache hit rate (prompt
tokens served from cache / prompt tokens), the prefill tokens computed and saved, and
how requests split over the replicas; from the client: TTFT. The hit rate and the
prefill tokens saved are what carries over to a real cluster. The latency does not: on
this 2-core machine both replicas share the CPU (one thread each), so it is reported
for what it is.

    .venv/bin/python benchmarks/replicas.py [--num-requests 48] [--num-prefixes 8] [--input-len 416]
        [--output-len 16] [--concurrency 4] [--kv-cache-memory-bytes 134217728] [--policies round-robin,prefix-aware]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from fivefold.bench.report import json_line, results_table  # noqa: E402
from fivefold.serve.metrics import latency_stats  # noqa: E402
from fivefold.bench.serve_bench import make_prompts, run_load  # noqa: E402
from fivefold.bench.server_process import serve_process  # noqa: E402
from fivefold.models.registry import DEFAULT_LLM  # noqa: E402
from fivefold.serve.cluster import metric_by_replica  # noqa: E402


def run_policy(args, policy: str, prompts: list[list[int]], progress) -> dict:
    log = Path(tempfile.mkdtemp()) / f"serve-{policy}.log"
    with serve_process("--model", args.model, "--replicas", str(args.replicas), "--routing", policy,
                       "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--result-cache-entries", "0",
                       timeout=600, log_path=log) as (_, url):
        task = progress.add_task(f"{policy}", total=len(prompts))
        results, elapsed = asyncio.run(run_load(url, args.model, prompts, args.output_len, None, args.concurrency,
                                                seed=0, progress=lambda: progress.advance(task)))
        text = httpx.get(url + "/metrics").text
    queries = metric_by_replica(text, "fivefold:prefix_cache_queries_total")
    hits = metric_by_replica(text, "fivefold:prefix_cache_hits_total")
    routed = metric_by_replica(text, "fivefold:replica_requests_total")
    ok = [r for r in results if r.ok]
    num_queries, num_hits = sum(queries.values()), sum(hits.values())
    return {"policy": policy, "completed": len(ok), "failed": len(results) - len(ok),
            "prompt_tokens": int(num_queries), "prefill_tokens_saved": int(num_hits),
            "prefill_tokens_computed": int(num_queries - num_hits),
            "hit_rate": num_hits / num_queries if num_queries else 0.0,
            "hit_rate_by_replica": {r: hits.get(r, 0) / q if q else 0.0 for r, q in sorted(queries.items())},
            "requests_by_replica": {r: int(n) for r, n in sorted(routed.items())},
            "ttft_s": latency_stats([r.ttft for r in ok]), "duration_s": elapsed,
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policies", default="round-robin,prefix-aware")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=416, help="prompt tokens: 3/4 system prompt, 1/4 own")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=128 << 20, help="KV pool bytes per replica")
    args = ap.parse_args()
    from rich.console import Console
    from rich.progress import Progress

    prompts = make_prompts("shared-prefix", args.num_requests, args.input_len, seed=0, num_prefixes=args.num_prefixes)
    runs = []
    with Progress(transient=True) as progress:
        for policy in args.policies.split(","):
            runs.append(run_policy(args, policy, prompts, progress))
    rows = [(r["policy"], f"{r['completed']}/{r['completed'] + r['failed']}", f"{r['hit_rate']:.1%}",
             " / ".join(f"{v:.0%}" for v in r["hit_rate_by_replica"].values()),
             f"{r['prefill_tokens_computed']}", f"{r['prefill_tokens_saved']}",
             " / ".join(str(v) for v in r["requests_by_replica"].values()),
             f"{r['ttft_s']['mean']:.2f}", f"{r['ttft_s']['p50']:.2f}", f"{r['ttft_s']['p99']:.2f}",
             f"{r['duration_s']:.1f}") for r in runs]
    prefix_len = args.input_len * 3 // 4
    console = Console(width=150)
    console.print(results_table(
        f"{args.replicas} replicas, {args.num_requests} requests over {args.num_prefixes} system prompts of "
        f"{prefix_len} tokens (+{args.input_len - prefix_len} own), {args.output_len} out, concurrency "
        f"{args.concurrency}, KV pool {args.kv_cache_memory_bytes >> 20} MiB per replica",
        ("routing", "ok", "prefix hit rate", "per replica", "prefill computed", "prefill saved", "requests",
         "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "total s"), rows))
    summary = {"benchmark": "replicas", "model": args.model, "config": {k: v for k, v in vars(args).items()},
               "runs": runs}
    by_policy = {r["policy"]: r for r in runs}
    if {"round-robin", "prefix-aware"} <= set(by_policy):
        rr, pa = by_policy["round-robin"], by_policy["prefix-aware"]
        summary["prefill_computed_ratio_rr_over_pa"] = rr["prefill_tokens_computed"] / max(1, pa["prefill_tokens_computed"])
        summary["ttft_mean_ratio_rr_over_pa"] = rr["ttft_s"]["mean"] / max(1e-9, pa["ttft_s"]["mean"])
        console.print(f"prefix-aware vs round-robin: hit rate {pa['hit_rate']:.1%} vs {rr['hit_rate']:.1%}; "
                      f"round-robin computes {summary['prefill_computed_ratio_rr_over_pa']:.2f}x the prefill tokens; "
                      f"mean TTFT ratio (round-robin / prefix-aware) {summary['ttft_mean_ratio_rr_over_pa']:.2f}x "
                      "(both replicas share 2 cores here)")
    print(json_line(summary))


if __name__ == "__main__":
    main()

"""Soak: N minutes of mixed, hostile and faulty traffic against `fivefold serve`; nothing may be
lost, nothing may hang, no KV block may leak.

    .venv/bin/python benchmarks/soak.py [--minutes 2] [--model smollm2-135m-instruct] [--concurrency 8]

The server runs with a small KV pool (``--kv-cache-memory-bytes``, default 24 MiB: 33 blocks of 16
tokens for SmolLM2, so sequences are preempted), ``--max-num-seqs 8``, a queue limit and a
queue timeout. Traffic (seeded): completions and chat, streamed and not, greedy and sampled,
stop strings, ``n=2`` now and then, prompts that share a long prefix (the prefix cache) and
repeated greedy requests (the result cache). A quarter of the requests are aborted by their
client (a stream closed after a few chunks, a plain request given up after 0.2-3 s), and 5%
are hostile: bad bodies, grammars that fail midway or cost seconds a token, malformed schemas,
work multipliers (``--no-hostile``: none, the baseline for inter-token latency). Every ``--fault-every`` seconds one fault, in turn: the server process
frozen (SIGSTOP) for 3 s; a burst of 40 requests past the queue limit (429s); 20 slow clients
that open a connection, send half a request and hold it for 10 s.

Then the traffic drains and ``/metrics`` must show no request running or waiting and no KV
block held. Last, an engine fault is injected (the engine's ``step`` raises, through a
wrapper around the same CLI) while 8 requests are in flight: each must get a 500
``internal_error`` (a stream: an error event) and the process must exit with status 1.

Each request ends as one of: finished (a whole answer), aborted (by its client, on purpose),
failed (an OpenAI error body: 4xx/5xx, or a stream's error event) or lost (anything else: no
answer within ``--request-timeout``, a connection error, an error without a body, a stream
without ``[DONE]``). Prints a table and one JSON line; exits 1 when a request was lost, a
block leaked, or the fault was not handled as the README says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAULT_FLAG = "--serve-with-fault-file"
ABORT_RATE, HOSTILE_RATE = 0.25, 0.05
STOPS = ["\n\n", ". ", "the", ",", "\n", "is"]
HOSTILE = [
    {"prompt": "x", "temperature": -1},
    {"prompt": "x", "max_tokens": 10**9},
    {"prompt": "", "max_tokens": 4},
    {"prompt": "x", "seed": 2**64},
    {"prompt": "x", "stop": [""]},
    {"prompt": {"not": "a prompt"}},
    {"prompt": [10**9]},
    {"messages": []},
]
# Issue 34's hostile cases: grammars that fail midway or cost seconds a token (each ends at its
# limit or its budget, alone), malformed constraints, and work multipliers (logprobs x n x prompts,
# a prompt of ~600 KB to tokenize). Each must end as a 4xx naming its cause, nothing else slowed.
AMBIGUOUS = ('start: s\ns: s s | "a" | "b" | ' + " | ".join(f"t{k}" for k in range(60)) + "\n"
             + "".join(f"t{k}: s s\n" for k in range(60)))
HOSTILE_GRAMMAR = [
    {"prompt": "x", "max_tokens": 100, "guided_grammar": AMBIGUOUS, "logit_bias": {"64": -100, "65": -100}},
    {"prompt": "x", "max_tokens": 400, "temperature": 1.0, "guided_grammar":
        'start: s\ns: s s s | s s | "a" | "b" | "ab" | "ba"\n'},
    {"prompt": "x", "max_tokens": 8, "guided_json": "5"},
    {"prompt": "x", "max_tokens": 8, "guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}}}},
    {"prompt": "x", "max_tokens": 8, "guided_grammar": "start: " + "(" * 400},
]
AMPLIFY = [
    {"prompt": ["word " * 500] * 64, "echo": True, "logprobs": 20, "max_tokens": 0, "n": 16},
    {"prompt": "word " * 120_000, "max_tokens": 4},
    {"prompt": [], "max_tokens": 4, "stream": True},
]
HOSTILE = HOSTILE + HOSTILE_GRAMMAR + AMPLIFY


def _serve_with_fault(trigger: str, argv: list[str]) -> int:
    """The ``fivefold serve`` CLI, with the engine's step raising once ``trigger`` exists."""
    from fivefold.cli import main
    from fivefold.engine.llm_engine import LLMEngine

    real_step, path = LLMEngine.step, Path(trigger)

    def step(self):
        if path.exists():
            raise RuntimeError("injected fault (benchmarks/soak.py)")
        return real_step(self)

    LLMEngine.step = step
    return main(argv)


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # finished / aborted / failed / lost
    failed_by_status: Counter = field(default_factory=Counter)
    lost_details: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    itls: list = field(default_factory=list)  # gaps between a normal stream's events (inter-token latency)

    def merge(self, other: Tally) -> None:
        self.sent += other.sent
        self.outcomes += other.outcomes
        self.failed_by_status += other.failed_by_status
        self.lost_details += other.lost_details
        self.latencies += other.latencies
        self.itls += other.itls

    def record(self, outcome: str, detail=None, latency: float | None = None) -> None:
        self.outcomes[outcome] += 1
        if outcome == "failed":
            self.failed_by_status[str(detail)] += 1
        elif outcome == "lost":
            self.lost_details.append(str(detail)[:200])
        if latency is not None:
            self.latencies.append(latency)


class Traffic:
    """The seeded request mix (see the module doc)."""

    def __init__(self, model: str, seed: int, hostile_rate: float = HOSTILE_RATE) -> None:
        from pydoc_data.topics import topics

        self.model, self.hostile_rate = model, hostile_rate
        self.texts = [t for t in topics.values() if len(t) > 600]
        rng = random.Random(seed)
        self.prefixes = [rng.choice(self.texts)[:700] for _ in range(3)]
        self.repeats = [{"model": model, "prompt": f"Explain briefly: {rng.choice(self.texts)[:200]}",
                         "max_tokens": 16, "temperature": 0} for _ in range(5)]

    def make(self, rng: random.Random) -> tuple[str, dict, bool, float | int | None, bool]:
        """(endpoint, body, stream, abort_after, is_hostile); abort_after: chunks when streaming, else seconds."""
        if rng.random() < self.hostile_rate:
            body = dict(rng.choice(HOSTILE), model=self.model)
            return ("chat/completions" if "messages" in body else "completions"), body, False, None, True
        if rng.random() < 0.1:  # the same greedy request again: the result cache answers it
            return "completions", dict(rng.choice(self.repeats)), rng.random() < 0.5, None, False
        text = rng.choice(self.texts)
        start = rng.randrange(len(text) - 500)
        prompt = text[start:start + rng.randint(20, 400)]
        if rng.random() < 0.3:
            prompt = rng.choice(self.prefixes) + prompt
        body = {"model": self.model, "max_tokens": rng.randint(1, 64), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.4:
            body["temperature"] = 0
        else:
            body |= {"temperature": rng.uniform(0.5, 1.0), "top_p": rng.choice([1.0, 0.9]), "top_k": rng.choice([0, 20])}
            if rng.random() < 0.3:
                body["seed"] = rng.randrange(1000)
        if rng.random() < 0.3:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.1:
            body["n"] = 2
        if rng.random() < 0.3:
            endpoint, body["messages"] = "chat/completions", [{"role": "user", "content": prompt}]
        else:
            endpoint, body["prompt"] = "completions", prompt
        stream = rng.random() < 0.5
        abort_after = None
        if rng.random() < ABORT_RATE:
            abort_after = rng.randint(1, 5) if stream else rng.uniform(0.2, 3.0)
        return endpoint, body, stream, abort_after, False


def _error_of(text: str) -> str | None:
    """The OpenAI error body's message, or None when ``text`` is not one."""
    try:
        error = json.loads(text)["error"]
        return error["message"] if isinstance(error, dict) and error.get("message") else None
    except (ValueError, KeyError, TypeError):
        return None


async def one_request(client, url: str, endpoint: str, body: dict, stream: bool, abort_after, tally: Tally,
                      timeout: float, headers: dict | None = None, is_hostile: bool = False) -> str:
    """Send one request and record how it ended; return the outcome (``failed 429``: over the queue limit)."""
    import httpx

    tally.sent += 1
    start = time.monotonic()
    target = f"{url}/v1/{endpoint}"

    async def plain():
        reply = await client.post(target, json={"stream": False} | body, headers=headers)
        if reply.status_code == 200:
            choices = reply.json().get("choices", [])
            return ("finished", None) if len(choices) == body.get("n", 1) else ("lost", f"{len(choices)} choices")
        return ("failed", reply.status_code) if _error_of(reply.text) else ("lost", f"{reply.status_code} no body")

    async def streamed():
        async with client.stream("POST", target, json=body | {"stream": True}, headers=headers) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode()
                return ("failed", reply.status_code) if _error_of(text) else ("lost", f"{reply.status_code} no body")
            num_chunks, error, last = 0, None, None
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if last is not None and not is_hostile:
                    tally.itls.append(now - last)
                last = now
                if line == "data: [DONE]":
                    return ("failed", f"stream {error}") if error else ("finished", None)
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("type", "error")
                num_chunks += 1
                if abort_after is not None and num_chunks >= abort_after:
                    return "aborted", None  # leaving the block closes the connection: the server aborts
            return ("failed", f"stream {error}") if error else ("lost", "stream ended without [DONE]")

    try:
        if not stream and abort_after is not None:
            try:
                outcome, detail = await asyncio.wait_for(plain(), abort_after)
            except asyncio.TimeoutError:
                outcome, detail = "aborted", None
        else:
            outcome, detail = await asyncio.wait_for(streamed() if stream else plain(), timeout)
    except asyncio.TimeoutError:
        outcome, detail = "lost", f"no answer in {timeout:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:
        outcome, detail = "lost", f"{type(exc).__name__}: {exc}"
    tally.record(outcome, detail, time.monotonic() - start if outcome == "finished" else None)
    return f"{outcome} {detail}"


async def freeze(pid: int, seconds: float = 3.0) -> str:
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return f"server frozen {seconds:.0f} s"


async def burst(client, url: str, model: str, tally: Tally, timeout: float, n: int = 40) -> str:
    own = Tally()
    await asyncio.gather(*[one_request(client, url, "completions", {
        "model": model, "prompt": f"Burst {i}: the", "max_tokens": 4, "temperature": 0}, False, None, own, timeout,
        headers={"Cache-Control": "no-cache"}) for i in range(n)])
    tally.merge(own)
    return f"burst of {n}: {own.failed_by_status['429']} x 429"


async def slow_clients(port: int, n: int = 20, hold: float = 10.0) -> str:
    conns = []
    for _ in range(n):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"prompt\": \"half a bo")
        await writer.drain()
        conns.append(writer)
    await asyncio.sleep(hold)
    for writer in conns:
        writer.close()
    return f"{n} slow clients held {hold:.0f} s"


def metric_values(text: str) -> dict[str, float]:
    """Sum of each metric's samples over their labels, from a Prometheus exposition."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def inject_engine_fault(client, url: str, model: str, trigger: Path, proc, timeout: float) -> dict:
    """8 requests in flight (4 streams that have had their first chunk), then the step raises:
    each must get internal_error, and the process must exit 1."""
    results: list[tuple[int, str]] = []
    num_streaming = asyncio.Semaphore(0)

    async def long_request(stream: bool):
        body = {"model": model, "prompt": "Count slowly: one, two,", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0.8, "stream": stream}
        if stream:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
                first = True
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        results.append((reply.status_code, json.loads(line[6:])["error"]["type"]))
                        return
                    if first and line.startswith("data: "):
                        first = False
                        num_streaming.release()
                results.append((reply.status_code, "no error event"))
        else:
            reply = await client.post(f"{url}/v1/completions", json=body)
            results.append((reply.status_code, (reply.json().get("error") or {}).get("type", "no error")))

    tasks = [asyncio.ensure_future(long_request(i % 2 == 0)) for i in range(8)]
    for _ in range(4):  # every stream is decoding (a fast model would finish 400 tokens in a second)
        await asyncio.wait_for(num_streaming.acquire(), timeout)
    trigger.touch()
    start = time.monotonic()
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    answered = time.monotonic() - start
    for task in pending:
        task.cancel()
    try:
        exit_code = await asyncio.get_running_loop().run_in_executor(None, lambda: proc.wait(60))
    except subprocess.TimeoutExpired:  # still running: reported, and the check fails
        exit_code = None
    exited = time.monotonic() - start
    num_internal = sum(1 for status, kind in results if status in (200, 500) and kind == "internal_error")
    return {"fault_requests": len(tasks), "fault_internal_error": num_internal, "fault_unanswered": len(pending),
            "fault_answer_s": round(answered, 2), "fault_exit_code": exit_code, "fault_exit_s": round(exited, 2)}


async def soak(args, proc, url: str, trigger: Path) -> dict:
    import httpx
    from rich.progress import Progress

    from fivefold.serve.metrics import latency_stats

    traffic = Traffic(args.model, args.seed, 0.0 if args.no_hostile else HOSTILE_RATE)
    tally = Tally()
    faults: list[str] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        rss_start = rss_mib(proc.pid)
        end = time.monotonic() + args.minutes * 60

        async def worker(index: int):
            rng = random.Random(args.seed * 1000 + index)
            while time.monotonic() < end:
                endpoint, body, stream, abort_after, is_hostile = traffic.make(rng)
                outcome = await one_request(client, url, endpoint, body, stream, abort_after, tally,
                                            args.request_timeout, is_hostile=is_hostile)
                if outcome == "failed 429":
                    await asyncio.sleep(1.0)  # Retry-After, as a well-behaved client does

        async def fault_loop():
            kinds = ["freeze", "burst", "slow"]
            i = 0
            while time.monotonic() + args.fault_every < end:
                await asyncio.sleep(args.fault_every)
                kind = kinds[i % len(kinds)]
                i += 1
                if kind == "freeze":
                    faults.append(await freeze(proc.pid))
                elif kind == "burst":
                    faults.append(await burst(client, url, args.model, tally, args.request_timeout))
                else:
                    faults.append(await slow_clients(int(url.rsplit(":", 1)[1])))

        async def progress_loop():
            with Progress() as progress:
                task = progress.add_task("soak", total=args.minutes * 60)
                while time.monotonic() < end:
                    progress.update(task, completed=args.minutes * 60 - (end - time.monotonic()),
                                    description=f"soak: {tally.sent} sent, {tally.outcomes['lost']} lost")
                    await asyncio.sleep(1.0)
                progress.update(task, completed=args.minutes * 60)

        await asyncio.gather(*[worker(i) for i in range(args.concurrency)], fault_loop(), progress_loop())
        # Drained: nothing may still run, wait, or hold a block.
        deadline, values = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            values = metric_values((await client.get(url + "/metrics")).text)
            if values.get("fivefold:num_requests_running", 1) == 0 and values.get("fivefold:num_requests_waiting", 1) == 0:
                break
            await asyncio.sleep(0.5)
        rss_end = rss_mib(proc.pid)
        figures = {
            "minutes": args.minutes, "sent": tally.sent, **{k: tally.outcomes[k] for k in ("finished", "aborted", "failed", "lost")},
            "failed_by_status": dict(tally.failed_by_status), "lost_details": tally.lost_details[:10],
            "running_after": values.get("fivefold:num_requests_running"),
            "waiting_after": values.get("fivefold:num_requests_waiting"),
            "kv_blocks_leaked": values.get("fivefold:kv_cache_used_blocks"),
            "kv_num_blocks": values.get("fivefold:kv_cache_num_blocks"),
            "preemptions": values.get("fivefold:num_preemptions_total"),
            "prefix_cache_hit_tokens": values.get("fivefold:prefix_cache_hits_total"),
            "result_cache_hits": values.get("fivefold:result_cache_hits_total"),
            "latency_p50_s": round(latency_stats(tally.latencies)["p50"], 3),
            "latency_p99_s": round(latency_stats(tally.latencies)["p99"], 3),
            "itl_p50_ms": round(1000 * latency_stats(tally.itls)["p50"], 1) if tally.itls else None,
            "itl_p99_ms": round(1000 * latency_stats(tally.itls)["p99"], 1) if tally.itls else None,
            "alive_at_end": proc.poll() is None and (await client.get(url + "/health")).status_code == 200,
            "server_rss_mib_start": round(rss_start, 1), "server_rss_mib_end": round(rss_end, 1),
            "faults": faults,
        }
        figures |= await inject_engine_fault(client, url, args.model, trigger, proc, args.request_timeout)
    return figures


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == FAULT_FLAG:
        return _serve_with_fault(sys.argv[2], sys.argv[3:])
    from rich.console import Console

    from fivefold.bench.report import json_line, results_table
    from fivefold.bench.server_process import serve_process
    from fivefold.models.registry import DEFAULT_LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0, help="traffic duration (at most 60)")
    ap.add_argument("--model", default=DEFAULT_LLM)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=24 << 20)
    ap.add_argument("--fault-every", type=float, default=45.0, help="seconds between injected faults")
    ap.add_argument("--request-timeout", type=float, default=180.0, help="a request unanswered this long is lost")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-hostile", action="store_true",
                    help="no hostile requests: the baseline the hostile soak's inter-token latency is compared to")
    args = ap.parse_args()
    if not 0 < args.minutes <= 60:
        print(f"error: --minutes must be in (0, 60], got {args.minutes}", file=sys.stderr)
        return 2
    console = Console(width=120)
    with tempfile.TemporaryDirectory() as tmp:
        trigger = Path(tmp) / "fault"
        log = Path(tmp) / "serve.log"
        server_args = ["--model", args.model, "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--max-num-seqs", "8",
                       "--max-queued-requests", "24", "--queue-timeout", "60", "--shutdown-grace", "5"]
        launcher = [sys.executable, str(Path(__file__).resolve()), FAULT_FLAG, str(trigger)]
        with serve_process(*server_args, timeout=300, log_path=log, launcher=launcher) as (proc, url):
            figures = asyncio.run(soak(args, proc, url, trigger))
        server_log = log.read_text()
    ok = (figures["lost"] == 0 and figures["kv_blocks_leaked"] == 0 and figures["running_after"] == 0
          and figures["alive_at_end"]
          and figures["fault_internal_error"] == figures["fault_requests"] and figures["fault_exit_code"] == 1)
    rows = [(k, str(v)) for k, v in figures.items() if k not in ("lost_details",)]
    console.print(results_table(f"soak: {args.minutes:g} min against fivefold serve ({args.model})", ("", "value"), rows))
    for detail in figures["lost_details"]:
        console.print(f"[red]lost: {detail}[/red]")
    if not ok:
        console.print(f"[red]FAILED[/red]; server log tail:\n{server_log[-2000:]}")
    print(json_line({"benchmark": "soak", "model": args.model, "ok": ok, **figures}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

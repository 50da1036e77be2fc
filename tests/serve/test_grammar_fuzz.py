"""Grammar fuzz (issue 34): a seeded generator of Lark grammars and JSON schemas, recursive,
ambiguous, deep, huge and invalid, sent to the running server each with a normal request beside
it. The engine never dies, every hostile request gets an answer (200, or an OpenAI-shaped 4xx/5xx
naming its cause) and every normal request completes with its tokens."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fivefold.engine.config import EngineConfig
from fivefold.engine.llm_engine import LLMEngine
from fivefold.serve.app import build_app
from fivefold.serve.async_engine import AsyncEngine
from tests.serve.conftest import running_server

NUM_CASES = 240
BUDGET_S = 0.5
NORMAL = {"model": "smol", "prompt": "Count: one, two,", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _literal(rng: random.Random) -> str:
    return json.dumps("".join(rng.choice("ab{}[]\"\\ x1é") for _ in range(rng.randint(1, 3))))


def ambiguous_grammar(rng: random.Random) -> str:
    """``s: s s | ...``: every parse tree of a string, the kind that made llguidance refuse a token."""
    k = rng.randint(1, 80)
    alternatives = [" ".join(["s"] * rng.randint(2, 3)) for _ in range(rng.randint(1, 3))]
    alternatives += [_literal(rng) for _ in range(rng.randint(1, 4))] + [f"t{i}" for i in range(k)]
    rules = "".join(f"t{i}: {' '.join(['s'] * rng.randint(1, 3))} | {_literal(rng)}\n" for i in range(k))
    return f"start: s\ns: {' | '.join(alternatives)}\n{rules}"


def deep_grammar(rng: random.Random) -> str:
    depth = rng.randint(10, 400)
    rules = [f"r{i}: r{i + 1} {_literal(rng)} | {_literal(rng)}" for i in range(depth)]
    return "start: r0\n" + "\n".join(rules) + f"\nr{depth}: {_literal(rng)}\n"


def huge_grammar(rng: random.Random) -> str:
    n = rng.randint(200, 3000)
    return "start: " + " | ".join(f"w{i}" for i in range(n)) + "\n" + \
        "".join(f"w{i}: {json.dumps('x' * rng.randint(1, 12) + str(i))}\n" for i in range(n))


def regex_grammar(rng: random.Random) -> str:
    return "start: " + rng.choice([r"/(a|aa)*b/", r"/((a|b)*)*c/", r"/[a-z]{1,200}/", r"/(.*)(.*)(.*)x/",
                                   r"/a{0,1000}/", r"/[\u0000-\uffff]{5}/"]) + "\n"


def invalid_grammar(rng: random.Random) -> str:
    return rng.choice(["", "start:", "start: undefined_rule", 'start: "unterminated', "start: /[/", "s: s s",
                       "start: s\ns: s", "start: %json {", "%import nothing\nstart: x", "start: " + "(" * 500,
                       "start: " + "a" * 10_000, 'start: "a"{1000000}', "\x00", "start: %json " + "[" * 300])


def _schema(rng: random.Random, depth: int, width: int = 3) -> dict:
    """A random schema ``depth`` levels deep with up to ``width`` properties an object (keep width 1
    for deep ones: the size grows as width ** depth)."""
    if depth <= 0 or rng.random() < 0.2:
        return rng.choice([{"type": "string", "maxLength": 5}, {"type": "integer"}, {"enum": [1, "a", None]},
                           {"type": "boolean"}, {"$ref": "#"}, {"type": "string", "pattern": "(a|aa)*b"}])
    if rng.random() < 0.5:
        return {"type": "object", "properties": {f"p{i}": _schema(rng, depth - 1, width)
                                                 for i in range(rng.randint(1, width))}, "required": ["p0"]}
    return {"type": "array", "items": _schema(rng, depth - 1, width), "maxItems": rng.randint(0, 3)}


def random_schema(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:  # deep, sometimes past the nesting limit
        return _schema(rng, rng.randint(20, 90), width=1)
    if kind == 1:  # recursive
        return {"type": "object", "properties": {"next": {"$ref": "#"}, "v": {"type": "integer"}}, "required": ["v"]}
    if kind == 2:  # huge
        return {"type": "object", "properties": {f"k{i}": {"enum": [f"v{j}" for j in range(rng.randint(1, 60))]}
                                                 for i in range(rng.randint(50, 400))}}
    if kind == 3:  # invalid
        return rng.choice(["5", "true", "null", "[1, 2]", '{"type": "nonsense"}', '{"$ref": "#/nowhere"}',
                           '{"type": "string", "pattern": "[("}', '{"minimum": "x", "type": "integer"}', "{",
                           '{"anyOf": []}', '{"type": ["string", 5]}'])
    if kind == 4:  # ambiguous alternatives
        return {"anyOf": [_schema(rng, 3) for _ in range(rng.randint(2, 30))]}
    return _schema(rng, rng.randint(1, 6))


def fuzz_case(rng: random.Random) -> dict:
    family = rng.choice(["ambiguous", "deep", "huge", "regex", "invalid", "schema", "schema"])
    body = {"model": "smol", "prompt": rng.choice(["Hi", "JSON:", "a b a"]), "max_tokens": rng.randint(1, 60),
            "temperature": rng.choice([0, 0.7, 1.5]), "seed": rng.randint(0, 99)}
    if rng.random() < 0.2:
        body["logit_bias"] = {str(rng.randrange(49152)): rng.choice([-100, 100]) for _ in range(2)}
    if family == "schema":
        schema = random_schema(rng)
        body["guided_json"] = schema
    else:
        body["guided_grammar"] = {"ambiguous": ambiguous_grammar, "deep": deep_grammar, "huge": huge_grammar,
                                  "regex": regex_grammar, "invalid": invalid_grammar}[family](rng)
    assert len(json.dumps(body)) < 4 << 20  # the generator's own bound (the server's limit is 1 MB: 413 above it)
    return {"family": family, "body": body}


@pytest.fixture(scope="module")
def server(smollm2):
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(kv_cache_memory_bytes=96 << 20, grammar_budget_s=BUDGET_S)))
    engine.engine.warm_up_structured_output()
    with running_server(build_app(engine, "smol", max_body_bytes=1 << 20)) as url:
        yield url, engine
    engine.shutdown()


def test_random_grammars_and_schemas_never_stop_the_engine(server):
    url, engine = server
    rng = random.Random(34)
    cases = [fuzz_case(rng) for _ in range(NUM_CASES)]
    outcomes: dict[str, int] = {}
    slowest = 0.0

    def run(case):
        with httpx.Client(timeout=120) as client:
            started = time.monotonic()
            hostile = client.post(f"{url}/v1/completions", json=case["body"])
            return case, hostile, time.monotonic() - started

    def normal(_):
        with httpx.Client(timeout=120) as client:
            return client.post(f"{url}/v1/completions", json=NORMAL)

    with ThreadPoolExecutor(6) as pool:
        hostile_answers = pool.map(run, cases)
        normal_answers = pool.map(normal, range(NUM_CASES))
        for (case, r, seconds), n in zip(hostile_answers, normal_answers):
            slowest = max(slowest, seconds)
            outcome = f"{case['family']}:{r.status_code}"
            if r.status_code != 200:
                error = r.json().get("error")
                assert isinstance(error, dict) and error.get("message") and error.get("type"), (case, r.text[:300])
                outcome += f":{error.get('code')}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            assert r.status_code in (200, 400, 413), (case, r.status_code, r.text[:300])
            assert n.status_code == 200 and n.json()["usage"]["completion_tokens"] == NORMAL["max_tokens"], n.text
            assert engine.is_running
    print(f"\n{NUM_CASES} fuzz cases, slowest hostile answer {slowest:.1f} s (budget {BUDGET_S} s):")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {outcome:40s} {count}")
    assert sum(outcomes.values()) == NUM_CASES
    assert any(o.endswith("grammar_error") for o in outcomes)  # the budget and the limits were reached
    assert not engine.engine.requests and engine.engine.kv_cache.num_used_blocks == 0

"""``fivefold profile``: where the time goes and which lever to pull."""

from __future__ import annotations

import sys

from fivefold.errors import FivefoldError
from fivefold.models.registry import DEFAULT_LLM


def add_parser(sub) -> None:
    """``fivefold profile``'s arguments."""
    prof = sub.add_parser("profile", help="where the time goes, memory- or compute-bound, which lever to pull")
    prof.add_argument("--model", default=DEFAULT_LLM)
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    prof.add_argument("--mode", default="decode", choices=["prefill", "decode"])
    prof.add_argument("--batch", type=int, default=1, help="sequences per step")
    prof.add_argument("--seq", type=int, default=128, help="prompt (prefill) or context (decode) tokens")
    prof.add_argument("--iterations", type=int, default=4, help="engine steps profiled")
    prof.add_argument("--structured-output", default="none", choices=["none", "json"],
                      help="decode: constrain every sequence by a JSON schema (the grammar mask's cost per step "
                           "shows in the sampling category)")
    prof.add_argument("--trace", default=None, help="Chrome trace path (default .fivefold/trace-MODE.json)")
    prof.add_argument("--server", default=None, help="a running fivefold server's URL: apply the batching rule "
                      "to its /metrics")
    prof.add_argument("--max-num-seqs", type=int, default=64, help="the server's max_num_seqs (with --server)")
    prof.add_argument("--json", action="store_true", help="also print the report as one JSON line")


def run(args) -> int:
    import json as _json
    import urllib.request

    from rich.console import Console

    from fivefold.models import load_model
    from fivefold.profile.llm_profile import profile_llm
    from fivefold.profile.verdict import server_verdict

    loaded = load_model(args.model, args.dtype)
    trace = args.trace or f".fivefold/trace-{args.mode}.json"
    report = profile_llm(loaded, args.mode, args.batch, args.seq, args.iterations, trace_path=trace,
                         structured_output=args.structured_output)
    if args.server:
        url = args.server.rstrip("/").removesuffix("/v1") + "/metrics"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
        except OSError as exc:
            raise FivefoldError(f"cannot read {url}: {exc}") from None
        verdict = server_verdict(text, args.max_num_seqs)
        if verdict is not None:
            report.verdicts.insert(0, verdict)
        else:
            print(f"server {args.server}: no requests waiting, so no batching verdict", file=sys.stderr)
    report.render(Console(width=150))
    if args.json:
        print(_json.dumps(report.to_dict(), default=str))
    return 0

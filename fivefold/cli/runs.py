"""``fivefold runs``: the run registry."""

from __future__ import annotations

import time

from fivefold.errors import FivefoldError


def add_parser(sub) -> None:
    """``fivefold runs``'s arguments."""
    runs = sub.add_parser("runs", help="the run registry: list, show, compare, baseline, rollback")
    runs.add_argument("--registry", default=".fivefold/runs.db")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    runs_sub.add_parser("list")
    show = runs_sub.add_parser("show")
    show.add_argument("id", type=int)
    cmp_ = runs_sub.add_parser("compare")
    cmp_.add_argument("a", type=int)
    cmp_.add_argument("b", type=int)
    base = runs_sub.add_parser("baseline", help="show the baselines, or 'baseline set ID'")
    base.add_argument("action", nargs="?", choices=["set"])
    base.add_argument("id", type=int, nargs="?")
    rb = runs_sub.add_parser("rollback", help="write a run's configuration as a recipe file")
    rb.add_argument("id", type=int)
    rb.add_argument("--out", default=None, help="recipe path (default recipe-ID.json)")
    plot = runs_sub.add_parser("plot", help="throughput vs request rate and the latency CDF, as a PNG")
    plot.add_argument("ids", type=int, nargs="*", help="runs to draw (default: all)")
    plot.add_argument("--out", default=".fivefold/runs.png")


def run(args) -> int:
    import json as _json

    from fivefold.bench.registry import RunRegistry

    registry = RunRegistry(args.registry)
    if args.runs_command == "list":
        for run in registry.list():
            print(f"{run.id:4d}  {time.strftime('%Y-%m-%d %H:%M', time.localtime(run.created))}  {run.name:14s}  "
                  f"{(run.git_commit or '-')[:10]}  {_json.dumps(run.config, sort_keys=True)[:80]}")
    elif args.runs_command == "show":
        run = registry.get(args.id)
        print(_json.dumps(run.__dict__, indent=2, sort_keys=True, default=str))
    elif args.runs_command == "compare":
        from fivefold.bench.report import print_comparison

        print_comparison(registry, args.a, args.b)
    elif args.runs_command == "plot":
        from fivefold.bench.plots import plot_runs

        runs = [registry.get(i) for i in args.ids] if args.ids else registry.list()
        print(f"wrote {plot_runs(runs, args.out)}")
    elif args.runs_command == "baseline":
        if args.action == "set":
            if args.id is None:
                raise FivefoldError("usage: fivefold runs baseline set ID")
            registry.set_baseline(args.id)
            print(f"run {args.id} is the baseline of '{registry.get(args.id).name}'")
        else:
            for run in registry.list():
                base = registry.baseline(run.name)
                if base is not None and base.id == run.id:
                    print(f"{run.name}: run {run.id}")
    elif args.runs_command == "rollback":
        path = registry.rollback(args.id, args.out or f"recipe-{args.id}.json")
        print(f"wrote {path}")
    return 0

"""``fivefold distill``: the distillation job (fivefold/jobs/compress.py)."""

from __future__ import annotations

from fivefold.errors import FivefoldError


def add_parser(sub) -> None:
    """``fivefold distill``'s arguments."""
    ds = sub.add_parser("distill", help="knowledge distillation into a smaller student, measured against the teacher")
    ds.add_argument("--teacher", default="digits-resnet",
                    help="digits-resnet (student: half width) or an LLM (student: every other layer)")
    ds.add_argument("--out", required=True)
    ds.add_argument("--steps", type=int, default=0, help="training steps (0: 12 epochs for digits, 40 for LLMs)")
    ds.add_argument("--alpha", type=float, default=0.7, help="weight of the soft targets (1 - alpha: hard labels)")
    ds.add_argument("--t-start", type=float, default=4.0)
    ds.add_argument("--t-end", type=float, default=1.0)
    ds.add_argument("--schedule", default="cosine", choices=["constant", "linear", "cosine"])
    ds.add_argument("--num-eval", type=int, default=8)
    ds.add_argument("--window", type=int, default=256)
    ds.add_argument("--lr", type=float, default=None,
                    help="learning rate (default: the digits recipe's 3e-3; 5e-4 for an LLM student)")


def run(args) -> int:
    from rich.console import Console

    from fivefold.jobs.compress import DistillJob, run_distill

    if args.steps < 0 or args.num_eval < 1 or args.window < 2:
        raise FivefoldError("--steps must be >= 0, --num-eval >= 1 and --window >= 2")
    run_distill(DistillJob(args.teacher, args.out, args.steps, args.alpha, args.t_start, args.t_end, args.schedule,
                           args.num_eval, args.window, args.lr), Console(width=140))
    return 0

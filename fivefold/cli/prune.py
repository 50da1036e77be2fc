"""``fivefold prune``: the pruning job (fivefold/jobs/compress.py)."""

from __future__ import annotations

from fivefold.errors import FivefoldError


def add_parser(sub) -> None:
    """``fivefold prune``'s arguments."""
    pr = sub.add_parser("prune", help="structured (or unstructured) pruning, measured against the original, "
                                      "written as a model directory")
    pr.add_argument("--model", default="digits-resnet", help="digits-resnet, or an LLM (built-in name, HF dir, GGUF)")
    pr.add_argument("--out", required=True, help="output directory")
    pr.add_argument("--ratio", type=float, default=None,
                    help="digits: channels removed per group (default 0.5); LLM: MLP neurons (default 0.25)")
    pr.add_argument("--importance", default=None, choices=["l1", "l2", "bn", "taylor", "activation"],
                    help="digits: l1 (default), l2, bn, taylor; LLM: activation (default), l2, taylor")
    pr.add_argument("--finetune-epochs", type=int, default=5, help="digits: fine-tuning after pruning")
    pr.add_argument("--iterative", action="store_true", help="digits: raise the ratio until --budget is crossed")
    pr.add_argument("--budget", type=float, default=1.0, help="digits: accuracy points the schedule may lose")
    pr.add_argument("--sensitivity", action="store_true", help="digits: per-group scan, table + sensitivity.json")
    pr.add_argument("--unstructured", type=float, default=None, metavar="SPARSITY",
                    help="digits: global magnitude pruning to this sparsity instead of channels")
    pr.add_argument("--attention-groups", type=int, default=0, help="LLM: KV groups removed per layer")
    pr.add_argument("--heal-steps", type=int, default=0, help="LLM: token-level KD steps from the original")
    pr.add_argument("--num-calibration", type=int, default=8, help="LLM: calibration windows for importance")
    pr.add_argument("--num-eval", type=int, default=8, help="LLM: held-out windows for perplexity")
    pr.add_argument("--window", type=int, default=256)


def run(args) -> int:
    from rich.console import Console

    from fivefold.jobs.compress import DIGITS, PruneJob, run_prune

    if min(args.finetune_epochs, args.num_calibration, args.num_eval, args.window, args.heal_steps,
           args.attention_groups) < 0 or min(args.num_calibration, args.num_eval, args.window) < 1:
        raise FivefoldError("--num-calibration, --num-eval and --window must be >= 1; epochs, steps and groups >= 0")
    ratio = args.ratio if args.ratio is not None else (0.5 if args.model == DIGITS else 0.25)
    run_prune(PruneJob(args.model, args.out, ratio, args.importance, args.finetune_epochs, args.iterative,
                       args.budget, args.sensitivity, args.unstructured, args.attention_groups, args.heal_steps,
                       args.num_calibration, args.num_eval, args.window), Console(width=140))
    return 0

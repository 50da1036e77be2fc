"""``fivefold prune`` and ``fivefold distill``: compress a model, measure it against the original,
write a model directory with ``report.json``.

Models: ``digits-resnet`` (the digits ResNet, trained here first: the original) and any
Llama-family LLM (built-in name, HF directory or GGUF). A pruned or distilled LLM is
written as a Hugging Face directory that ``fivefold generate/serve`` and transformers
load; a digits model as ``model.pt`` (the module, a pickle: load only directories you
made) with ``load_compressed``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.errors import FivefoldError

DIGITS = "digits-resnet"


@dataclass(frozen=True)
class PruneJob:
    model: str
    out_dir: str
    ratio: float = 0.5  # digits: channels per group; LLM: MLP neurons
    importance: str | None = None  # None: l1 (digits), activation (LLM)
    finetune_epochs: int = 5
    iterative: bool = False
    budget: float = 1.0  # points of calibration accuracy the iterative schedule may lose
    sensitivity: bool = False
    unstructured: float | None = None  # digits: global magnitude sparsity instead of channels
    attention_groups: int = 0  # LLM: KV groups removed per layer
    heal_steps: int = 0  # LLM: token-level KD steps from the original after pruning
    num_calibration: int = 8
    num_eval: int = 8
    window: int = 256


@dataclass(frozen=True)
class DistillJob:
    teacher: str
    out_dir: str
    steps: int = 0  # 0: a default per model
    alpha: float = 0.7
    t_start: float = 4.0
    t_end: float = 1.0
    schedule: str = "cosine"
    num_eval: int = 8
    window: int = 256
    # None: the digits recipe's DistillConfig lr, or for an LLM student 5e-4 (dropping half the
    # layers is a large change: SmolLM2's student reached held-out ppl 223 in 60 steps at 5e-4,
    # 15,556 in 40 at the pruning heal's 3e-5)
    lr: float | None = None


def load_compressed(directory: str | Path):
    path = Path(directory) / "model.pt"
    if not path.exists():
        raise FivefoldError(f"{path} does not exist: not a digits directory written by fivefold prune/distill")
    return torch.load(path, weights_only=False)


def _write(out_dir: str, report: dict, model=None, loaded=None) -> Path:
    from fivefold.compress.llm_prune import save_hf_directory

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if loaded is not None:
        save_hf_directory(loaded, out)
    if model is not None:
        torch.save(model, out / "model.pt")
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return out


def _digits_rows(pairs, data) -> list[dict]:
    from fivefold.jobs.digits_report import add_latencies, measure

    rows = [measure(name, model, data) for name, model in pairs]
    add_latencies(rows, data.test[0][:1])
    for row in rows:
        row.pop("model")
    return rows


def print_rows(console, title: str, rows: list[dict]) -> None:
    from fivefold.jobs.report import results_table
    from fivefold.jobs.llm_report import print_llm_rows

    if "test_accuracy" not in rows[0]:
        return print_llm_rows(console, title, rows)
    console.print(results_table(title, ("variant", "params", "MFLOPs", "latency us", "speed-up", "test acc %"),
                                [(r["variant"], f"{r['parameters']:,}", f"{r['mflops']:.1f}",
                                  f"{r['latency_us']:.0f}", f"{r['speedup']:.2f}x", f"{r['test_accuracy']:.2f}")
                                 for r in rows]))


def _train_digits_teacher(log):
    from fivefold.jobs.digits_report import DigitsPlan
    from fivefold.models.cnn import DigitsResNet
    from fivefold.eval.digits import load_digits_split, train

    plan = DigitsPlan()
    torch.manual_seed(0)
    data = load_digits_split()
    log(f"training the original: DigitsResNet width {plan.width}, {plan.epochs} epochs")
    return train(DigitsResNet(plan.width), data.train, plan.epochs), data, plan


def run_prune(job: PruneJob, console) -> dict:
    if not 0 <= job.ratio < 1:
        raise FivefoldError(f"--ratio must be in [0, 1), got {job.ratio}")
    if job.model == DIGITS:
        return _prune_digits(job, console)
    return _prune_llm(job, console)


def _prune_digits(job: PruneJob, console) -> dict:
    from fivefold.jobs.digits_report import iterative_prune
    from fivefold.compress.pruning_sensitivity import pruning_sensitivity_scan, save_pruning_scan
    from fivefold.jobs.report import scan_table
    from fivefold.compress.structured import prune_channels
    from fivefold.compress.unstructured import magnitude_prune_, remove_masks_
    from fivefold.eval.digits import accuracy, train

    if job.attention_groups or job.heal_steps:
        raise FivefoldError("--attention-groups and --heal-steps apply to LLMs, not digits-resnet")
    original, data, plan = _train_digits_teacher(console.print)
    x = data.calibration[0][:1]
    importance = job.importance or "l1"
    scan = None
    if job.sensitivity:
        scan = pruning_sensitivity_scan(original, (x,), lambda m: accuracy(m, data.calibration),
                                        importance=importance)
        console.print(scan_table(scan, "calibration accuracy drop when one channel group alone is pruned"))
    if job.unstructured is not None:
        pruned = copy.deepcopy(original)
        magnitude_prune_(pruned, job.unstructured, "global")
        pruned = train(pruned, data.train, job.finetune_epochs, lr=plan.finetune_lr)
        remove_masks_(pruned)
        name = f"unstructured {job.unstructured:.0%} + fine-tune"
    elif job.iterative:
        plan = dataclasses.replace(plan, ratio=job.ratio, budget_points=job.budget,
                                   finetune_epochs=job.finetune_epochs)
        pruned, final, _ = iterative_prune(original, data, plan, console.print)
        if pruned is None:
            raise FivefoldError(f"already the first step ({job.ratio:.0%}) loses more than {job.budget} points; "
                                "lower --ratio or raise --budget")
        name = f"iterative, stopped at {final:.0%} channels"
    else:
        loss_fn = (lambda m: torch.nn.functional.cross_entropy(m(data.calibration[0]), data.calibration[1]))
        pruned = prune_channels(original, (x,), job.ratio, importance, loss_fn=loss_fn)
        pruned = train(pruned, data.train, job.finetune_epochs, lr=plan.finetune_lr)
        name = f"{job.ratio:.0%} channels ({importance}) + fine-tune"
    rows = _digits_rows([("original", original), (name, pruned)], data)
    print_rows(console, f"{DIGITS}: pruned vs original (test split, batch 1)", rows)
    report = {"model": DIGITS, "job": dataclasses.asdict(job), "rows": rows}
    out = _write(job.out_dir, report, model=pruned)
    if scan is not None:
        save_pruning_scan(scan, out / "sensitivity.json")
    torch.save(original.state_dict(), out / "original_state_dict.pt")  # the regression baseline
    return report


def _prune_llm(job: PruneJob, console) -> dict:
    from fivefold.compress.llm_prune import prune_attention_groups_, prune_mlp_neurons_
    from fivefold.compress.llm_prune import kd_heal_
    from fivefold.jobs.llm_report import llm_rows
    from fivefold.models import load_model
    from fivefold.eval.text import text_windows

    if job.unstructured is not None or job.iterative or job.sensitivity:
        raise FivefoldError("--unstructured, --iterative and --sensitivity apply to digits-resnet; "
                            "for LLMs use --ratio (MLP neurons) and --attention-groups")
    original = load_model(job.model, "float32")
    calibration = text_windows(original.tokenizer, "calibration", max(job.num_calibration, job.heal_steps, 1),
                               job.window)
    heldout = text_windows(original.tokenizer, "heldout", job.num_eval, job.window)
    pruned = prune_mlp_neurons_(copy.deepcopy(original), job.ratio, job.importance or "activation",
                                calibration[: job.num_calibration])
    if job.attention_groups:
        pruned = prune_attention_groups_(pruned, job.attention_groups)
    if job.heal_steps:
        kd_heal_(pruned, original, calibration, job.heal_steps, log=console.print)
    name = f"{job.ratio:.0%} MLP neurons" + (f", {job.attention_groups} KV groups" if job.attention_groups else "") + \
        (f" + KD heal ({job.heal_steps} steps)" if job.heal_steps else "")
    rows = llm_rows([("original", original), (name, pruned)], heldout)
    print_rows(console, f"{job.model}: pruned vs original ({job.num_eval} held-out windows)", rows)
    report = {"model": job.model, "job": dataclasses.asdict(job), "rows": rows}
    _write(job.out_dir, report, loaded=pruned)
    return report


LLM_STUDENT_LR = 5e-4


def run_distill(job: DistillJob, console) -> dict:
    from fivefold.compress.distill import DistillConfig

    config = DistillConfig(steps=max(1, job.steps or 1), alpha=job.alpha, t_start=job.t_start, t_end=job.t_end,
                           schedule=job.schedule, **({} if job.lr is None else {"lr": job.lr}))  # validates the flags
    if job.teacher == DIGITS:
        from fivefold.jobs.digits_report import epoch_steps, train_batches
        from fivefold.compress.distill import distill
        from fivefold.models.cnn import DigitsResNet

        teacher, data, plan = _train_digits_teacher(console.print)
        steps = job.steps or epoch_steps(data, plan.epochs)
        batches = train_batches(data)

        console.print(f"distilling a half-width student: {steps} steps, T {job.t_start} -> {job.t_end} "
                      f"({job.schedule}), alpha {job.alpha}")
        from rich.progress import Progress

        torch.manual_seed(0)
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("distilling", total=steps)
            student = distill(DigitsResNet(plan.width // 2), teacher, batches, dataclasses.replace(config, steps=steps),
                              on_step=lambda step, t, loss: progress.update(
                                  task, advance=1, description=f"distilling: T {t:.2f}, loss {loss:.3f}"))
        rows = _digits_rows([("teacher", teacher), ("half-width student (KD)", student)], data)
        print_rows(console, f"{DIGITS}: distilled student vs teacher (test split, batch 1)", rows)
        report = {"teacher": DIGITS, "job": dataclasses.asdict(job), "rows": rows}
        _write(job.out_dir, report, model=student)
        return report
    from fivefold.compress.llm_prune import every_other_layer_student
    from fivefold.compress.llm_prune import kd_heal_
    from fivefold.jobs.llm_report import llm_rows
    from fivefold.models import load_model
    from fivefold.eval.text import text_windows

    teacher = load_model(job.teacher, "float32")
    steps = job.steps or 40
    calibration = text_windows(teacher.tokenizer, "calibration", steps, job.window)
    heldout = text_windows(teacher.tokenizer, "heldout", job.num_eval, job.window)
    student = every_other_layer_student(teacher)
    console.print(f"student: layers 0, 2, 4, ... of the teacher ({student.config.num_layers} of "
                  f"{teacher.config.num_layers}); token-level KD for {steps} steps")
    kd_heal_(student, teacher, calibration, steps, lr=job.lr or LLM_STUDENT_LR, t_start=job.t_start, t_end=job.t_end,
             alpha=job.alpha,
             log=console.print)
    rows = llm_rows([("teacher", teacher), (f"every-other-layer student, KD {steps} steps", student)], heldout)
    print_rows(console, f"{job.teacher}: distilled student vs teacher", rows)
    report = {"teacher": job.teacher, "job": dataclasses.asdict(job), "rows": rows}
    _write(job.out_dir, report, loaded=student)
    return report

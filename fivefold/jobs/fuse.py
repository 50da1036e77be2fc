"""``fivefold fuse``: fuse a CNN or an encoder, measure it against eager, write a directory.

Models: the reference CNNs ``resnet18`` and ``mobilenet_v2`` (random weights, see
``fivefold.models.cnn``), and BERT encoders (``all-minilm-l6-v2`` or a BertModel
directory). LLMs are not rewritten here: their fusions (Q/K/V and gate/up at load, the
fused elementwise hot path at run time, ``--hot-path``) are applied by the engine itself.

The directory holds ``fused_model.pt`` (the fused ``torch.fx.GraphModule``, loaded with
:func:`load_fused`), ``graph.py`` (its generated code, to read), and ``report.json``
(op, kernel and layout-conversion counts, each linear's timed layouts, and eager vs
fused latency per batch size with the largest output difference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.fuse.graph_fuse import FuseConfig, FuseReport, fuse
from fivefold.fuse.layout import median_us
from fivefold.models.cnn import CNN_BUILDERS, build_cnn

FUSED_MODEL_FILE = "fused_model.pt"


@dataclass(frozen=True)
class FuseJob:
    """What ``fivefold fuse`` does: which model, which input sizes, where to write."""

    model: str
    out_dir: str
    batch_sizes: tuple[int, ...] = (1, 32)
    image_size: int = 224
    seq_len: int = 64
    num_timed_calls: int = 10
    config: FuseConfig = field(default_factory=FuseConfig)

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise FivefoldError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        if not 32 <= self.image_size <= 1024:
            raise FivefoldError(f"image size must be in [32, 1024], got {self.image_size}")
        if not 1 <= self.seq_len <= 512:
            raise FivefoldError(f"sequence length must be in [1, 512] (BERT's position table), got {self.seq_len}")
        if self.num_timed_calls < 1:
            raise FivefoldError(f"num_timed_calls must be >= 1, got {self.num_timed_calls}")


def build_fusable(name: str, image_size: int = 224, seq_len: int = 64):
    """(model in eval mode, ``inputs(batch) -> tuple``) for a CNN name or a BERT encoder."""
    if name in CNN_BUILDERS:
        model = build_cnn(name)
        gen = torch.Generator().manual_seed(0)
        return model, lambda batch: (torch.randn(batch, 3, image_size, image_size, generator=gen),)
    from fivefold.models.registry import resolve_model_path

    try:
        path = resolve_model_path(name)
    except FivefoldError:
        raise FivefoldError(f"unknown model '{name}' for fuse: use {', '.join(CNN_BUILDERS)}, "
                            "all-minilm-l6-v2 or a BERT directory") from None
    config_file = path / "config.json" if path.is_dir() else None
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file and config_file.exists() else None
    if model_type != "bert":
        raise FivefoldError(f"fuse rewrites CNNs and BERT encoders; '{name}' is {model_type or 'not a BERT directory'}. "
                            "LLMs are fused by the engine itself (see --hot-path)")
    from fivefold.eval.text import pydoc_text
    from fivefold.models.bert import load_bert
    from fivefold.models.tokenizer import load_hf_tokenizer

    model = load_bert(path)
    tokenizer = load_hf_tokenizer(path)
    ids = tokenizer.encode(pydoc_text("heldout")[:200_000], add_special_tokens=False)

    def inputs(batch: int):
        rows = torch.tensor([ids[i * seq_len:(i + 1) * seq_len] for i in range(batch)])
        return rows, torch.ones_like(rows)

    return model, inputs


def save_fused(module: nn.Module, report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(module, out / FUSED_MODEL_FILE)
    if hasattr(module, "code"):
        (out / "graph.py").write_text(module.code)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return out


def load_fused(out_dir: str | Path) -> nn.Module:
    """The fused module written by ``fivefold fuse`` (a pickle: load only directories you made)."""
    path = Path(out_dir) / FUSED_MODEL_FILE
    if not path.exists():
        raise FivefoldError(f"{path} does not exist: not a directory written by 'fivefold fuse'")
    return torch.load(path, weights_only=False)


def run_fuse(job: FuseJob, console=None) -> dict:
    """Fuse ``job.model``, time eager vs fused at each batch size, write ``job.out_dir``; return the report."""
    from rich.console import Console
    from rich.progress import Progress

    console = console or Console(width=140)
    model, inputs = build_fusable(job.model, job.image_size, job.seq_len)
    with console.status(f"tracing and fusing {job.model} ..."):
        fused, report = fuse(model, inputs(job.batch_sizes[0]), job.config)
    latency = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("timing eager vs fused", total=len(job.batch_sizes))
        for batch in job.batch_sizes:
            x = inputs(batch)
            eager_ms = median_us(lambda: model(*x), job.num_timed_calls) / 1e3
            fused_ms = median_us(lambda: fused(*x), job.num_timed_calls) / 1e3
            with torch.inference_mode():
                diff = float((fused(*x) - model(*x)).abs().max())
            latency.append({"batch": batch, "eager_ms": eager_ms, "fused_ms": fused_ms,
                            "speedup": eager_ms / fused_ms, "max_abs_diff": diff})
            progress.advance(task)
    result = {"model": job.model, "config": job.config.__dict__, "counts": report.to_dict(), "latency": latency}
    save_fused(fused, result, job.out_dir)
    _render(console, job, report, latency)
    console.print(f"wrote {job.out_dir}/{FUSED_MODEL_FILE}, graph.py and report.json")
    return result


def _render(console, job: FuseJob, report: FuseReport, latency: list[dict]) -> None:
    from fivefold.jobs.report import results_table

    r = report
    counts = [("graph ops", r.graph_ops_before, r.graph_ops_after),
              ("kernels dispatched per forward", r.kernels_before, r.kernels_after),
              ("layout copies per forward (ATen)", r.layout_conversions_before, r.layout_conversions_after),
              ("layout reorders per forward (inside oneDNN)", r.onednn_reorders_before, r.onednn_reorders_after),
              ("BatchNorms folded", "", r.num_folded_batchnorms),
              ("parallel linear groups merged", "", r.num_merged_linear_groups),
              ("residual adds fused", "", r.num_fused_residual_adds),
              ("activations fused", "", r.num_fused_activations),
              ("linears re-laid-out (packed/padded)", "", sum(d["choice"] != "as is" for d in r.linear_layouts))]
    console.print(results_table(f"{job.model}: what fuse changed", ("", "before", "after"),
                                [tuple(map(str, row)) for row in counts]))
    console.print(results_table(
        f"{job.model}: eager vs fused latency (median of {job.num_timed_calls}, float32)",
        ("batch", "eager ms", "fused ms", "speedup", "max |fused - eager|"),
        [(str(x["batch"]), f"{x['eager_ms']:.2f}", f"{x['fused_ms']:.2f}", f"{x['speedup']:.2f}x",
          f"{x['max_abs_diff']:.1e}") for x in latency]))

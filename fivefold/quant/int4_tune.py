"""End-to-end tuning of 4-bit group scales and minimums against the float model's logits.

After RTN, GPTQ or AWQ have chosen every code, each layer's rounding errors were minimised one
layer at a time; what the model loses is their sum through 30 layers. This step keeps the codes
and trains only the per-group float16 scales (and minimums), the "quantization parameters" of
EfficientQAT's E2E-QP phase (Chen et al., 2024; PEQA, Kim et al., 2023, trains the same ones):
the loss is KL(float model || 4-bit model) over every position of the calibration windows,
back-propagated through the whole 4-bit model (dequantized in float for the backward), Adam with
a cosine learning rate. The served form does not change (same codes, same kernels, float16
scales), nor its size: about 1.8 M numbers of SmolLM2-135M's 134 M weights move.

Cost: ``steps`` forward + backward passes of one window (SmolLM2, 256 tokens: about 1.5 s each on
two cores) and the float model's log-probabilities of every window held in memory during the run
(windows x tokens x vocabulary x 4 bytes: 32 x 256 x 49152 = 1.6 GB for SmolLM2). The teacher's
log-probabilities are taken before the model is quantized, so no float copy is kept.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.errors import FivefoldError
from fivefold.models.int4_linear import Int4Linear, Int4Quantized, _grouped


def check_windows(data) -> list[list[int]]:
    """Tuning runs on token windows (lists of ids) of a decoder; anything else is refused."""
    windows = list(data or [])
    if not windows or not all(isinstance(w, (list, tuple)) and len(w) > 1 for w in windows):
        raise FivefoldError("tuning 4-bit scales needs calibration windows of token ids (a decoder's text windows)")
    return [list(w) for w in windows]


def check_memory(model: nn.Module, windows: list[list[int]], available: int | None = None) -> None:
    """Refuse (one line) a tuning run that cannot fit: the float teacher's log-probabilities of every
    window, and per weight about 8 bytes during the run (the codes as float for the backward, the
    weight dequantized on each call and kept for the backward's input gradient)."""
    from fivefold.platform import available_memory_bytes

    weights = sum(p.numel() for p in model.parameters())
    teacher = sum(len(w) for w in windows) * model.config.vocab_size * 4
    need = 8 * weights + teacher
    available = available_memory_bytes() if available is None else available
    if need > available:
        raise FivefoldError(f"tuning 4-bit scales needs about {need / 2**30:.1f} GiB ({weights / 1e9:.2f} B weights x 8 "
                            f"bytes + the float log-probabilities of {len(windows)} windows), {available / 2**30:.1f} GiB "
                            "available: use fewer or shorter calibration windows, or no tuning")


@torch.inference_mode()
def teacher_log_probs(model: nn.Module, windows: list[list[int]]) -> list[torch.Tensor]:
    """The float model's log-probabilities [T, vocab] of every window (taken before quantizing)."""
    from fivefold.models.forward import prefill_logits

    return [F.log_softmax(prefill_logits(model, ids), dim=-1).clone() for ids in windows]


class _TunableInt4(nn.Module):
    """An :class:`Int4Linear` during tuning: its codes fixed (as float, for the backward), its
    scales (and minimums) float32 parameters, the weight dequantized on every call."""

    def __init__(self, layer: Int4Linear) -> None:
        super().__init__()
        q, scale, offset = layer.codes()
        self.in_features, self.group_size, self.activations = layer.in_features, layer.format.group_size, layer.format.activations
        codes = _grouped(q.float(), self.group_size)
        self.register_buffer("codes", codes if offset is not None else codes - 8)
        self.scale = nn.Parameter(scale.float().clone())
        self.offset = None if offset is None else nn.Parameter(offset.float().clone())
        self.bias = None if layer.bias is None else layer.bias.detach().clone()

    def weight(self) -> torch.Tensor:
        w = self.codes * self.scale[:, :, None]
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.reshape(w.shape[0], -1)[:, :self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight().to(x.dtype), self.bias)

    def to_int4(self) -> Int4Linear:
        """The served layer: the same codes, the tuned scales rounded to float16."""
        n = self.codes.shape[0]
        codes = self.codes if self.offset is not None else self.codes + 8
        q = codes.reshape(n, -1)[:, :self.in_features].round().to(torch.uint8).contiguous()
        quantized = Int4Quantized(q, self.scale.detach().to(torch.float16),
                                  None if self.offset is None else self.offset.detach().to(torch.float16),
                                  self.group_size)
        return Int4Linear.from_quantized(quantized, self.bias, self.activations)


class _FrozenHead(nn.Module):
    """The (8-bit) LM head as a float matrix autograd can pass gradients through (not trained)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        from fivefold.models.int8_linear import dense_weight

        rows = getattr(head, "rows", None)
        weight = rows(torch.arange(head.out_features)) if rows is not None else dense_weight(head)
        self.register_buffer("weight", weight.detach().float().clone())
        bias = getattr(head, "bias", None)
        self.bias = None if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), self.bias)


def tune_int4_scales_(model: nn.Module, windows: list[list[int]], teacher: list[torch.Tensor], steps: int,
                      lr: float, show_progress: bool = True, seed: int = 0,
                      on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train every :class:`Int4Linear`'s scales and minimums of the decoder ``model`` (in place;
    the codes stay) for ``steps`` windows (shuffled epochs over ``windows``), minimising
    KL(teacher || model) per token; ``teacher[i]`` holds window i's float log-probabilities
    (``seed``: the order of the windows). The
    layers are then served as before, with float16 scales. Returns the loss of every step."""
    from rich.progress import Progress

    from fivefold.compress.llm_prune import make_trainable_
    from fivefold.models.forward import prefill_logits
    from fivefold.quant.quantize import replace_module

    if steps < 1 or lr <= 0:
        raise FivefoldError(f"tuning needs steps >= 1 and lr > 0, got {steps} and {lr}")
    names = [n for n, m in model.named_modules() if isinstance(m, Int4Linear)]
    if not names:
        raise FivefoldError("no 4-bit layers to tune")
    head_name = "lm_head" if hasattr(model, "lm_head") else None
    losses: list[float] = []
    with torch.inference_mode(False):
        tunable = {n: _TunableInt4(model.get_submodule(n)) for n in names}
        for n, t in tunable.items():
            replace_module(model, n, t)
        head = model.get_submodule(head_name) if head_name else None
        if head is not None and not isinstance(head, nn.Linear):
            replace_module(model, head_name, _FrozenHead(head))
        try:
            make_trainable_(model)  # normal tensors (the loaded ones are inference tensors), eager path
            params = []
            for name, p in model.named_parameters():
                p.requires_grad_(any(name == f"{n}.scale" or name == f"{n}.offset" for n in tunable))
                if p.requires_grad:
                    params.append(p)
            opt = torch.optim.Adam(params, lr=lr)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
            gen = torch.Generator().manual_seed(seed)
            with Progress(transient=True, disable=not show_progress) as bar:
                task = bar.add_task("4-bit: tuning scales against the float logits", total=steps)
                for step in range(steps):
                    if step % len(windows) == 0:  # a new epoch: a new order
                        order = torch.randperm(len(windows), generator=gen).tolist()
                    i = order[step % len(windows)]
                    log_p = F.log_softmax(prefill_logits(model, windows[i]), dim=-1)
                    loss = F.kl_div(log_p, teacher[i], log_target=True, reduction="batchmean")
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    schedule.step()
                    losses.append(loss.item())
                    if on_step is not None:
                        on_step(step, losses[-1])
                    bar.update(task, advance=1, description=f"4-bit: tuning scales (KL {losses[-1]:.4f})")
        finally:
            for n, t in tunable.items():
                replace_module(model, n, t.to_int4())
            if head is not None and model.get_submodule(head_name) is not head:
                replace_module(model, head_name, head)
            for p in model.parameters():
                p.requires_grad_(False)
            model.set_fused_ops(True)
    return losses

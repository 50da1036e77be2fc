"""Which lever the bottleneck calls for: our rules, applied to a profile.

- Ops far below their roofline (time-weighted utilisation under 30%), or much of the
  time outside ops: the kernels and the overhead come first (kernel choice, fewer
  and larger ops, less Python per step).
- Most costed time memory-bound: fusion, layout, quantization (fewer bytes per step).
- Most costed time compute-bound and near the roof: quantization (faster arithmetic)
  and slimming (pruning, distillation): fewer operations.
- Recurring chains of small ops with a large share: fuse them.
- A server with a queue and spare batch capacity: batching.

Each verdict carries the share of the time at stake; verdicts are sorted by it.
"""

from __future__ import annotations

from dataclasses import dataclass

UTILISATION_FLOOR = 0.30
OVERHEAD_CEILING = 0.30
SATURATED = 0.60
FUSION_SHARE = 0.05


@dataclass(frozen=True)
class Verdict:
    lever: str
    finding: str
    evidence: str
    stake: float  # share of the time this verdict is about


def verdicts(report) -> list[Verdict]:
    """The rules above, applied to a :class:`~fivefold.profile.profiler.ProfileReport`."""
    out = []
    wall = report.wall_s or 1.0
    costed = report.memory_bound_s + report.compute_bound_s
    overhead = report.category_share("overhead")
    u = report.weighted_utilisation
    if costed and u < UTILISATION_FLOOR:
        out.append(Verdict("kernel choice and overhead", f"heavy ops reach {u:.0%} of their roofline",
                           f"Costed ops take {costed / wall:.0%} of the time at a time-weighted {u:.0%} of what the "
                           f"roofline allows (floor {UTILISATION_FLOOR:.0%}).", costed / wall * (1 - u)))
    if overhead > OVERHEAD_CEILING:
        out.append(Verdict("kernel choice and overhead", f"{overhead:.0%} of the time is Python and framework overhead",
                           f"Above {OVERHEAD_CEILING:.0%}: fewer, larger ops (batching, fusion, a compiled step) "
                           "pay off before faster kernels.", overhead))
    if costed:
        memory_share = report.memory_bound_s / costed
        ridge = report.peaks.ridge(report.dtype)
        if memory_share >= 0.5:
            out.append(Verdict("fusion, layout, quantization", f"memory-bound ({memory_share:.0%} of costed op time)",
                               f"{memory_share:.0%} of costed op time is below the ridge point ({ridge:.1f} FLOP/B): "
                               "fewer bytes per step (fused ops, packed layouts, int8 weights) is what speeds it up.",
                               report.memory_bound_s / wall))
        elif u >= SATURATED:
            out.append(Verdict("quantization, slimming", f"compute-saturated ({1 - memory_share:.0%} compute-bound "
                               f"at {u:.0%} of the roof)", "Faster arithmetic (int8: fivefold quantize) or fewer "
                               "operations (fivefold prune, fivefold distill) is what is left.", report.compute_bound_s / wall))
        else:
            out.append(Verdict("kernel choice, then quantization, slimming",
                               f"compute-bound ({1 - memory_share:.0%} of costed op time) at {u:.0%} of the roof",
                               "Better kernels first; once near the roof, int8 or a smaller model.",
                               report.compute_bound_s / wall))
    fusion = sum(c.share for c in report.fusion_candidates)
    if report.fusion_candidates and fusion >= FUSION_SHARE:
        top = report.fusion_candidates[0]
        out.append(Verdict("fusion", f"{len(report.fusion_candidates)} recurring chains of small ops take {fusion:.0%}",
                           f"Largest: {top.label} ({top.num_occurrences} per iteration, {top.share:.1%}). "
                           "The engine fuses the decoder's chains with --hot-path fused; fivefold fuse rewrites "
                           "fx-traceable models.", fusion))
    return sorted(out, key=lambda v: -v.stake)


def server_verdict(metrics_text: str, max_num_seqs: int) -> Verdict | None:
    """The batching rule, from a server's Prometheus ``/metrics`` text.

    Requests waiting while the running batch has free slots and the KV pool has room
    means the server could batch more: raise ``max_num_seqs`` or
    ``max_num_batched_tokens``. Waiting with the pool full is a caching problem.
    """
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if "replica" in sample.labels:  # a replicated server also labels each replica: read the totals
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    waiting = values.get("fivefold:num_requests_waiting", 0.0)
    running = values.get("fivefold:num_requests_running", 0.0)
    kv = values.get("fivefold:kv_cache_usage_perc", 0.0)
    if waiting <= 0:
        return None
    if kv >= 0.9:
        return Verdict("caching", f"{waiting:.0f} requests wait with the KV pool {kv:.0%} full",
                       "More kv_cache_memory_bytes, a smaller block_size or a quantized KV cache admits more.", 1.0)
    if running < max_num_seqs:
        return Verdict("batching", f"{waiting:.0f} requests wait while {running:.0f} of {max_num_seqs} batch slots "
                       f"run and the KV pool is {kv:.0%} full",
                       "Spare capacity: admit more per step (max_num_seqs, max_num_batched_tokens).", 1.0)
    return Verdict("batching", f"{waiting:.0f} requests wait and all {max_num_seqs} batch slots are busy",
                   "Raise max_num_seqs if the KV pool allows, or add replicas.", 1.0)

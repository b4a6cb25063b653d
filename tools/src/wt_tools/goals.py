"""The bench's goals: one definition of each, keyed by a stable id.

`report.targets` checks each goal against the figures of one run; the bench's
printed lines read their limits from here. Figures are found by stable ids
too (a live row's `id`, a scenario's mode), never by a printed label, so
renaming a label cannot turn a goal into "not measured".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GOALS", "Goal"]


@dataclass(frozen=True)
class Goal:
    """`value <= limit` (or `>=` when `higher_is_better`), `value` in `unit`."""

    id: str
    text: str  # what is measured; `{scenario}` is filled with the scenario's name
    limit: float
    higher_is_better: bool
    unit: str

    def met(self, value: float) -> bool:
        return value >= self.limit if self.higher_is_better else value <= self.limit

    def describe(self) -> str:
        """The goal as printed: `<= 1.3x floor`, `>= 75% of the ceiling`."""
        sign = ">=" if self.higher_is_better else "<="
        return f"{sign} {format_value(self.limit, self.unit)}"


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit.startswith("of "):
        return f"{value:.0%} {unit}"
    return f"{value:.2f}{unit}" if unit.startswith("x") else f"{value:.2f} {unit}"


GOALS: dict[str, Goal] = {
    g.id: g
    for g in (
        # transport alone, plain targets in worker processes (`wt_tools.scenarios`)
        Goal("dense.nccl_share_of_bare", "nccl packed vs the bare broadcast ({scenario})",
             0.75, True, "of the ceiling"),
        Goal("moe.nccl_packed_over_unpacked", "nccl packed faster than unpacked ({scenario})",
             3.0, True, "x"),
        Goal("moe.trainer_overhead_per_param",
             "trainer-side overhead per parameter ({scenario})", 5.0, False, "us"),
        Goal("moe_many.nccl_vs_bare", "nccl packed vs the bare broadcast ({scenario})",
             3.0, False, "x"),
        Goal("moe_many.ipc_vs_bare", "ipc packed vs the bare broadcast ({scenario})",
             3.0, False, "x"),
        Goal("moe_many.sharded_rdt_vs_bare", "sharded_rdt vs the bare broadcast ({scenario})",
             5.0, False, "x"),
        Goal("moe.nccl_vs_bare", "nccl packed vs the bare broadcast ({scenario})",
             1.5, False, "x"),
        Goal("moe.ipc_vs_bare", "ipc packed vs the bare broadcast ({scenario})", 1.5, False, "x"),
        Goal("moe.sharded_rdt_vs_bare", "sharded_rdt vs the bare broadcast ({scenario})",
             3.0, False, "x"),
        Goal("verify.nccl_x_unverified",
             "nccl packed with verify=True vs without ({scenario})", 1.5, False, "x"),
        Goal("verify.ipc_x_unverified",
             "ipc packed with verify=True vs without ({scenario})", 1.5, False, "x"),
        Goal("memory.peak_extra_vs_staging",
             "peak extra memory per side vs its configured staging", 1.10, False, "of staging"),
        # live vLLM engines (`wt_tools.live_bench`)
        Goal("live.nccl_vs_floor", "live vLLM: wt_nccl packed vs its reload from memory",
             1.5, False, "x floor"),
        Goal("live.ipc_vs_floor", "live vLLM: wt_ipc packed vs its reload from memory",
             1.3, False, "x floor"),
        Goal("live.sharded_rdt_vs_floor",
             "live vLLM: wt_sharded_rdt (nixl) vs its reload from memory", 1.8, False, "x floor"),
        Goal("live_disjoint.nccl_vs_floor",
             "live vLLM, trainer and engine on disjoint cores: wt_nccl packed vs its reload",
             1.3, False, "x floor"),
        Goal("live_disjoint.ipc_vs_floor",
             "live vLLM, trainer and engine on disjoint cores: wt_ipc packed vs its reload",
             1.2, False, "x floor"),
        Goal("live_disjoint.sharded_rdt_vs_floor",
             "live vLLM, trainer and engine on disjoint cores: wt_sharded_rdt vs its reload",
             1.5, False, "x floor"),
        Goal("live.nccl_over_save_reload", "live vLLM: nccl packed faster than save + reload",
             2.5, True, "x"),
        Goal("live.ipc_over_save_reload", "live vLLM: ipc packed faster than save + reload",
             2.5, True, "x"),
        Goal("ipc_transport.share_of_memcpy",
             "ipc transport alone (no vLLM, no undo) vs a one-thread memcpy", 0.70, True,
             "of the memcpy"),
        # the live MoE model (`wt_tools.moe_bench`) and LoRA adapters (`wt_tools.lora_bench`)
        Goal("live_moe.vs_floor", "live MoE: {scenario} vs its floor", 2.0, False, "x floor"),
        Goal("lora.over_disk",
             "LoRA ({scenario}): sync and first token faster than save + load from disk",
             1.0, True, "x"),
    )
}  # fmt: skip

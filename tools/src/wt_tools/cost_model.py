"""A cost model of one sync, calibrated on this machine, for clusters we cannot run here.

One sync of `B` bytes in `T` tensors is modelled as

    t = per_tensor_s * T_rank                  the trainer's own work per tensor
      + max(wire_s, load_s)                    transfer and load overlap ...
      + (1 - overlap) * min(wire_s, load_s)    ... except for what the run shows they don't
      + per_round_s * rounds                   control-plane round trips

per backend:

- broadcast (`nccl`): every inference node receives all `B` over its NICs
  (`nics_per_node x nic_gbps x link_efficiency`), then each GPU loads its
  share. `T_rank` is all tensors (one sender).
- pull (`sharded_rdt`): each inference GPU pulls only its share
  `B / gpus_per_replica` over its own NIC; each trainer GPU serves
  `B * replicas / trainer_gpus`; the wire time is the slower of the two.
  `T_rank` is the tensors of one trainer rank.

Calibrated from this machine's run (`calibrate`): `per_tensor_s` (the
trainer's dry pass per parameter on the MoE-like layout), `overlap` (how much
of transfer and load the live nccl sync hid: `(wire + load - sync) /
min(wire, load)`, clamped to [0, 1]), and `load_efficiency` (vLLM's own reload
from memory against a one-thread memcpy of the same bytes, applied to the
GPU's copy bandwidth). Everything else is a stated hardware assumption in
`SETUPS` (published NIC and memory bandwidths, a link efficiency of 0.8).
The point is a model that explains the published records, not one fitted to
them: nothing in it is tuned per setup.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from wt_tools.report import scenarios

__all__ = ["Setup", "SETUPS", "calibrate", "predict", "DEFAULTS"]

# Used where this run has no figure (say, --no-live): typical of these machines.
DEFAULTS = {"per_tensor_s": 25e-6, "overlap": 0.3, "load_efficiency": 0.15, "per_round_s": 0.02}
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Setup:
    name: str
    backend: str  # "broadcast" or "pull"
    model_bytes: float
    tensors: int
    trainer_gpus: int
    inference_gpus: int
    gpus_per_replica: int  # one inference engine (TP x EP x PP)
    nic_gbps: float  # per GPU, line rate
    nics_per_node: int
    gpu_copy_gbs: float  # device memory copy bandwidth (read + write)
    published_s: tuple[float, float]
    source: str


SETUPS = [
    Setup(
        "Qwen3-235B (BF16, 470 GB), 8 -> 8 H100",
        "pull",
        470e9,
        37_000,
        trainer_gpus=8,
        inference_gpus=8,
        gpus_per_replica=8,
        nic_gbps=400,
        nics_per_node=8,
        gpu_copy_gbs=1500,
        published_s=(2.7, 3.3),
        source="vLLM sharded RDT",
    ),
    Setup(
        "Kimi-K2 (1T, FP8 on inference), onto 256 H20",
        "broadcast",
        1.03e12,
        70_000,
        trainer_gpus=256,
        inference_gpus=256,
        gpus_per_replica=16,
        nic_gbps=400,
        nics_per_node=8,
        gpu_copy_gbs=2000,
        published_s=(16.0, 16.0),
        source="checkpoint-engine (broadcast)",
    ),
    Setup(
        "Kimi-K2 (1T), 256 training -> 128 inference GPUs, RDMA",
        "pull",
        1.03e12,
        70_000,
        trainer_gpus=256,
        inference_gpus=128,
        gpus_per_replica=128,
        nic_gbps=400,
        nics_per_node=8,
        gpu_copy_gbs=2000,
        published_s=(1.3, 1.3),
        source="Perplexity (point-to-point RDMA)",
    ),
]


def calibrate(results: dict[str, Any] | None) -> dict[str, float]:
    """The machine constants from a bench run (`DEFAULTS` where the run has none)."""
    out = dict(DEFAULTS)
    if not results:
        return out
    moe = [s for s in scenarios(results) if s["scenario"].startswith("MoE")]
    if moe:
        out["per_tensor_s"] = moe[-1]["references"]["trainer_overhead_per_param_us"] * 1e-6
    dense = [s for s in scenarios(results) if s["scenario"].startswith("dense")]
    live = results.get("live")
    if live and dense:
        rows = {r["id"]: r for r in live["rows"]}
        floor = rows["floor.nccl"]["median_s"]
        sync = rows["nccl.packed"]["median_s"]
        # the dense scenario closest in size to the live model prices its wire and memcpy
        near = min(dense, key=lambda s: abs(s["bytes"] - live["bytes"]))
        scale = live["bytes"] / near["bytes"]
        wire = near["references"]["bare_broadcast_s"] * scale
        memcpy = near["references"]["memcpy_s"] * scale
        out["overlap"] = max(0.0, min(1.0, (wire + floor - sync) / min(wire, floor)))
        out["load_efficiency"] = max(0.01, min(1.0, memcpy / floor))
    return out


def _one(setup: Setup, c: dict[str, float]) -> dict[str, Any]:
    link = setup.nic_gbps / 8 * 1e9 * LINK_EFFICIENCY  # bytes/s per GPU
    share = setup.model_bytes / setup.gpus_per_replica  # what one inference GPU keeps
    load = share / (setup.gpu_copy_gbs * 1e9 * c["load_efficiency"])
    if setup.backend == "broadcast":
        wire = setup.model_bytes / (link * setup.nics_per_node)  # each node receives everything
        tensors = setup.tensors
        rounds = 1
    else:
        replicas = setup.inference_gpus // setup.gpus_per_replica
        egress = setup.model_bytes * replicas / setup.trainer_gpus / link
        wire = max(share / link, egress)
        tensors = -(-setup.tensors // setup.trainer_gpus)
        rounds = 2  # the workers' update call, then the frees
    parts = {
        "trainer_per_tensor_s": c["per_tensor_s"] * tensors,
        "wire_s": wire,
        "load_s": load,
        "not_overlapped_s": (1 - c["overlap"]) * min(wire, load),
        "control_s": c["per_round_s"] * rounds,
    }
    seconds = (
        parts["trainer_per_tensor_s"]
        + max(wire, load)
        + parts["not_overlapped_s"]
        + parts["control_s"]
    )
    low, high = setup.published_s
    published = (low + high) / 2
    return {
        **asdict(setup),
        "predicted_s": seconds,
        "parts": parts,
        "ratio_to_published": seconds / published,
    }


def predict(calibration: dict[str, float]) -> list[dict[str, Any]]:
    """The model's prediction for every named setup, with its parts."""
    return [_one(s, calibration) for s in SETUPS]

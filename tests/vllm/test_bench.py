"""`wt bench --quick`: the CI smoke run of the benchmark (every figure produced, not how fast).

The blocks run in two halves of about equal length at once (`--blocks`), then one report is made
of both (`--merge`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wt_tools.bench import BLOCKS as BENCH_BLOCKS
from wt_tools.goals import GOALS
from wt_tools.live_bench import BLOCKS

from tests.conftest import BENCH_WORKER

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.extended,
    pytest.mark.timeout(570),
    BENCH_WORKER,  # its worker runs the tensor-parallel server after it
]

MODES = {
    "nccl packed",
    "nccl unpacked",
    "ipc packed",
    "sharded_rdt",
    "sparse_nccl 1%",
    "sparse_nccl 10%",
    "nccl packed verify",
    "ipc packed verify",
}
HALVES = ("digest,gather,scenarios,live_moe", "live,lora")


def start(*args: str, log: Path) -> subprocess.Popen[bytes]:
    """`wt bench *args`, its output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "wt_tools.bench", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )


def finished(proc: subprocess.Popen[bytes], log: Path, deadline: float) -> None:
    """`proc` ended well by `deadline` (monotonic seconds); else its log's tail fails the test."""
    try:
        proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, log.read_text(errors="replace")[-6000:]


def test_quick_bench_produces_every_figure(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    assert sorted(",".join(HALVES).split(",")) == sorted(b.key for b in BENCH_BLOCKS)
    deadline = time.monotonic() + 480
    halves = [tmp_path / f"half{i}" for i in range(len(HALVES))]
    logs = [half.with_suffix(".log") for half in halves]
    procs = [
        start("--quick", "--blocks", blocks, "--out", str(half), log=log)
        for blocks, half, log in zip(HALVES, halves, logs, strict=True)
    ]
    for proc, log in zip(procs, logs, strict=True):
        finished(proc, log, deadline)
    out, log = tmp_path / "bench", tmp_path / "merge.log"
    finished(start("--merge", *map(str, halves), "--out", str(out), log=log), log, deadline + 60)
    results = json.loads((out / "bench.json").read_text())
    scenarios = results["scenarios"]
    assert {m["mode"] for m in scenarios[0]["modes"]} == MODES
    verified = [m for s in scenarios for m in s["modes"] if m["mode"].endswith(" verify")]
    assert verified and all(m["x_unverified"] > 0 for m in verified)
    assert any(s["workers"] > 1 for s in scenarios)
    assert any(s["scenario"].startswith("MoE") for s in scenarios)
    for s in scenarios:
        refs = s["references"]
        assert refs["memcpy_s"] > 0 and refs["bare_broadcast_s"] > 0
        assert refs["trainer_overhead_per_param_us"] >= 0
        for m in s["modes"]:
            assert m["median_s"] > 0 and m["gb_per_s"] > 0, (s["scenario"], m["mode"])
            assert m["x_memcpy"] > 0 and m["x_bare_broadcast"] > 0
            assert m["bytes_per_worker"] > 0
            assert m["peak_extra_trainer_bytes"] >= 0 and m["peak_extra_worker_bytes"] >= 0
        counted = {m["mode"]: m["counts"] for m in s["modes"] if "sparse" not in m["mode"]}
        c = counted["nccl packed"]  # one warm round, counted: a broadcast per bucket on each side
        assert c["wire_messages"] == c["worker_wire_messages"] == 2 + c["buckets"], c
        assert sum(c["control_calls"].values()) == 4 and c["host_reads"] <= c["buckets"], c
        sparse = {m["mode"]: m["bytes_per_worker"] for m in s["modes"] if "sparse" in m["mode"]}
        if sparse:  # 1% of the tensors' elements moves fewer bytes than 10%
            assert sparse["sparse_nccl 1%"] < sparse["sparse_nccl 10%"] < s["bytes"]
    digest = results["digest"]["rows"]  # the digest alone, beside a copy of its bytes
    assert {(r["pieces"], r["threads"]) for r in digest} == {(8, 1), (8, 2), (4000, 1), (4000, 2)}
    assert all(r["digest_s_per_gib"] > 0 and r["x_memcpy"] > 0 for r in digest)
    live = results["live"]  # every declared row, once, in its declared order
    assert [r["id"] for r in live["rows"]] == [row.id for block in BLOCKS for row in block]
    assert {r["cores"] for r in live["rows"]} == {"shared", "disjoint"}  # 2 cores or more here
    for r in live["rows"]:  # every wt row prices its engine's undo record beside the model
        undo = r["undo"]
        assert (undo is not None) == (r["kind"] == "sync"), r["id"]
        if undo is not None:
            assert undo["seconds"] > 0 and 0 < undo["copied_bytes"] <= undo["model_bytes"]
            assert undo["kept_bytes"] >= 0
            phases = r["phases_s"]  # where its time went
            assert phases["undo"] > 0 and phases["load"] > 0, (r["method"], phases)
    packed = {r["id"]: r["phases_s"] for r in live["rows"]}["nccl.packed"]
    assert packed["check"] > 0 and packed["pack"] > 0 and packed["unpack"] > 0, packed
    assert "Where a wt round's time goes" in (out / "bench.md").read_text()
    shares = [max(t["bytes_per_worker"]) / t["model_bytes"] for t in live["sharded_rdt_tp"]]
    assert shares[0] == 1.0 and 0.45 < shares[1] < 0.55 and 0.2 < shares[2] < 0.3
    moe = results["live_moe"]  # a live MoE engine per backend, exact after its syncs
    synced = {r["id"]: r for r in moe["rows"]}
    assert synced["nccl.packed"]["tokens_equal_fresh"] is True
    assert synced["ipc.packed"]["tokens_equal_fresh"] is True
    assert synced["nccl.packed_disjoint"]["cores"] == "disjoint"
    assert all(r["median_s"] > 0 for r in moe["rows"])
    assert synced["ipc.packed_disjoint"]["phases_s"]["load"] > 0  # where a wt round's time went
    assert "fused-MoE layers" in moe["sharded_rdt_refused"]
    assert "## Live MoE" in (out / "bench.md").read_text()
    [lora] = results["lora"]["rows"]  # a rank-16 adapter: only its bytes move, exact
    assert lora["moved_bytes"] == lora["adapter_bytes"] < lora["model_bytes"] / 4
    assert lora["same_tokens"] is True and lora["wt_sync_s"] > 0 and lora["disk_load_s"] > 0
    assert "## LoRA adapters" in (out / "bench.md").read_text()
    targets = results["targets"]  # every goal checked against a figure of this run
    assert {t["id"] for t in targets} == set(GOALS)
    assert all(t["value"] is not None for t in targets), targets
    predictions = results["cost_model"]["predictions"]
    assert len(predictions) == 3 and all(p["predicted_s"] > 0 for p in predictions)
    summary = (out / "bench.md").read_text()
    assert "## Targets" in summary and "## Cost model" in summary
    assert "## Verified bytes: the digest alone" in summary
    assert "## Counted costs of one warm round" in summary
    for png in ("time_vs_size.png", "time_vs_params.png", "scenario_0.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The benchmark's outputs: targets met or missed, a Markdown summary, PNG plots.

`targets(results)` checks each goal against the figures of the same run and
says by how much it is met or missed; `markdown(results)` is the summary the
README shows (`digest_table(results["digest"])` its rows on the digest's
cost); `plots(results, folder)` writes `time_vs_size.png`,
`time_vs_params.png` and one bar chart per scenario against its references
(matplotlib; skipped, and said, when it is not installed).
"""

from __future__ import annotations

import json
import os
from typing import Any

from wt_tools.goals import GOALS, format_value

__all__ = [
    "targets",
    "markdown",
    "plots",
    "load",
    "scenarios",
    "cluster_table",
    "counts_table",
    "digest_table",
]


def load(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return dict(json.load(f))


def scenarios(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's scenario rows: none where the run left that block out (`--blocks`)."""
    return list(results.get("scenarios") or [])


def _mode(scenario: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((m for m in scenario["modes"] if m["mode"] == name), None)


def _scenario(
    results: dict[str, Any], prefix: str, key: str = "bytes", mode: str | None = None
) -> dict[str, Any] | None:
    """The largest (by `key`) scenario named `prefix`..., among those that ran `mode`."""
    found = [
        s
        for s in scenarios(results)
        if s["scenario"].startswith(prefix) and (mode is None or _mode(s, mode) is not None)
    ]
    return max(found, key=lambda s: s[key]) if found else None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of `wt_tools.goals.GOALS` that applies to the run, checked: its id, the
    figure, the limit, met or not (`None` when the run lacks the figure)."""
    out: list[dict[str, Any]] = []

    def check(goal_id: str, value: float | None, scenario: str = "") -> None:
        goal = GOALS[goal_id]
        out.append(
            {
                "id": goal_id,
                "goal": goal.text.format(scenario=scenario),
                "value": value,
                "limit": goal.limit,
                "met": None if value is None else goal.met(value),
                "unit": goal.unit,
                "higher_is_better": goal.higher_is_better,
            }
        )

    sized = [_scenario(results, f"dense {size}") for size in ("1 GiB", "4 GiB")]
    for dense in [d for d in sized if d] or [_scenario(results, "dense") or {}]:
        packed = _mode(dense, "nccl packed") if dense else None
        check(
            "dense.nccl_share_of_bare",
            dense["references"]["bare_broadcast_s"] / packed["median_s"] if packed else None,
            dense.get("scenario", "dense"),
        )
    moe = _scenario(results, "MoE", mode="nccl unpacked") or {}
    moe_name = moe.get("scenario", "MoE-like")
    moe_packed = _mode(moe, "nccl packed") if moe else None
    moe_unpacked = _mode(moe, "nccl unpacked") if moe else None
    check(
        "moe.nccl_packed_over_unpacked",
        moe_unpacked["median_s"] / moe_packed["median_s"] if moe_packed and moe_unpacked else None,
        moe_name,
    )
    many = _scenario(results, "MoE", key="params") or {}
    many_name = many.get("scenario", "MoE-like")
    check(
        "moe.trainer_overhead_per_param",
        many["references"]["trainer_overhead_per_param_us"] if many else None,
        many_name,
    )
    for prefix, scenario, name in (("moe_many", many, many_name), ("moe", moe, moe_name)):
        for backend, mode in (("nccl", "nccl packed"), ("ipc", "ipc packed"),
                              ("sharded_rdt", "sharded_rdt")):  # fmt: skip
            row = _mode(scenario, mode) if scenario else None
            check(f"{prefix}.{backend}_vs_bare", row["x_bare_broadcast"] if row else None, name)
    for backend in ("nccl", "ipc"):
        verified = _scenario(results, "dense", mode=f"{backend} packed verify") or {}
        row = _mode(verified, f"{backend} packed verify") if verified else None
        check(
            f"verify.{backend}_x_unverified",
            row["x_unverified"] if row else None,
            verified.get("scenario", "dense"),
        )
    worst = None
    for sc in scenarios(results):
        for m in sc["modes"]:
            if m["staging_bytes"]:
                extra = max(m["peak_extra_trainer_bytes"], m["peak_extra_worker_bytes"])
                share = extra / m["staging_bytes"]
                worst = share if worst is None else max(worst, share)
    check("memory.peak_extra_vs_staging", worst)
    live = results.get("live")
    rows = {r["id"]: r for r in live["rows"]} if live else {}

    def ratio(row_id: str) -> float | None:
        return rows[row_id]["ratio_to_floor"] if row_id in rows else None

    def faster(row_id: str, disk_id: str) -> float | None:
        if row_id not in rows or disk_id not in rows:
            return None
        return float(rows[disk_id]["median_s"] / rows[row_id]["median_s"])

    check("live.nccl_vs_floor", ratio("nccl.packed"))
    check("live.ipc_vs_floor", ratio("ipc.packed"))
    check("live.sharded_rdt_vs_floor", ratio("sharded_rdt.nixl"))
    check("live_disjoint.nccl_vs_floor", ratio("nccl.packed_disjoint"))
    check("live_disjoint.ipc_vs_floor", ratio("ipc.packed_disjoint"))
    check("live_disjoint.sharded_rdt_vs_floor", ratio("sharded_rdt.nixl_disjoint"))
    check("live.nccl_over_save_reload", faster("nccl.packed", "save_reload.nccl"))
    check("live.ipc_over_save_reload", faster("ipc.packed", "save_reload.ipc"))
    check("ipc_transport.share_of_memcpy", live["ipc"]["share_of_memcpy"] if live else None)
    moe_live = results.get("live_moe")
    for r in moe_live["rows"] if moe_live else []:
        if r["id"].endswith((".packed", ".packed_disjoint")):
            check("live_moe.vs_floor", r["ratio_to_floor"], r["method"])
    lora = results.get("lora")
    for r in lora["rows"] if lora else []:
        wt_s = r["wt_sync_s"] + r["wt_first_request_s"]
        disk_s = r["disk_load_s"] + r["disk_first_request_s"]
        check("lora.over_disk", disk_s / wt_s, r["label"])
    return out


def cluster_table(predictions: list[dict[str, Any]], calibration: dict[str, float]) -> str:
    lines = [
        "| setup | our backend | published s | predicted s | x published | wire s | load s "
        "| per-tensor s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in predictions:
        low, high = p["published_s"]
        published = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        backend = "wt_nccl (broadcast)" if p["backend"] == "broadcast" else "wt_sharded_rdt (pull)"
        lines.append(
            f"| {p['name']} ({p['source']}) | {backend} | {published} | {p['predicted_s']:.2f} "
            f"| {p['ratio_to_published']:.2f} | {p['parts']['wire_s']:.2f} | "
            f"{p['parts']['load_s']:.2f} | {p['parts']['trainer_per_tensor_s']:.2f} |"
        )
    lines.append("")
    lines.append(
        "Calibration from this machine: "
        + ", ".join(f"{k} = {v:.3g}" for k, v in sorted(calibration.items()))
    )
    return "\n".join(lines)


def counts_table(rows: list[dict[str, Any]]) -> list[str]:
    """Each mode's counted warm round (`wt_tools.costs`) as Markdown lines."""
    lines = [
        "",
        "## Counted costs of one warm round (`wt_tools.costs`)",
        "",
        "| scenario | mode | buckets | control calls | wire messages (trainer / worker) | "
        "host reads (trainer / worker) | trainer aten ops | bytes copied / sent | "
        "allocations | worker unpack: ops, bytes copied, allocations |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in rows:
        for m in s["modes"]:
            c = m.get("counts")
            if not c:
                continue
            u = c["worker_unpack"]
            buckets = "" if c["buckets"] is None else c["buckets"]
            lines.append(
                f"| {s['scenario']} | {m['mode']} | {buckets}"
                f" | {sum(c['control_calls'].values())} | {c['wire_messages']} / "
                f"{c['worker_wire_messages']} | {c['host_reads']} / {c['worker_host_reads']} | "
                f"{c['aten_ops']} | {c['copied_bytes'] / max(1, m['bytes_per_worker']):.3f} | "
                f"{c['allocations']} | {u['ops']}, {u['copied_bytes']}, {u['allocations']} |"
            )
    return lines


def digest_table(digest: dict[str, Any]) -> list[str]:
    """The digest's cost (`wt_tools.digest_bench.measure`) as Markdown table lines."""
    out = [
        "| bucket | device, threads | memcpy s/GiB | digest s/GiB | digest x memcpy |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in digest["rows"]:
        out.append(
            f"| {r['bucket']} | {r['device']}, {r['threads']} | {r['memcpy_s_per_gib']:.3f} | "
            f"{r['digest_s_per_gib']:.3f} | {r['x_memcpy']:.1f} |"
        )
    return out


def markdown(results: dict[str, Any]) -> str:
    out = [f"# wt bench{' (quick)' if results.get('quick') else ''}", ""]
    out.append("## Transport alone: plain targets in worker processes")
    out.append("")
    out.append(
        "| scenario | mode | s | GB/s | x memcpy | x bare broadcast | MB/worker | "
        "peak extra MB (trainer / worker) |"
    )
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in scenarios(results):
        ref = s["references"]
        out.append(
            f"| {s['scenario']} | memcpy / bare broadcast | {ref['memcpy_s']:.3f} / "
            f"{ref['bare_broadcast_s']:.3f} | | 1 | | | |"
        )
        for m in s["modes"]:
            out.append(
                f"| | {m['mode']} | {m['median_s']:.3f} | {m['gb_per_s']:.2f} | "
                f"{m['x_memcpy']:.1f} | {m['x_bare_broadcast']:.2f} | "
                f"{m['bytes_per_worker'] / 1e6:.1f} | {m['peak_extra_trainer_bytes'] / 1e6:.0f} / "
                f"{m['peak_extra_worker_bytes'] / 1e6:.0f} |"
            )
            if "x_unverified" in m:
                plain = m["mode"].removesuffix(" verify")
                out.append(
                    f"| | verify overhead: {m['mode']} vs {plain} | {m['x_unverified']:.2f} x "
                    "| | | | | |"
                )
        out.append(
            f"| | trainer overhead per parameter | {ref['trainer_overhead_per_param_us']:.1f} us "
            f"({s['params']} params) | | | | | |"
        )
    out += counts_table(scenarios(results))
    digest = results.get("digest")
    if digest:
        out += ["", "## Verified bytes: the digest alone (`wt_tools.digest_bench`)", ""]
        out += digest_table(digest)
    gather = results.get("gather")
    if gather:
        from wt_tools.gather_bench import table

        out += [
            "",
            "## FSDP2 trainer: full tensors against local shards (`wt_tools.gather_bench`)",
            "",
        ]
        out += table(gather)
    lora = results.get("lora")
    if lora:
        from wt_tools.lora_bench import table as lora_table

        out += [
            "",
            "## LoRA adapters: sync against save and load from disk (`wt_tools.lora_bench`)",
            "",
        ]
        out += lora_table(lora)
    live = results.get("live")
    if live:
        gib = live["bytes"] / 2**30
        out += ["", f"## Live vLLM ({gib:.2f} GiB, each engine in its own process)", ""]
        out.append("| path | s | x its floor | MB/worker | undo s | undo MB copied / kept |")
        out.append("| --- | --- | --- | --- | --- | --- |")
        for r in live["rows"]:
            per = r.get("bytes_per_worker")
            moved = f"{per / 1e6:.0f}" if per else ""
            undo = r.get("undo")
            cost = (
                f"{undo['seconds']:.3f} | {undo['copied_bytes'] / 1e6:.1f} / "
                f"{undo['kept_bytes'] / 1e6:.1f} (model {undo['model_bytes'] / 1e6:.0f})"
                if undo
                else " | "
            )
            out.append(
                f"| {r['method']} | {r['median_s']:.3f} | {r['ratio_to_floor']:.2f} | {moved} "
                f"| {cost} |"
            )
        out += [
            "",
            "Where a wt round's time goes (seconds, share of the round; threads overlap):",
            "",
        ]
        names = [p for r in live["rows"] if r.get("phases_s") for p in r["phases_s"]]
        order = list(dict.fromkeys(names))
        out.append("| path | " + " | ".join(order) + " |")
        out.append("| --- |" + " --- |" * len(order))
        for r in live["rows"]:
            if r.get("phases_s"):
                cells = [
                    f"{r['phases_s'][p]:.3f} ({r['phases_s'][p] / r['median_s']:.0%})"
                    for p in order
                ]
                out.append(f"| {r['method']} | " + " | ".join(cells) + " |")
        out += ["", "sharded_rdt bytes per worker, tensor-parallel engines:", ""]
        for t in live["sharded_rdt_tp"]:
            per = max(t["bytes_per_worker"])
            out.append(
                f"- {t['tp']} workers: {per / 1e6:.1f} MB each of {t['model_bytes'] / 1e6:.1f} MB "
                f"({per / t['model_bytes']:.2f})"
            )
    moe = results.get("live_moe")
    if moe:
        out += [
            "",
            f"## Live MoE ({moe['tensors']} tensors, {moe['experts']} experts a layer, "
            f"{moe['bytes'] / 1e6:.0f} MB, engines in processes of their own)",
            "",
            "| path | s | x its floor | tokens = a fresh engine's | check + pack s | wire s "
            "| load s (share) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in moe["rows"]:
            same = {True: "yes", False: "no", None: ""}[r["tokens_equal_fresh"]]
            split = r.get("phases_s")
            where = (
                f"{split['check'] + split['pack']:.3f} | {split['wire']:.3f} | "
                f"{split['load']:.3f} ({split['load'] / r['median_s']:.0%})"
                if split
                else " | "
            )
            out.append(
                f"| {r['method']} | {r['median_s']:.3f} | {r['ratio_to_floor']:.2f} | {same} | "
                f"{where} |"
            )
        out += ["", f"wt_sharded_rdt: refused at init: `{moe['sharded_rdt_refused']}`"]
    out += ["", "## Targets", "", "| goal | measured | target | met |", "| --- | --- | --- | --- |"]
    for t in results.get("targets", []):
        met = {True: "yes", False: "no", None: "n/a"}[t["met"]]
        measured = format_value(t["value"], t["unit"])
        out.append(f"| {t['goal']} | {measured} | {GOALS[t['id']].describe()} | {met} |")
    model = results.get("cost_model")
    if model:
        out += ["", "## Cost model (`wt bench --model-cluster`)", ""]
        out.append(cluster_table(model["predictions"], model["calibration"]))
    return "\n".join(out) + "\n"


def plots(results: dict[str, Any], folder: str) -> list[str]:
    """Write the PNG plots; their paths (none, said on stdout, without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return []
    written: list[str] = []
    one_worker = [s for s in scenarios(results) if s["workers"] == 1]

    def line_plot(key: str, xlabel: str, name: str, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        rows = sorted(rows, key=lambda s: s[key])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        modes = sorted({m["mode"] for s in rows for m in s["modes"]})
        for mode in modes:
            pts = [(s[key], m["median_s"]) for s in rows for m in s["modes"] if m["mode"] == mode]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        for ref, style in (("bare_broadcast_s", "k--"), ("memcpy_s", "k:")):
            ax.plot([s[key] for s in rows], [s["references"][ref] for s in rows], style,
                    label=ref.removesuffix("_s").replace("_", " "))  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds per sync (median)")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        path = os.path.join(folder, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    line_plot("bytes", "model bytes", "time_vs_size.png",
              [s for s in one_worker if s["scenario"].startswith("dense")])  # fmt: skip
    line_plot("params", "parameters (tensors)", "time_vs_params.png", one_worker)
    for i, s in enumerate(scenarios(results)):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = ["memcpy", "bare broadcast", *(m["mode"] for m in s["modes"])]
        values = [s["references"]["memcpy_s"], s["references"]["bare_broadcast_s"],
                  *(m["median_s"] for m in s["modes"])]  # fmt: skip
        ax.barh(names, values, color=["grey", "grey", *["tab:blue"] * len(s["modes"])])
        ax.set_xlabel("seconds per sync (median)")
        ax.set_title(s["scenario"], fontsize=9)
        fig.tight_layout()
        path = os.path.join(folder, f"scenario_{i}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written

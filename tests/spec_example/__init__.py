"""The reference example: vLLM's documented custom trainer and worker engines,
packaged by the tests as the throwaway distribution `wt-my-backend` (see `install_spec_example`)."""

from __future__ import annotations

import shutil
from pathlib import Path

DIST = "wt-my-backend"
VERSION = "0.0.1"
MODULES = ("my_backend_trainer", "my_backend_worker")
ENTRY_POINTS = {
    "weight_transfer.trainer": {"my_backend": "my_backend_trainer:MyTrainerWeightTransferEngine"},
    "weight_transfer.engine": {"my_backend": "my_backend_worker:MyWeightTransferEngine"},
}


def install_spec_example(site: Path) -> Path:
    """Lay the distribution out in `site` as pip installs a wheel (modules and a
    `.dist-info` with METADATA and entry_points.txt); put `site` on `sys.path` to use it."""
    site.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    for module in MODULES:
        shutil.copy(here / f"{module}.py", site / f"{module}.py")
    info = site / f"{DIST.replace('-', '_')}-{VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n")
    lines: list[str] = []
    for group, eps in ENTRY_POINTS.items():
        lines += [f"[{group}]", *(f"{ep} = {value}" for ep, value in eps.items()), ""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    return site

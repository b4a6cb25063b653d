"""The backend that docs/writing-a-backend.md builds, installed from the page's own code blocks.

`install_from_doc(workdir)` writes every fenced block that names a file
(```python file=src/wt_lite/worker.py) under `workdir/wt-lite`, then installs
that project with pip (hatchling, no build isolation) into `workdir/site`,
which it returns: put it on `sys.path` (or PYTHONPATH) to use the backend.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).parents[1] / "docs" / "writing-a-backend.md"
FENCE = re.compile(r"^```(\w+) file=(\S+)\n(.*?)^```", re.S | re.M)


def doc_files() -> dict[str, str]:
    """The page's file blocks: path -> text."""
    return {path: body for _, path, body in FENCE.findall(DOC.read_text())}


def install_from_doc(workdir: Path) -> Path:
    project = workdir / "wt-lite"
    for path, body in doc_files().items():
        target = project / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body)
    (project / "src" / "wt_lite" / "__init__.py").write_text("")
    site = workdir / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(project)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    for script in ("run_outside_vllm.py", "use_in_vllm.py"):
        (site / script).write_text((project / script).read_text())
    return site

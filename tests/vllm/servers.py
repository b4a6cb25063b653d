"""Live vLLM API servers for the tests: `Server`, `Traffic`, `ServerPool`.

`ServerPool` (the session fixture `servers` in `conftest.py`) starts servers
per backend on first use and keeps them for the session, so the modules that
need a live server of the same backend share it: `servers("nccl", 2)` is the
fleet's two replicas, and `servers("nccl")[0]`, the first of them, is
`test_http.py`'s server. A shared server serves whatever the last round sent
it; a test syncs before it checks what a server serves.

A one-worker server runs its engine's worker inside the engine core process
(vLLM's `uni` executor, as vLLM runs a one-GPU engine); the API server and the
engine core are separate processes, as deployed. vLLM's CPU build would give
the worker a process of its own (`mp`): one more torch and vLLM import per
start (about 10 s of CPU), and two processes (the worker and the engine core
waiting on it) spinning on `sched_yield` for a second after every step. On two
cores that spinning slowed everything running beside a busy server (decision
81 has the figures). A tensor-parallel server has worker processes, as in
vLLM: the extended checks' tensor-parallel servers are where wt's engine-core
socket (`weight_transfer.vllm.serving`) runs live.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from tests.vllm.conftest import (
    INITIAL_SEED,
    LOGPROBS,
    MAX_TOKENS,
    PROMPTS,
    Outputs,
    TinyDirs,
)
from weight_transfer.vllm.readiness import NOT_READY
from wt_kits.group.stateless import free_port

__all__ = [
    "Server", "Traffic", "Requests", "ServerPool", "READY_TIMEOUT_S", "SERVED_NAME", "completions",
    "weight_version",
]  # fmt: skip

READY_TIMEOUT_S = 240.0
# Every server takes LoRA adapters (test_lora.py); with none named, its base outputs
# are bit-identical to an engine's without LoRA.
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "16", "--max-loras", "2")
# A second name the base model is served under (requests may name either).
SERVED_NAME = "tiny-base"
# The tiny model has no chat template: chat requests get the messages' contents in order.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


class Server:
    """One `vllm serve`-style API server process (and the engine it starts) on 127.0.0.1."""

    def __init__(
        self,
        model_dir: str,
        log_path: str,
        backend: str = "nccl",
        port: int | None = None,
        *,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.model_dir = model_dir
        self.backend = backend
        self.tensor_parallel_size = tensor_parallel_size
        self.extra_args: tuple[str, ...] = ()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._launch()

    def _launch(self) -> None:
        env = dict(os.environ)
        # "0": vLLM's CPU build keeps a one-worker engine's worker in the engine core (`uni`)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.tensor_parallel_size > 1 else "0"
        # One OpenMP thread: on two cores, the spinning OpenMP threads of several processes
        # starve each other (a tiny model's forward took 30+ s behind a busy neighbour).
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP="127.0.0.1", OMP_NUM_THREADS="1")
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")  # wt registers synced adapters' names
        if self.tensor_parallel_size > 1:  # one core per worker (vLLM's CPU build binds them)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                str(i % (os.cpu_count() or 1)) for i in range(self.tensor_parallel_size)
            )
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            self.model_dir,
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
            json.dumps({"backend": f"wt_{self.backend}"}),
            "--served-model-name",
            self.model_dir,
            SERVED_NAME,
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
            "--chat-template",
            CHAT_TEMPLATE,
            *LORA_ARGS,
            *self.extra_args,
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.http = httpx.Client(base_url=self.url, timeout=120.0)

    def restart(self, *, wait: bool = True, extra_args: tuple[str, ...] = ()) -> None:
        """SIGKILL the server (its process group: front end and engine), then start a
        fresh one on its port, in place, with `extra_args` added to its command line;
        `wait`: until it is ready."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.stop()
        self.extra_args = extra_args
        self._launch()
        if wait:
            self.wait_ready()

    def log_tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def wait_ready(self, *, held: bool = False) -> None:
        """Until `/health` answers 200 (`held`: or wt's 503 for a server held until its
        first weight sync)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                health = self.http.get("/health", timeout=2.0)
                if health.status_code == 200 or (held and NOT_READY in health.text):
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

    def generate(self, model: str | None = None) -> Outputs:
        """Greedy tokens and logprobs of `PROMPTS` on `model` (default: the base model)."""
        return completions(self.http, model or self.model_dir)

    def weight_version(self) -> str:
        return weight_version(self.http)


def completions(http: httpx.Client, model: str) -> Outputs:
    """Greedy tokens and logprobs of `PROMPTS` on `model`, from the server `http` reaches."""
    body = {
        "model": model,
        "prompt": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": LOGPROBS,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    response = http.post("/v1/completions", json=body)
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


def weight_version(http: httpx.Client) -> str:
    """The weight version label of the server `http` reaches (`GET /weight_info`)."""
    response = http.get("/weight_info")
    response.raise_for_status()
    return str(response.json()["weight_version"])


def _token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


class Traffic:
    """A steady stream of streamed completions at the server from one thread.

    Every request must return HTTP 200 and stream all `MAX_TOKENS` tokens
    (finish reason "length", usage counted by the server); anything else is
    recorded in `failures`. Bounded: it stops when told, after
    `max_requests`, or after `max_s`. `model`: what the requests name (the
    served model; a LoRA adapter's name).
    """

    def __init__(
        self,
        server: Server,
        max_requests: int = 2000,
        max_s: float = 240.0,
        model: str | None = None,
    ) -> None:
        self.server = server
        self.model = model or server.model_dir
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
                    "model": self.model,
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


class Requests:
    """Greedy completions of `PROMPTS` at one server from one thread, in a loop:
    `served` (the outputs of each 200), `refused` (503s naming wt's hold),
    `failures` (anything else)."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.served: list[Outputs] = []
        self.refused = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="requests", daemon=True)

    def __enter__(self) -> Requests:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the requests did not stop"

    def wait(self, condition: Callable[[], bool], timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline and not self.failures, self.failures
            time.sleep(0.05)

    def _run(self) -> None:
        with httpx.Client(base_url=self.server.url, timeout=120.0) as http:
            while not self._stop.is_set():
                try:
                    self.served.append(completions(http, self.server.model_dir))
                except httpx.HTTPStatusError as e:
                    if e.response.status_code == 503 and NOT_READY in e.response.text:
                        self.refused += 1
                        self._stop.wait(0.2)  # a client's back-off
                    else:
                        self.failures.append(f"HTTP {e.response.status_code}: {e.response.text}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))


class ServerPool:
    """Servers by backend, started on first use, kept until `stop`."""

    def __init__(self, dirs: TinyDirs, logs: str) -> None:
        self.dirs = dirs
        self.logs = logs
        self._servers: dict[str, list[Server]] = {}

    def __call__(self, backend: str, n: int = 1) -> list[Server]:
        """The first `n` servers of `backend`, ready (the missing ones start together)."""
        have = self._servers.setdefault(backend, [])
        new = [
            Server(
                self.dirs[INITIAL_SEED],
                os.path.join(self.logs, f"{backend}-{i}.log"),
                backend=backend,
            )
            for i in range(len(have), n)
        ]
        have += new
        for server in new:
            server.wait_ready()
        return have[:n]

    def stop(self) -> None:
        for servers in self._servers.values():
            for server in servers:
                server.stop()

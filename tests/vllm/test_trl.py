"""TRL's own trainers and clients against a live vLLM server, syncing through wt-trl.

The session's nccl server (`wt_nccl`) serves them. After every sync its greedy
tokens and logprobs are compared with a fresh engine loaded from the weights
the trainer had at that step.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import (
    INITIAL_SEED,
    KEEP_ALIVE,
    LLM_KWARGS,
    Outputs,
    References,
    TinyDirs,
    generate,
    hf_model,
    require_backend,
)
from weight_transfer.runtime.hooks import hookimpl, plugin_manager, register_hooks
from wt_kits.group.stateless import free_port

pytest.importorskip("vllm")
pytest.importorskip("trl")
pytest.importorskip("wt_trl")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("trl_grpo.py")
SCRIPT_TIMEOUT_S = 300.0


def fresh_outputs(directory: Path) -> Outputs:
    """Greedy outputs of a fresh engine loaded from `directory` (kept for the session)."""
    from vllm import LLM

    llm = LLM(model=str(directory), **LLM_KWARGS)
    KEEP_ALIVE.append(llm)
    return generate(llm)


def served(out: Path, step: int) -> tuple[Outputs, str]:
    """What the server served after step `step`'s sync, as the script recorded it."""
    record = json.loads((out / f"served-{step}.json").read_text())
    outputs = [(tokens, [[tuple(e) for e in p] for p in positions]) for tokens, positions in
               record["outputs"]]  # fmt: skip
    return outputs, record["label"]  # type: ignore[return-value]


def start_script(
    url: str, model_dir: str, out: Path, steps: int, poison_step: int = -1, **env: str
) -> subprocess.Popen[bytes]:
    out.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_HOST_IP="127.0.0.1", **env)
    args = [url, model_dir, str(out), str(free_port()), str(steps), str(poison_step)]
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def wait_for(proc: subprocess.Popen[bytes], out: Path, word: str) -> None:
    """Until the script prints `word`; it printing the other word of `ENDS`, or
    stopping, fails the test with its output (and its recorded failure)."""
    assert proc.stdout is not None
    fd, seen = proc.stdout.fileno(), ""
    deadline = time.monotonic() + SCRIPT_TIMEOUT_S
    while not any(end in seen for end in ENDS):
        readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 1 << 16) if readable else b""
        if not chunk:
            break
        seen += chunk.decode(errors="replace")
    if word not in seen:
        failure = out / "failed.txt"
        why = failure.read_text() if failure.exists() else ""
        raise AssertionError(f"the TRL script did not reach {word!r}: {why}\n{seen[-4000:]}")


ENDS = ("SYNC FAILED", "TRAINED")


def test_grpo_trains_against_a_live_server_exact_after_every_step(
    servers: Any, references: References, tiny_dirs: TinyDirs, tmp_path: Path
) -> None:
    """TRL's `GRPOTrainer` (server mode, CPU) with `wt_trl.install()`: after each of
    three steps the server serves exactly the trainer's weights at that step,
    labeled with the step (and not the weights it started from); a fourth
    step's sync fails on purpose (a NaN in the weights), raises wt's error in
    TRL's loop and leaves the server on the third step's weights; a restarted
    trainer takes the server over from the failed one, still alive, and its
    syncs land."""
    require_backend("nccl")
    server = servers("nccl")[0]
    first = tmp_path / "first"
    failed = start_script(server.url, tiny_dirs[INITIAL_SEED], first, steps=4, poison_step=3)
    try:
        wait_for(failed, first, "SYNC FAILED")
        for step in range(3):
            outputs, label = served(first, step)
            assert outputs == fresh_outputs(first / f"step-{step}"), f"step {step}"
            assert label == str(step)
            assert step == 0 or outputs != references.outputs(INITIAL_SEED), f"step {step}"
        error = (first / "failed.txt").read_text()
        assert "non-finite" in error and "model.norm.weight" in error, error
        assert server.generate() == served(first, 2)[0]
        assert server.weight_version() == "2"

        second = tmp_path / "second"
        restarted = start_script(
            server.url, str(first / "step-2"), second, steps=2, WT_TRL_REPLACE_TRAINER="1"
        )
        try:
            wait_for(restarted, second, "TRAINED")
            assert restarted.wait(30) == 0
        finally:
            restarted.kill()
            restarted.wait(10)
        outputs, label = served(second, 1)
        assert outputs == fresh_outputs(second / "step-1") and label == "1"
        assert outputs != served(first, 2)[0]
    finally:
        failed.kill()
        failed.wait(10)


class Rounds:
    """The rounds a trainer engine opened (the `wt_sync_started` hook)."""

    def __init__(self) -> None:
        self.started = 0

    @hookimpl
    def wt_sync_started(self) -> None:
        self.started += 1


def test_the_client_s_weight_update_block_is_one_round_all_or_nothing(
    servers: Any, references: References
) -> None:
    """OnlineDPO's path: `update_named_param` per parameter inside `weight_update()` is
    one round, exact; a block that raises after half the parameters leaves the server
    on the previous weights; `update_model_params` (GRPO's one call) lands too."""
    from wt_trl import WTVLLMClient

    require_backend("nccl")
    server = servers("nccl")[0]
    client = WTVLLMClient(base_url=server.url, group_port=free_port(), connection_timeout=60)
    client.init_communicator("cpu")
    rounds = Rounds()
    register_hooks(rounds)
    try:
        with client.weight_update():
            for name, param in hf_model(2).named_parameters():
                client.update_named_param(name, param.detach())
        assert rounds.started == 1
        assert server.generate() == references.outputs(2)
        params = list(hf_model(3).named_parameters())
        with pytest.raises(RuntimeError, match="the framework failed"), client.weight_update():
            for name, param in params[: len(params) // 2]:
                client.update_named_param(name, param.detach())
            raise RuntimeError("the framework failed")
        assert server.generate() == references.outputs(2)
        client.update_model_params(hf_model(3))
        assert rounds.started == 3
        assert server.generate() == references.outputs(3)
    finally:
        plugin_manager().unregister(rounds)
        client.close_communicator()


def test_async_grpo_s_weight_transfer_is_one_round_of_chunks(
    servers: Any, references: References
) -> None:
    """`AsyncGRPOWeightTransfer` as TRL's async GRPO drives it: each sync one round of
    chunks, exact, labeled by its count; one whose iterator fails leaves the server
    on the previous weights, and the next lands."""
    from wt_trl import AsyncGRPOWeightTransfer

    require_backend("nccl")
    server = servers("nccl")[0]
    transfer = AsyncGRPOWeightTransfer(
        server.url, group_port=free_port(), device="cpu", chunk_bytes=64 << 10
    )
    transfer.init_weight_transfer()

    def failing(seed: int) -> Any:
        for i, (name, param) in enumerate(hf_model(seed).named_parameters()):
            if i == 10:
                raise RuntimeError("the gather failed")
            yield name, param.detach()

    try:
        for seed, label in ((3, "0"), (2, "1")):
            transfer.pause()
            transfer.send_weights((n, p.detach()) for n, p in hf_model(seed).named_parameters())
            transfer.resume()
            assert server.generate() == references.outputs(seed)
            assert server.weight_version() == label
        with pytest.raises(RuntimeError, match="the gather failed"):
            transfer.send_weights(failing(3))
        assert server.generate() == references.outputs(2)
        transfer.send_weights((n, p.detach()) for n, p in hf_model(3).named_parameters())
        assert server.generate() == references.outputs(3)
        assert server.weight_version() == "2"
    finally:
        transfer.destroy()


def test_install_refuses_a_trl_it_does_not_support_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import trl
    from trl.generation import vllm_client, vllm_generation

    import wt_trl

    monkeypatch.setattr(trl, "__version__", "1.15.0")
    with pytest.raises(RuntimeError, match=r"wt-trl supports TRL 1\.16\.0; this is TRL 1\.15\.0"):
        wt_trl.install()
    assert vllm_generation.VLLMClient is vllm_client.VLLMClient
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    monkeypatch.setattr(vllm_generation, "VLLMClient", object)  # the client moved elsewhere
    with pytest.raises(RuntimeError, match="is not the client wt-trl replaces"):
        wt_trl.install()
    assert vllm_generation.VLLMClient is object


def test_a_client_pointed_at_a_server_without_a_wt_backend_says_how_to_start_it(
    servers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before anything connects. (vLLM's own `nccl` backend cannot start on CPU, so the
    live server's answer about its backend is replaced with what such a server says.)"""
    from wt_trl import WTVLLMClient

    require_backend("nccl")
    server = servers("nccl")[0]
    client = WTVLLMClient(base_url=server.url, group_port=free_port(), connection_timeout=60)
    assert client.server_backend() == "nccl"  # the live server runs wt_nccl
    for config, says in [({"backend": "nccl"}, "runs weight-transfer backend 'nccl'"),
                         (None, "has no weight transfer")]:  # fmt: skip
        info = {**client.get_server_info(), "weight_transfer_config": config}
        monkeypatch.setattr(client, "get_server_info", lambda info=info: info)
        with pytest.raises(RuntimeError, match=says) as refused:
            client.init_communicator("cpu")
        assert """'{"backend": "wt_nccl"}'""" in str(refused.value)
        assert client.engine is None

"""`python -m wt_tools.demo`: train, sync, verify; and its check has teeth."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.vllm.conftest import installed

pytest.importorskip("transformers")


def test_compare_rejects_wrong_tokens_and_logprobs() -> None:
    from wt_tools.demo import PROMPTS, compare
    from wt_tools.tiny_model import tiny_llama

    model = tiny_llama(seed=5)
    truth = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, lps = list(prompt), []
            for _ in range(4):
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
                token = int(lp.argmax())
                ids.append(token)
                lps.append(float(lp[token]))
            truth.append((ids[len(prompt) :], lps))
    ok, matched, total, _ties, worst = compare(model, truth, 1e-3)
    assert ok and matched == total == 4 * len(PROMPTS) and worst < 1e-5

    shifted = [(tokens, [lp + 0.01 for lp in lps]) for tokens, lps in truth]
    assert not compare(model, shifted, 1e-3)[0]
    other = tiny_llama(seed=6)
    assert not compare(other, truth, 1e-3)[0]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "backend",  # the README's demo (nccl) always; the others with the extended checks
    [
        "nccl",
        pytest.param("ipc", marks=pytest.mark.extended),
        pytest.param("sharded_rdt", marks=pytest.mark.extended),
    ],
)
def test_demo_runs_and_verifies(backend: str) -> None:
    pytest.importorskip("vllm")
    if not installed(backend):
        pytest.skip(f"wt backend {backend!r} is not installed")
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "wt_tools.demo", "--steps", "2", "--backend", backend],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2 and all(ln.endswith("-> OK") for ln in steps), proc.stdout
    assert "GB/s" in steps[0]
    assert "verification passed" in proc.stdout
    assert f"wt {backend} sync 2" in proc.stderr

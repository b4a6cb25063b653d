"""A TRL GRPO script on CPU, as its user writes one, with `wt_trl.install()` added.

Run by `test_trl.py` as its own process (`PYTHONPATH` the repository root):
`python trl_grpo.py URL MODEL_DIR OUT_DIR GROUP_PORT STEPS POISON_STEP`.
Everything else here is the test's instrumentation, outside the sync: at each
step's start the trainer's weights (what that step's sync sends) are saved to
`OUT_DIR/step-<k>`; at its end the server's greedy outputs and label go to
`OUT_DIR/served-<k>.json`. At `POISON_STEP` (-1: never) a NaN is written into
the model before its sync, which wt refuses: the error goes to
`OUT_DIR/failed.txt`, and the process waits there, alive, until it is killed.
"""

import json
import math
import os
import sys
import time
import zlib

import httpx
import torch

import wt_trl

wt_trl.install()  # the one line a TRL script adds

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tests.vllm.servers import completions, weight_version  # noqa: E402

url, model_dir, out, group_port, steps, poison_step = sys.argv[1:7]


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.http = httpx.Client(base_url=url, timeout=120.0)
        self.served_model = self.http.get("/v1/models").json()["data"][0]["id"]

    def on_step_begin(self, args, state, control, model=None, processing_class=None, **kw):
        directory = os.path.join(out, f"step-{state.global_step}")
        model.save_pretrained(directory)
        processing_class.save_pretrained(directory)
        if state.global_step == int(poison_step):
            with torch.no_grad():
                model.model.norm.weight[0] = math.nan

    def on_step_end(self, args, state, control, model=None, **kw):
        outputs = completions(self.http, self.served_model)
        served = {"outputs": outputs, "label": weight_version(self.http)}
        with open(os.path.join(out, f"served-{state.global_step - 1}.json"), "w") as f:
            json.dump(served, f)


tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
dataset = Dataset.from_dict({"prompt": [" ".join(f"w{i + j}" for j in range(5)) for i in range(8)]})


def distinct(completions, **kwargs):
    """A reward per completion's text (its CRC): a group whose completions differ gets
    different rewards, so its advantages are not all zero and the step changes the
    weights (a reward by length gave equally long completions equal rewards: a step
    without an update now and then, and the tests' "the weights moved" checks failed).
    Only a group of identical completions still gets equal rewards."""
    return [zlib.crc32(c.encode()) / 2**32 for c in completions]


args = GRPOConfig(
    output_dir=os.path.join(out, "trainer"),
    use_vllm=True,
    vllm_mode="server",
    vllm_server_base_url=url,
    vllm_server_timeout=120,
    vllm_group_port=int(group_port),
    vllm_importance_sampling_correction=False,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    max_steps=int(steps),
    learning_rate=1e-2,
    use_cpu=True,
    bf16=False,
    gradient_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=distinct,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[Recorder()],
)
try:
    trainer.train()
except Exception as error:  # the poisoned sync: TRL's loop raises wt's error
    with open(os.path.join(out, "failed.txt"), "w") as f:
        f.write(f"{type(error).__name__}: {error}")
    print("SYNC FAILED", flush=True)
    time.sleep(600)  # a trainer that hangs on: killed by the test
print("TRAINED", flush=True)

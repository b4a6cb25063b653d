"""Small random checkpoints, built locally (no hub access).

`build_tiny_llama(path, seed=...)` writes a `LlamaForCausalLM` with random
weights (normal, scale `scale`; norms around 1) in safetensors format plus a
word-level tokenizer whose vocabulary is `<pad> <s> </s> <unk> w0 w1 ...`, and
returns `path`. Different seeds give different greedy outputs. `TinyLlamaSpec`
sets the size; `TinyLlamaSpec.large()` is about 1 GiB in float32.
`build_tiny_moe(path, seed=...)` does the same for a `Qwen3MoeForCausalLM`
(`TinyMoESpec`: every layer sparse, per-expert checkpoint tensors).

Needs `transformers` and `tokenizers`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ENGINE_KWARGS",
    "TinyLlamaSpec",
    "TinyMoESpec",
    "build_tiny_llama",
    "build_tiny_moe",
    "llama_config",
    "tiny_llama",
    "tiny_moe",
    "prompt_words",
]

# vLLM engine arguments for these tiny models on CPU (float32, eager, a 32 MiB KV
# cache, the in-process executor): what the tests and the MoE bench start them with.
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 32 << 20,
    "distributed_executor_backend": "uni",
}

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Architecture of the model; the defaults are the smallest vLLM's CPU attention accepts."""

    vocab_size: int = 300
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 256

    @classmethod
    def large(cls, num_hidden_layers: int = 16) -> TinyLlamaSpec:
        """Hidden 1024, 16 heads: about 64 MiB per layer in float32 (1 GiB at 16 layers)."""
        return cls(
            vocab_size=1000,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=64,
        )


def llama_config(spec: TinyLlamaSpec) -> Any:
    """The `transformers.LlamaConfig` for `spec` (float32, untied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )


def tiny_llama(spec: TinyLlamaSpec = TinyLlamaSpec(), *, seed: int = 0, scale: float = 0.2) -> Any:
    """A `LlamaForCausalLM` for `spec` with weights drawn from `seed`."""
    from transformers import LlamaForCausalLM

    return _randomized(LlamaForCausalLM(llama_config(spec)), seed, scale)


@torch.no_grad()
def _randomized(model: Any, seed: int, scale: float) -> Any:
    """`model` with weights drawn from `seed`: normal with std `scale`, norms around 1."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        param.copy_(1.0 + 0.1 * noise if "norm" in name else scale * noise)
    return model.eval()


def _save(model: Any, vocab_size: int, path: str | os.PathLike[str]) -> str:
    """Write `model` (safetensors) and the word-level tokenizer to `path`; returns `path`."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(vocab_size).save_pretrained(path)
    return path


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for i in range(vocab_size - len(SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    spec: TinyLlamaSpec = TinyLlamaSpec(),
    scale: float = 0.2,
) -> str:
    """Write the checkpoint and tokenizer for (`spec`, `seed`) to `path`; returns `path`."""
    return _save(tiny_llama(spec, seed=seed, scale=scale), spec.vocab_size, path)


@dataclass(frozen=True)
class TinyMoESpec:
    """A Qwen3-MoE: `num_experts` experts a layer, `num_experts_per_tok` routed to.
    An intermediate size off a multiple of 32 (the default 48) makes vLLM's CPU
    kernel pad it, the case its layerwise reload cannot even copy."""

    vocab_size: int = 300
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 48
    max_position_embeddings: int = 256


def tiny_moe(spec: TinyMoESpec = TinyMoESpec(), *, seed: int = 0, scale: float = 0.2) -> Any:
    """A `Qwen3MoeForCausalLM` for `spec` with weights drawn from `seed`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=4 * spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    return _randomized(Qwen3MoeForCausalLM(config), seed, scale)


def build_tiny_moe(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    spec: TinyMoESpec = TinyMoESpec(),
    scale: float = 0.2,
) -> str:
    """Write the MoE checkpoint and tokenizer for (`spec`, `seed`) to `path`; returns `path`."""
    return _save(tiny_moe(spec, seed=seed, scale=scale), spec.vocab_size, path)


def prompt_words(n: int, *, seed: int = 0, vocab_size: int = 300) -> str:
    """A prompt of `n` ordinary vocabulary words (`w<i>`), drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - len(SPECIAL_TOKENS), (n,), generator=generator)
    return " ".join(f"w{i}" for i in ids.tolist())

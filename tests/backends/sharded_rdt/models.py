"""A model sharded the way inference engines shard, with loaders written the way vLLM's are.

`ShardedModel(tp_rank, tp_size)` keeps, of the checkpoint `checkpoint(seed)`:

- `embed.weight`: rows `[r*V/tp, (r+1)*V/tp)` (vocabulary-parallel, `narrow(0)`);
- `layers.i.qkv.weight`: a fused column-parallel QKV (q, k, v each narrowed
  on dim 0 and copied at their offset in the fused parameter);
- `layers.i.o.weight`: row-parallel (`narrow(1)`);
- `layers.i.gate_up.weight`: one checkpoint tensor `w13` split with `chunk(2)`
  into gate and up, each narrowed by rank (two views of one tensor);
- `layers.i.down.weight`: row-parallel, bf16;
- `layers.i.experts.w1`: experts split across ranks (expert parallel):
  rank r keeps experts `e % tp == r`, each copied whole into its local slot;
  the other experts are skipped without a copy;
- `layers.i.router.weight`: stored transposed in the checkpoint (`.t()`);
- `norm.weight`: replicated (the whole tensor).

`load_weights` is the only loading code; the backend records it once and
never calls it again. `reference(seed, tp_rank, tp_size)` is a fresh model
loaded through the same `load_weights` from real tensors, to compare with.
`UnsupportedModel` uses an op outside the allowlist (a dtype cast).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

VOCAB, HIDDEN, HEADS_Q, HEADS_KV, INTER, EXPERTS, LAYERS = 64, 32, 32, 16, 48, 4, 2


def checkpoint(seed: int, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """Checkpoint-format tensors, in the order a trainer yields them."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    out = {"embed.weight": rand(VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"layers.{i}."
        out[p + "q.weight"] = rand(HEADS_Q, HIDDEN)
        out[p + "k.weight"] = rand(HEADS_KV, HIDDEN)
        out[p + "v.weight"] = rand(HEADS_KV, HIDDEN)
        out[p + "o.weight"] = rand(HIDDEN, HEADS_Q)
        out[p + "w13.weight"] = rand(2 * INTER, HIDDEN)
        out[p + "down.weight"] = rand(HIDDEN, INTER, dtype=torch.bfloat16)
        for e in range(EXPERTS):
            out[p + f"experts.{e}.w1.weight"] = rand(INTER, HIDDEN)
        out[p + "router.weight"] = rand(EXPERTS, HIDDEN)
    out["norm.weight"] = rand(HIDDEN)
    return out


class Layer(torch.nn.Module):
    def __init__(self, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.r, self.tp = tp_rank, tp_size
        q, kv, inter = HEADS_Q // tp_size, HEADS_KV // tp_size, INTER // tp_size
        self.local_experts = [e for e in range(EXPERTS) if e % tp_size == tp_rank]
        self.qkv = torch.nn.Linear(HIDDEN, q + 2 * kv, bias=False)
        self.o = torch.nn.Linear(q, HIDDEN, bias=False)
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, HIDDEN, bias=False).to(torch.bfloat16)
        self.experts = torch.nn.Module()
        self.experts.w1 = torch.nn.Parameter(torch.zeros(len(self.local_experts), INTER, HIDDEN))
        self.router = torch.nn.Linear(EXPERTS, HIDDEN, bias=False)  # weight [HIDDEN, EXPERTS]

    def load(self, short: str, w: torch.Tensor) -> None:
        r, tp = self.r, self.tp
        q, kv, inter = HEADS_Q // tp, HEADS_KV // tp, INTER // tp
        if short in ("q.weight", "k.weight", "v.weight"):
            size = q if short[0] == "q" else kv
            start = {"q": 0, "k": q, "v": q + kv}[short[0]]
            self.qkv.weight.data.narrow(0, start, size).copy_(w.narrow(0, r * size, size))
        elif short == "o.weight":
            self.o.weight.data.copy_(w.narrow(1, r * q, q))
        elif short == "w13.weight":
            gate, up = w.chunk(2, dim=0)
            self.gate_up.weight.data[:inter].copy_(gate[r * inter : (r + 1) * inter])
            self.gate_up.weight.data[inter:].copy_(up.narrow(0, r * inter, inter))
        elif short == "down.weight":
            self.down.weight.data.copy_(w.narrow(1, r * inter, inter))
        elif short.startswith("experts."):
            e = int(short.split(".")[1])
            if e in self.local_experts:
                self.experts.w1.data[self.local_experts.index(e)].copy_(w)
        elif short == "router.weight":
            self.router.weight.data.copy_(w.t())
        else:
            raise KeyError(short)


class ShardedModel(torch.nn.Module):
    def __init__(self, tp_rank: int = 0, tp_size: int = 1, layers: int = LAYERS) -> None:
        super().__init__()
        self.r, self.tp = tp_rank, tp_size
        self.embed = torch.nn.Embedding(VOCAB // tp_size, HIDDEN)
        self.layers = torch.nn.ModuleList(Layer(tp_rank, tp_size) for _ in range(layers))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.zeros(HIDDEN))
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, w in weights:
            if name == "embed.weight":
                rows = VOCAB // self.tp
                self.embed.weight.data.copy_(w.narrow(0, self.r * rows, rows))
            elif name == "norm.weight":
                self.norm.weight.data.copy_(w)
            else:
                _, i, short = name.split(".", 2)
                self.layers[int(i)].load(short, w)
            loaded.add(name)
        return loaded

    def kept_bytes(self) -> int:
        """The bytes of checkpoint data this shard keeps (its share of a sync)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())


class UnsupportedModel(ShardedModel):
    """Its loader casts the norm weight: not a slice op."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        rest = []
        for name, w in weights:
            if name == "norm.weight":
                self.norm.weight.data.copy_(w.to(torch.float64))
            else:
                rest.append((name, w))
        return super().load_weights(rest)


def reference(
    seed: int, tp_rank: int, tp_size: int, layers: int = LAYERS
) -> dict[str, torch.Tensor]:
    """What a fresh shard holds after loading `checkpoint(seed)` the ordinary way."""
    model = ShardedModel(tp_rank, tp_size, layers)
    model.load_weights(checkpoint(seed, layers).items())
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def held_part(tensors: dict[str, torch.Tensor], part: int, parts: int) -> set[str]:
    """Pipeline-like ownership: rank `part` of `parts` holds a contiguous run of layers
    (the embedding goes with the first, the norm with the last)."""
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    per = -(-len(layers) // parts)
    mine = set(layers[part * per : (part + 1) * per])
    held = set()
    for name in tensors:
        if name.startswith("layers."):
            if int(name.split(".")[1]) in mine:
                held.add(name)
        elif (name == "embed.weight" and part == 0) or (
            name == "norm.weight" and part == parts - 1
        ):
            held.add(name)
    return held

"""`layerwise_groups`: one group per layer, keyed on the outermost integer segment."""

from __future__ import annotations

import pytest

from weight_transfer import layerwise_groups


def test_decoder_model_embed_layers_then_norm_and_head() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert layerwise_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"],
        ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"],
        ["model.norm.weight", "lm_head.weight"],
    ]


@pytest.mark.parametrize(
    "prefix",
    [
        "model.layers",
        "model.language_model.layers",
        "transformer.h",
        "backbone.layers",
        "visual.blocks",
    ],
)
def test_architectures_partition_the_same_way(prefix: str) -> None:
    names = [
        f"{prefix}.0.attn.weight",
        f"{prefix}.0.norm.weight",
        f"{prefix}.1.attn.weight",
        f"{prefix}.1.norm.weight",
        f"{prefix}.10.attn.weight",
    ]
    assert layerwise_groups(names) == [names[0:2], names[2:4], names[4:5]]


def test_moe_expert_names_key_on_the_layer_not_the_expert() -> None:
    names = [
        "model.layers.3.self_attn.o_proj.weight",
        "model.layers.3.mlp.gate.weight",
        *[f"model.layers.3.mlp.experts.{e}.w{k}" for e in range(8) for k in (1, 2, 3)],
        "model.layers.4.mlp.experts.0.w1",
        "model.layers.4.mlp.experts.1.w1",
    ]
    groups = layerwise_groups(names)
    assert len(groups) == 2
    assert groups[0] == names[:26]
    assert "model.layers.3.mlp.experts.7.w1" in groups[0]
    assert groups[1] == ["model.layers.4.mlp.experts.0.w1", "model.layers.4.mlp.experts.1.w1"]


def test_vision_tower_projector_and_language_layers() -> None:
    names = [
        "visual.patch_embed.proj.weight",
        "visual.blocks.0.attn.qkv.weight",
        "visual.blocks.0.mlp.fc1.weight",
        "visual.blocks.1.attn.qkv.weight",
        "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.mlp.up_proj.weight",
        "model.language_model.layers.1.mlp.up_proj.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ]
    assert layerwise_groups(names) == [
        ["visual.patch_embed.proj.weight"],
        ["visual.blocks.0.attn.qkv.weight", "visual.blocks.0.mlp.fc1.weight"],
        ["visual.blocks.1.attn.qkv.weight"],
        # the projector and the text embedding form one un-indexed run
        [
            "multi_modal_projector.linear_1.weight",
            "multi_modal_projector.linear_2.weight",
            "model.language_model.embed_tokens.weight",
        ],
        ["model.language_model.layers.0.mlp.up_proj.weight"],
        ["model.language_model.layers.1.mlp.up_proj.weight"],
        ["model.language_model.norm.weight", "lm_head.weight"],
    ]


def test_same_index_under_different_stacks_are_different_layers() -> None:
    names = ["visual.blocks.0.w", "model.layers.0.w", "model.layers.0.b"]
    assert layerwise_groups(names) == [
        ["visual.blocks.0.w"],
        ["model.layers.0.w", "model.layers.0.b"],
    ]


def test_metadata_order_defines_the_partition() -> None:
    forward = ["embed.w", "layers.0.a", "layers.0.b", "layers.1.a", "norm.w"]
    backward = ["norm.w", "layers.1.a", "layers.0.b", "layers.0.a", "embed.w"]
    assert layerwise_groups(forward) == [
        ["embed.w"],
        ["layers.0.a", "layers.0.b"],
        ["layers.1.a"],
        ["norm.w"],
    ]
    assert layerwise_groups(backward) == [
        ["norm.w"],
        ["layers.1.a"],
        ["layers.0.b", "layers.0.a"],
        ["embed.w"],
    ]
    # un-indexed names split by a layer form two groups where they appear
    assert layerwise_groups(["a.w", "layers.0.w", "b.w"]) == [["a.w"], ["layers.0.w"], ["b.w"]]


def test_accepts_any_iterable_and_empty_input() -> None:
    assert layerwise_groups(iter(["x.0.w", "x.0.b"])) == [["x.0.w", "x.0.b"]]
    assert layerwise_groups([]) == []


def test_non_contiguous_layer_raises_naming_the_name() -> None:
    names = [
        "model.layers.0.mlp.experts.0.w1",
        "model.layers.1.mlp.experts.0.w1",
        "model.layers.0.mlp.experts.1.w1",
    ]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.1\.w1'") as err:
        layerwise_groups(names)
    assert "layer 0" in str(err.value)
    assert "contiguous" in str(err.value)


def test_layer_interrupted_by_unindexed_name_raises() -> None:
    with pytest.raises(ValueError, match=r"'layers\.0\.b'"):
        layerwise_groups(["layers.0.a", "norm.w", "layers.0.b"])

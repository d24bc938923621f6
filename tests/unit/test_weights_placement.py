"""hostd/weights/placement.py: which GPU each weight of a builtin model lies
on when it spans several (issue 39). Names and sizes only: the rule is
torch-free, so these run anywhere; the model it is wired to is not (yet)."""

from __future__ import annotations

import pytest

from hostd.weights.placement import Tensor, layer_prefix, place

MiB = 1 << 20


def qwen2(layers: int, *, tied: bool, embed: int = 100 * MiB, layer: int = 10 * MiB) -> list[Tensor]:
    """A Qwen2-shaped model's tensors in hostd's order (checkpoint.named_tensors:
    parameters in module order, then buffers), tied lm_head as an alias."""
    out = [Tensor("model.embed_tokens.weight", embed, ("lm_head.weight",) if tied else ())]
    for i in range(layers):
        out += [Tensor(f"model.layers.{i}.self_attn.q_proj.weight", layer // 2),
                Tensor(f"model.layers.{i}.mlp.down_proj.weight", layer - layer // 2)]
    out.append(Tensor("model.norm.weight", MiB))
    if not tied:
        out.append(Tensor("lm_head.weight", embed))
    out.append(Tensor("model.rotary_emb.inv_freq", 1024))
    return out


def test_one_gpu_holds_everything():
    placement = place(qwen2(4, tied=True), 1)
    assert set(placement.device_of.values()) == {0}
    assert "lm_head.weight" in placement.device_of  # aliases too
    assert placement.bytes_per_device == [sum(t.nbytes for t in qwen2(4, tied=True))]
    assert placement.layers_per_device == [range(0, 4)]


def test_untied_layers_split_evenly_embeddings_first_head_last():
    # Qwen2.5-7B's shape in bytes: embeddings and head of one size, 28 equal layers.
    placement = place(qwen2(28, tied=False, embed=1039 * MiB, layer=444 * MiB), 2)
    assert placement.layers_per_device == [range(0, 14), range(14, 28)]
    device = placement.device_of
    assert device["model.embed_tokens.weight"] == 0
    assert device["model.norm.weight"] == 1 and device["lm_head.weight"] == 1
    assert device["model.layers.13.mlp.down_proj.weight"] == 0 and device["model.layers.14.self_attn.q_proj.weight"] == 1
    first, last = placement.bytes_per_device
    assert abs(first - last) <= 2 * MiB  # the norm and inv_freq
    assert first + last == sum(t.nbytes for t in qwen2(28, tied=False, embed=1039 * MiB, layer=444 * MiB))


def test_the_split_balances_bytes_not_layer_counts():
    # A tied embedding of 10 layers' worth lies on the first GPU with its
    # lm_head alias: the first GPU takes fewer layers.
    placement = place(qwen2(24, tied=True, embed=100 * MiB, layer=10 * MiB), 2)
    assert placement.device_of["lm_head.weight"] == placement.device_of["model.embed_tokens.weight"] == 0
    assert placement.layers_per_device == [range(0, 7), range(7, 24)]
    first, last = placement.bytes_per_device
    assert max(first, last) == min(max(100 * MiB + k * 10 * MiB, (24 - k) * 10 * MiB + MiB + 1024)
                                   for k in range(25))
    # Contiguous and in order: layer i never lies on a GPU before layer i-1's.
    devices = [placement.device_of[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(24)]
    assert devices == sorted(devices)


def test_a_tied_weight_lies_once_and_every_name_of_it_maps_there():
    tensors = qwen2(4, tied=True)
    placement = place(tensors, 2)
    assert placement.device_of["lm_head.weight"] == 0  # follows the embedding it is tied to
    assert sum(placement.bytes_per_device) == sum(t.nbytes for t in tensors)  # counted once
    assert set(placement.device_of) == {n for t in tensors for n in (t.name, *t.aliases)}


def test_fewer_layers_than_gpus_leaves_gpus_empty_and_keeps_the_rule():
    placement = place(qwen2(2, tied=False), 4)
    assert placement.device_of["model.embed_tokens.weight"] == 0
    assert placement.device_of["lm_head.weight"] == 3 and placement.device_of["model.norm.weight"] == 3
    runs = placement.layers_per_device
    assert len(runs) == 4 and [i for run in runs for i in run] == [0, 1]
    # The embeddings and the head are each ten layers' worth: the two layers
    # go to the GPUs between them, one each, and those two carry no embedding.
    assert runs == [range(0, 0), range(0, 1), range(1, 2), range(2, 2)]
    assert placement.bytes_per_device == [100 * MiB, 10 * MiB, 10 * MiB, 100 * MiB + MiB + 1024]


def test_more_gpus_than_the_model_needs_leave_the_extra_ones_empty():
    placement = place([Tensor("model.layers.0.w", 10), Tensor("lm_head.weight", 1)], 3)
    assert placement.bytes_per_device.count(0) == 1 and len(placement.bytes_per_device) == 3
    assert sum(len(run) for run in placement.layers_per_device) == 1


def test_the_layers_prefix_is_found_for_other_families():
    assert layer_prefix(["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
                         "transformer.h.1.attn.c_attn.weight", "transformer.ln_f.weight"]) == "transformer.h"
    # MoE experts are numbered inside a layer: the layers have the most numbers... per prefix
    names = [f"model.layers.{i}.mlp.experts.{e}.w1" for i in range(4) for e in range(2)]
    assert layer_prefix(names) == "model.layers"
    assert layer_prefix(["lm_head.weight"]) is None


def test_what_cannot_be_split_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"gpus: cannot split the model over 2 GPUs: no decoder layers"):
        place([Tensor("lm_head.weight", 10)], 2)
    with pytest.raises(ValueError, match="gpus: a model needs at least one GPU"):
        place(qwen2(2, tied=False), 0)
    with pytest.raises(ValueError, match="given twice: lm_head.weight"):
        place([Tensor("model.embed_tokens.weight", 1, ("lm_head.weight",)), Tensor("lm_head.weight", 1)], 1)


def test_a_real_checkpoints_every_parameter_and_buffer_gets_a_gpu(tmp_path):
    """The rule on hostd's own names for the tiny random model (tied
    embeddings, two layers, rotary buffers): every name the engine would
    attach is placed, the layers split one per GPU."""
    pytest.importorskip("torch")
    from hostd.checkpoints.random_model import write_checkpoint
    from hostd.weights import checkpoint

    model = checkpoint.build_skeleton(write_checkpoint(tmp_path / "tiny"), "float32", meta_buffers=False)
    named = checkpoint.named_tensors(model)
    tensors = [Tensor(name, tensor.numel() * tensor.element_size(), tuple(aliases))
               for name, _, tensor, aliases in named]
    placement = place(tensors, 2)
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
        n for n, _ in model.named_buffers(remove_duplicate=False)}
    assert every == set(placement.device_of)
    assert placement.layers_per_device == [range(0, 1), range(1, 2)]
    assert placement.device_of["lm_head.weight"] == placement.device_of["model.embed_tokens.weight"] == 0

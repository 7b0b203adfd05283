"""Tiny random MoE models of each architecture the fused MoE path covers (fp32, CPU)."""

from __future__ import annotations

import torch

COMMON = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
_DEEPSEEK = {"n_routed_experts": 16, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
             "n_shared_experts": 1, "first_k_dense_replace": 0, "kv_lora_rank": 16,
             "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
             "v_head_dim": 16}

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "granitemoe", "gpt_oss",
         "deepseek_v2", "deepseek_v2_grouped", "deepseek_v3"]


def moe_config(arch: str, **overrides):
    import transformers

    moe = {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32}
    local = {"num_local_experts": 8, "num_experts_per_tok": 2}
    if arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**COMMON, **moe, shared_expert_intermediate_size=48)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, **moe, norm_topk_prob=True)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, **local)
    elif arch == "olmoe":
        cfg = transformers.OlmoeConfig(**COMMON, **moe)
    elif arch == "granitemoe":
        cfg = transformers.GraniteMoeConfig(**COMMON, **local)
    elif arch == "gpt_oss":
        cfg = transformers.GptOssConfig(**COMMON, **local, head_dim=16)
    elif arch == "deepseek_v2":
        cfg = transformers.DeepseekV2Config(**COMMON, **_DEEPSEEK, topk_method="greedy",
                                            routed_scaling_factor=1.5)
    elif arch == "deepseek_v2_grouped":
        cfg = transformers.DeepseekV2Config(**COMMON, **_DEEPSEEK,
                                            topk_method="group_limited_greedy", n_group=4,
                                            topk_group=2, routed_scaling_factor=1.5)
    elif arch == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**COMMON, **_DEEPSEEK, n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5, norm_topk_prob=True)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def moe_model(arch: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random fp32 model of ``arch`` with weights large enough for sharp routing (biases
    and DeepSeek-V3's correction bias non-zero)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch, **overrides),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
            elif "bias" in name:
                param.normal_(0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE blocks: modules with an ``experts`` child."""
    return [m for m in model.modules() if hasattr(m, "experts")
            and isinstance(getattr(m.experts, "gate_up_proj", None), torch.nn.Parameter)]

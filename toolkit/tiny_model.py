"""Tiny models for the demo and the tests: random weights, a tokenizer trained on the spot.

Nothing here touches a model hub. ``build_tiny_model(path, arch)`` writes a directory that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load like any checkpoint
(config.json, model.safetensors, tokenizer.json with a chat template).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

Arch = Literal["llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"]
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe",
                          "mixtral", "olmoe")
# the MoE archs: 8 experts of width 32, top 2 (qwen2_moe also a gated shared expert)
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be or not to be, that is the question. All that glitters is not gold.
Ray schedules actors across a cluster; each actor holds a model and a paged key value cache.
Large language models generate text one token at a time, sampling from a distribution.
Temperature, top-k, top-p and min-p shape that distribution before a token is drawn.
Parquet files store columns; Arrow tables move them between processes without copies.
Once upon a time there was a small robot who wanted to learn how to write poems.
The weather today is sunny with a chance of rain in the afternoon and wind at night.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 3.14 2.718.
Questions? Answers! Lists: apples, oranges, pears; colours: red, green, blue, yellow.
def main(): print("hello, world") # code also appears in prompts, with (brackets) and [lists].
Unicode too: café, naïve, über, 東京, привет, مرحبا, emoji 🙂 and accents àéîõü.
"""


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a small built-in corpus, wrapped for transformers."""
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
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token=EOS_TOKEN,
        pad_token="<|pad|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: Arch, vocab_size: int, *, sliding_window: int | None = None, **overrides):
    """A small config of ``arch`` (2 layers, GQA, fp32 weights)."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=3,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        extra = {}
        if sliding_window is not None:
            extra = dict(use_sliding_window=True, sliding_window=sliding_window,
                         max_window_layers=1)
        cfg = transformers.Qwen2Config(**common, **extra)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "tie_word_embeddings": True}, head_dim=32)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=sliding_window or 4096)
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, **_MOE, shared_expert_intermediate_size=48,
                                          norm_topk_prob=False)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, **_MOE, head_dim=32, norm_topk_prob=True)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                                         sliding_window=sliding_window)
    elif arch == "olmoe":
        cfg = transformers.OlmoeConfig(**common, **_MOE, norm_topk_prob=False)
    else:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny_model(
    path: str | os.PathLike,
    arch: Arch = "llama",
    *,
    vocab_size: int = 512,
    seed: int = 0,
    sliding_window: int | None = None,
    **config_overrides,
) -> Path:
    """Writes a random-weight ``arch`` model and a trained tokenizer to ``path``.

    Deterministic for a given (arch, vocab_size, seed, overrides). Returns the path.

    Example:
        >>> p = build_tiny_model("/tmp/tiny-llama", "llama")  # doctest: +SKIP
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    real_vocab = len(tokenizer)
    cfg = tiny_config(arch, real_vocab, sliding_window=sliding_window, **config_overrides)
    cfg.eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    cfg.bos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cfg.pad_token_id = tokenizer.convert_tokens_to_ids("<|pad|>")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: sharper, less uniform logits
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / "raygen_tiny.json").write_text(
        json.dumps({"arch": arch, "vocab_size": vocab_size, "seed": seed})
    )
    return path

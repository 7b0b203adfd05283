"""The architecture sweep: every causal LM registered in the installed transformers, built tiny
from its config class (random weights), run through the engine and compared with HF's own
forward (fp32, CPU).

``classify(model_type, workdir, tokenizer_dir)`` returns ``(status, reason)`` with status one
of "exact", "refused" (a clear error before loading), "refused after loading" (by the
load-time attention probe), "wrong", "crash", or "not built" (the generic shrinking could not
make it tiny: a limit of this harness, not of the engine). Run as a script to
write the table: ``PYTHONPATH=$PWD python -m tests.actors.engine.model.model_sweep docs/model_coverage.md``.
"""

from __future__ import annotations

import inspect
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

VOCAB = 512
#: tiny values for whichever of these fields a config class has
TINY: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "head_dim": 16,
    "max_position_embeddings": 256, "initializer_range": 0.1,
    # aliases some classes use instead
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "d_model": 64,
    "num_layers": 2, "n_layers": 2, "n_heads": 4, "num_heads": 4, "ffn_dim": 64,
    "n_inner": 64, "num_kv_heads": 2, "multi_query_group_num": 2,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "num_experts_per_token": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # multi-head latent attention
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    # per-layer input embeddings (gemma3n / gemma4), byte-group hashes (blt)
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    "encoder_hash_byte_group_vocab": 64,
    "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 3,
}
WINDOW = 8          # sliding windows are shrunk to this (prompts are longer)
PROMPT_LENGTHS = (5, 13)
MAX_TOKENS = 4
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 8, "block_size": 4,
          "num_kv_blocks": 64, "max_model_len": 64}
LOGPROB_ATOL = 1e-4


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _init_params(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= set(inspect.signature(init).parameters)
    return names


def _tiny_kwargs(cls: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """Constructor keywords making ``cls`` (a config class) tiny, sub-configs included."""
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - some classes validate their defaults away
        default = None
    params = _init_params(cls)
    aliases = getattr(cls, "attribute_map", {}) or {}
    kwargs = {}
    for key, value in {**TINY, **overrides}.items():
        if key in params or (key in aliases and aliases[key] in params) or key in overrides:
            kwargs[aliases.get(key, key) if key not in params else key] = value
    window = getattr(default, "sliding_window", None)
    if isinstance(window, int) and "sliding_window" not in overrides and window > WINDOW:
        kwargs["sliding_window"] = WINDOW
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        instance = getattr(default, name, None)
        if instance is not None and hasattr(instance, "to_dict"):
            sub = type(instance)  # the class an AutoConfig entry resolves to
        if name in params and isinstance(sub, type) and name not in overrides:
            try:
                kwargs[name] = _tiny_kwargs(sub, {})
            except Exception:  # noqa: BLE001 - keep that sub-config's defaults
                pass
    return kwargs


def tiny_config(model_type: str, **overrides: Any):
    """The config class of ``model_type`` with every size field it has made tiny."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return AutoConfig.for_model(model_type,
                                **_tiny_kwargs(CONFIG_MAPPING[model_type], overrides))


#: models above this many parameters after shrinking were not made tiny (a sub-config the
#: generic shrinking does not reach): not built
MAX_PARAMS = 5_000_000


def num_params(config) -> int:
    """Parameters of the CausalLM ``config`` describes (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


class NotTiny(Exception):
    """The generic shrinking left the model too large to build in a test."""


#: tried in turn when HF's own forward fails on the tiny config (e.g. MLA wants as many KV
#: heads as query heads)
FALLBACKS: tuple[dict[str, Any], ...] = (
    {}, {"num_key_value_heads": 4, "num_kv_heads": 4, "multi_query_group_num": 4},
    {"rotary_dim": 8}, {"num_experts_per_tok": 1}, {"expand": 1},
    {"attention_types": [[["global", "local"], 1]]}, {"hidden_size_per_layer_input": 0},
)


def configs(model_type: str, **overrides: Any):
    """The tiny configs of ``model_type`` that its config class accepts, one per fallback."""
    error, yielded = None, False
    for extra in FALLBACKS:
        try:
            config = tiny_config(model_type, **{**extra, **overrides})
        except Exception as exc:  # noqa: BLE001 - the class validated it away: next one
            error = exc
            continue
        yielded = True
        yield config
    if not yielded:
        raise error


def build(model_type: str, path: Path, **overrides: Any):
    """Writes a random-weight tiny ``model_type`` CausalLM (fp32) to ``path``, with the first
    of ``FALLBACKS`` that HF's own eager forward runs; returns its config."""
    from transformers import AutoModelForCausalLM

    error = None
    for config in configs(model_type, **overrides):
        size = num_params(config)
        if size > MAX_PARAMS:
            raise NotTiny(f"{size / 1e6:.0f}M parameters after shrinking")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
        try:
            with torch.no_grad():
                model(torch.tensor([[5, 6, 7]]))
        except Exception as exc:  # noqa: BLE001 - try the next fallback
            error = exc
            continue
        model.save_pretrained(path)
        return config
    raise error


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def compare(engine_outs, hf_model, prompt_list) -> tuple[bool, str]:
    """Engine greedy outputs vs the HF forward over prompt + outputs: each output token is
    HF's argmax (or within LOGPROB_ATOL of it: a tie) and its raw logprob within the bound."""
    worst = 0.0
    for out in engine_outs:
        prompt = prompt_list[out.id]
        tokens = out.output_token_ids
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():  # the mask generate() passes (transformers 5.17's moshi attends
            # to every position of a forward given none)
            logits = hf_model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)  # rows predicting outputs
        if len(tokens) != MAX_TOKENS:
            return False, f"request {out.id}: {len(tokens)} tokens, expected {MAX_TOKENS}"
        got = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        diff = (torch.tensor(out.raw_logprobs) - got).abs().max().item()
        worst = max(worst, diff)
        margin = (logp.max(-1).values - got).max().item()
        if margin > LOGPROB_ATOL:
            return False, (f"request {out.id}: greedy tokens differ from HF's argmax "
                           f"(by {margin:.3g} in logprob); max logprob diff {diff:.3g}")
    if worst > LOGPROB_ATOL:
        return False, f"raw logprobs differ from HF's by up to {worst:.3g}"
    return True, f"max logprob diff {worst:.1e}"


def classify(model_type: str, workdir: Path, tokenizer_dir: str,
             **overrides: Any) -> tuple[str, str]:
    """Runs one architecture; returns ``(status, reason)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from actors.engine.llm_engine import Engine
    from actors.engine.model.model_support import UnsupportedModelError, check_architecture
    from sampler import SamplingParams

    path = workdir / model_type
    try:
        config = next(configs(model_type, **overrides))
    except Exception as exc:  # noqa: BLE001 - a config class that cannot be built bare
        return "not built", (f"its config class cannot be built from defaults "
                             f"({type(exc).__name__})")
    try:
        check_architecture(config, trust_remote_code=False)
    except UnsupportedModelError as exc:
        return "refused", str(exc)
    try:
        build(model_type, path, **overrides)
    except NotTiny as exc:
        return "not built", str(exc)
    except Exception as exc:  # noqa: BLE001
        return "not built", (f"HF's own forward fails on the generic tiny config "
                             f"({type(exc).__name__}: {str(exc)[:100]})")
    try:
        check_architecture(AutoConfig.from_pretrained(str(path)), trust_remote_code=False)
    except UnsupportedModelError as exc:  # the saved config, as the engine reads it
        return "refused", str(exc)
    try:
        engine = Engine(str(path), {**ENGINE, "tokenizer": tokenizer_dir})
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompt_list = prompts()
        outs = engine.generate([(i, p, params) for i, p in enumerate(prompt_list)],
                               token_logprobs=True)
    except UnsupportedModelError as exc:
        return "refused at load", str(exc)
    except Exception as exc:  # noqa: BLE001
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        return "crash", f"{type(exc).__name__}: {exc} ({Path(tb.filename).name}:{tb.lineno})"
    hf = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    ok, reason = compare(outs, hf, prompt_list)
    return ("exact" if ok else "wrong"), reason


def main(argv: list[str]) -> int:
    import tempfile

    import transformers

    from toolkit.tiny_model import train_tokenizer

    torch.set_num_threads(1)
    out_path = Path(argv[0]) if argv else None
    only = argv[1:]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tokenizer"
        train_tokenizer(VOCAB).save_pretrained(tok)
        for model_type in only or causal_lm_types():
            t0 = time.perf_counter()
            status, reason = classify(model_type, Path(tmp), str(tok))
            rows.append((model_type, status, reason, time.perf_counter() - t0))
            print(f"{model_type:28s} {status:8s} {rows[-1][3]:5.1f}s  {reason[:150]}",
                  flush=True)
    if out_path is not None:
        write_table(out_path, rows, transformers.__version__)
    return 0


def write_table(path: Path, rows: list, version: str) -> None:
    counts: dict[str, int] = {}
    for _, status, _, _ in rows:
        counts[status] = counts.get(status, 0) + 1
    lines = [
        "# Model coverage",
        "",
        f"Every causal-LM architecture registered in transformers {version} "
        "(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built tiny from its config class (random fp32 "
        "weights: hidden 64, 2 layers, 4/2 heads, vocab 512, sliding windows 8, 4 experts), "
        f"{len(PROMPT_LENGTHS)} prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, "
        f"{MAX_TOKENS} greedy tokens through the engine (CPU, torch attention backend, chunked "
        "prefill of 8 tokens, pages of 4) against HF's own eager forward: *exact* = every "
        "token is HF's argmax and its raw logprob is within 1e-4 of HF's; *refused* = a clear "
        "error before any weight is loaded. Reproduce with "
        "`PYTHONPATH=$PWD python -m tests.actors.engine.model.model_sweep docs/model_coverage.md`; the CI "
        "test is `tests/actors/engine/model/test_model_coverage.py`.",
        "",
        "Summary: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".",
        "",
        "*refused at load*: refused by the load-time attention probe or while the model is "
        "constructed (no weight is used); *not built*: the generic shrinking of this harness "
        "could not make a tiny model HF itself runs (a limit of the test, not a verdict on "
        "the engine). How the engine runs these models:",
        "",
        "- Logits: the CausalLM's own forward runs on the base model's final hidden states "
        "(`actors/engine/model/lm_head.py`), so every scaling after the decoder is the model's code; at "
        "load it is checked against the full forward.",
        "- KV shapes come from what the attention modules pass (the load-time probe). MLA "
        "(deepseek_v2/v3, glm4_moe_lite, sarvam_mla, ...): full per-head keys "
        "(`qk_nope_head_dim + qk_rope_head_dim`) and values (`v_head_dim`), not the compact "
        "latent cache; the pool's rows are as wide as the keys and values use their first "
        "`v_head_dim` entries (for DeepSeek-V3's 192/128, 20% more memory than separate "
        "pools). FlashInfer plans such layers with `head_dim_qk`/`head_dim_vo`.",
        "- Soft-capped attention (gemma2) and attention sinks (gpt_oss): the torch backend "
        "materialises the scores in transformers' eager order; FlashInfer uses "
        "`logits_soft_cap` and, for sinks, `BatchAttentionWithAttentionSinkWrapper` (its "
        "0.6.4 default FA2 module ignores `run(sinks=)`).",
        "- Attention that bypasses the registry but calls torch's SDPA (falcon in transformers "
        "5.17; in 5.25 falcon uses the registry and no causal LM calls SDPA itself) is routed to "
        "the paged backends by `actors/engine/model/attention/sdpa_adapter.py`; stablelm uses the registry "
        "without declaring it.",
        "- On an H200 (bf16, FlashInfer, CUDA-graph decode), `tests/actors/engine/model/test_gpu_model_families.py` runs gemma2- (soft-capping, window 8), gpt_oss- (sinks, experts, window 8) and deepseek_v3-shaped (MLA, experts) models against HF in bf16: logits within twice HF's own bf16 error of its fp32 forward (routed-expert models compared by the mean and 90th percentile of the per-position errors: one router near-tie flip dominates the largest error, of HF's bf16 forward too), greedy outputs equal to HF's up to bf16 near-ties; with `test_gpu_attention_variants.py`, 15 passed (run BC, docs/history/benchmarks_history.md).",
        "",
        "| architecture | status | reason |",
        "|---|---|---|",
    ]
    for model_type, status, reason, _ in rows:
        lines.append(f"| {model_type} | {status} | {reason.replace('|', '/')[:300]} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

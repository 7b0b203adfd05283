"""The model's own head path: what a transformers CausalLM's forward does after its decoder.

The engine runs the base model (decoder + final norm) on the paged KV cache and computes logits
only for the rows it samples or scores. Those rows go through the CausalLM's own ``forward``
with its base model replaced by a stand-in that returns the given hidden states: the LM head
and every model-specific step after it (granite's ``logits_scaling`` division, gemma's final
soft-capping, cohere's ``logit_scale``, ...) are the model's code, not a re-implementation.
The stand-in lives in a shallow copy of the model that shares every other module (and so every
weight, also after a weight update) with it. ``check_head`` verifies at load time that this
path reproduces the model's own full forward. When the path turns out to be the output
embedding alone (bit for bit on probe rows), that module is called directly.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
from typing import Any

import torch

_HIDDEN: contextvars.ContextVar[torch.Tensor] = contextvars.ContextVar("raygen_head_hidden")


class _HiddenOutput:
    """A base model's output holding only the final hidden states (every other field, such
    as past key values, attentions or router logits, is None)."""

    def __init__(self, hidden: torch.Tensor):
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # only reached for fields not set
        return None

    def __getitem__(self, index: int | str) -> torch.Tensor:
        if index in (0, "last_hidden_state"):
            return self.last_hidden_state
        raise IndexError(index)


class _GivenHidden(torch.nn.Module):
    """Stands in for the base model: returns the hidden states being projected. A CausalLM
    that calls a part of its base model (OPT: ``self.model.decoder(...)``) reaches this
    module again through any attribute it lacks."""

    def forward(self, *args: Any, **kwargs: Any) -> _HiddenOutput:
        return _HiddenOutput(_HIDDEN.get())

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return self


def base_model_attribute(model: torch.nn.Module) -> str | None:
    """The name of the child module that is ``model.base_model`` (None if there is none)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        return None
    return next((name for name, child in model.named_children() if child is base), None)


class ModelHead:
    """Logits of given final hidden states through the CausalLM's own forward.

    Args:
        model: a loaded transformers CausalLM whose ``base_model`` is one of its children.
    """

    def __init__(self, model: torch.nn.Module):
        name = base_model_attribute(model)
        if name is None:
            raise ValueError(f"{type(model).__name__}: its base model is not a child module")
        head = copy.copy(model)
        head._modules = dict(model._modules)
        head._modules[name] = _GivenHidden()
        self._head = head
        params = inspect.signature(type(model).forward).parameters
        kwargs: dict[str, Any] = {}
        for key, value in (("use_cache", False), ("logits_to_keep", 0),
                           ("output_router_logits", False), ("return_dict", True)):
            if key in params:
                kwargs[key] = value
        self._kwargs = kwargs
        self.direct: torch.nn.Module | None = None  # see use_output_embeddings_if_equal

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` final hidden states -> ``[R, vocab]`` logits (the model's dtype)."""
        if self.direct is not None:
            return self.direct(hidden)
        return self.through_model(hidden)

    @torch.no_grad()
    def use_output_embeddings_if_equal(self, output_embeddings: torch.nn.Module | None
                                       ) -> bool:
        """Calls ``output_embeddings`` directly from now on when the model's head path equals
        it bit for bit on probe rows of growing magnitude (1 to 1e3: any scaling or capping
        shows), saving the CausalLM forward's Python overhead per step. Returns whether."""
        weight = getattr(output_embeddings, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return False
        gen = torch.Generator().manual_seed(0)
        scale = torch.tensor([1.0, 10.0, 100.0, 1000.0])[:, None]
        rows = (torch.randn(4, weight.shape[1], generator=gen) * scale).to(weight.device,
                                                                          weight.dtype)
        theirs = self.through_model(rows)
        ours = output_embeddings(rows)
        if ours.shape == theirs.shape and torch.equal(ours, theirs):
            self.direct = output_embeddings
        return self.direct is not None

    def through_model(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head path through the CausalLM's own forward."""
        token = _HIDDEN.set(hidden[None])
        try:
            ids = torch.zeros((1, hidden.shape[0]), dtype=torch.long, device=hidden.device)
            out = self._head(input_ids=ids, **self._kwargs)
        finally:
            _HIDDEN.reset(token)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0]


@torch.no_grad()
def check_head(model: torch.nn.Module, head: ModelHead, hidden: torch.Tensor,
               full_logits: torch.Tensor) -> float | None:
    """None when ``head(hidden)`` equals ``full_logits`` (the model's own forward on the same
    input, ``[R, vocab]``) within rounding (1e-5 of the largest logit in float32, 2e-2 in
    16-bit dtypes); else the largest difference."""
    ours = head.through_model(hidden)
    rel = 1e-5 if ours.dtype == torch.float32 else 2e-2
    ours, theirs = ours.float(), full_logits.float()
    if ours.shape != theirs.shape:
        return float("inf")
    err = (ours - theirs).abs().max().item()
    scale = max(theirs.abs().max().item(), 1.0)
    return None if err <= rel * scale else err

"""Tied embeddings under pipeline parallelism, synced without `.cuda()` on the CPU."""

from __future__ import annotations

import torch

UPSTREAM = ("megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",)


def apply() -> None:
    """With tied embeddings under pipeline parallelism the last stage keeps its own copy of
    the word embeddings, and `LanguageModule.setup_embeddings_and_output_layer` makes the two
    copies equal with `weight.data = weight.data.cuda()` and an all-reduce over the embedding
    group. On CPU `.cuda()` raises; during that one call it is the identity (the data is
    already where gloo wants it), and the all-reduce runs as written."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kwargs: t  # type: ignore[method-assign]  # (the patch: a no-op .cuda())
        try:
            return original(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]  # (restored)

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer

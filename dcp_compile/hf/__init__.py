"""Front end for unmodified transformers MLA models (DeepSeek-V2 / V3 and the families that load
as them): a cache shim over the KV pool (cache.py), the absorb pass (absorb.py) that rewrites
their attention into the canonical ops so that the DCP passes apply unchanged, and apply's path
for them (model.py). Importing this package does not import transformers."""

from __future__ import annotations

import sys


def is_transformers_model(model) -> bool:
    """Whether `model` is a transformers PreTrainedModel (transformers is then already imported)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)

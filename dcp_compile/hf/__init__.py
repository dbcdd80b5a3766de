"""Front end for unmodified transformers MLA models (DeepSeek-V2 / V3 and the families that load
as them): a cache shim over the KV pool (cache.py) and the absorb pass (absorb.py) that rewrites
their attention into the canonical ops, so that the DCP passes apply unchanged."""

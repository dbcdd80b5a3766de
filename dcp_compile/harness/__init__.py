"""The demo's harness: a DCP run compared with dcp_size=1 (scenario.py), on spawned or torchrun ranks."""

"""Debugging aids: per-pass graph dumps (text, HTML, SVG) and shape-only capture of the model
presets, used by `dcp-compile dump`, DCP_COMPILE_DUMP and bench/pass_pipeline.py.

Modules are imported where used: dcp_compile.passes imports dump.py, so this package must not
import the passes at import time.
"""

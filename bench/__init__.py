"""Benchmarks: each module is a script, run from the repository root as `python -m bench.NAME`
(`torchrun --nproc-per-node N -m bench.NAME` for the ones that run on several ranks).

Every script prints a table and writes one JSON result in the schema of `bench.lib.result`
(machine, versions, the exact command, run-wide figures, and a row per measured case);
`python -m bench.report RESULT.json ...` reads any of them, the results committed under
`bench/results/` before that schema included. What the scripts share lives in `bench.lib`:
timing (`timing`), the roofline floor (`roofline`), the layers, page tables and batches they
time (`cases`), the result record (`result`) and the plots (`plots`).
"""

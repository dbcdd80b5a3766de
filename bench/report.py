"""Read bench results and print their tables (markdown, for the README), with a plot on request.

    python -m bench.report bench/results/step_h200.json --plot bench/results/step_h200.png
    python -m bench.report bench/results/decode_h200x2.json
    python -m bench.report bench/results/lowerings_h200.json bench/results/dcp_step_h200x2.json --plot out.png

Reads any result a bench script writes (bench.lib.result's schema), and the results committed
before that schema. Given a bench.lowerings and a bench.dcp_step result it also checks issue 10's
targets across the two. --plot draws bench.step's, bench.decode's, or (lowerings and dcp_step
together) the speed plot; it needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys

from bench.lib import plots, tables
from bench.lib.result import read


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="result JSON files")
    parser.add_argument("--plot", default=None, help="PNG path")
    args = parser.parse_args(argv)
    results = [read(path) for path in args.results]
    by_benchmark = {result["benchmark"]: result for result in results}
    for result in results:
        if len(results) > 1:
            print(f"\n{tables.header(result)}")
        print("\n".join(tables.lines(result)))
    speed = "lowerings" in by_benchmark and "dcp_step" in by_benchmark
    if speed:
        print("\ntargets\n" + "\n".join(tables.speed_targets(by_benchmark["lowerings"], by_benchmark["dcp_step"])))
    if args.plot:
        if speed:
            plots.speed(by_benchmark["lowerings"], by_benchmark["dcp_step"], args.plot)
        elif len(results) == 1 and results[0]["benchmark"] == "step":
            plots.step(results[0], args.plot, tables.combo)
        elif len(results) == 1 and results[0]["benchmark"] == "decode":
            plots.decode(results[0], args.plot)
        else:
            parser.error("--plot draws one bench.step or bench.decode result, or a bench.lowerings and a "
                         f"bench.dcp_step result together; got {[r['benchmark'] for r in results]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

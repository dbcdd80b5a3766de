"""A host stand-in for device graphs (CUDA / NPU graphs) on the CPU: `RerunGraphs` captures a step
by running it once, and replays it by running it again on the same static inputs into the
captured output, as a device graph replays its kernels. For steps with no host-fed inputs (the
torch and Triton kernels): a replay reruns the step's Python, so a host feed would be fed from
the capture's template, not from the runner's."""

from __future__ import annotations

import torch


class RerunGraphs:
    device = torch.device("cpu")

    def capture(self, run, prepare=None):
        output = run()
        return (run, output), output

    def replay(self, graph, updates) -> None:
        run, output = graph
        output.copy_(run())

    def applied(self, graph):
        return None

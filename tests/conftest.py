"""Without a GPU, Triton kernels run under the interpreter. The variable must be set before
anything (dynamo, inductor, a test module) imports triton, so it is set here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

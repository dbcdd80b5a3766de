"""The model of the in-process NPU tests: tiny-512 (the latent widths FIA's MLA path takes) cut to
3 layers, mla, linear, mla: two MLA layers (the local metadata and the FIA lengths shared by
layers, a later layer's KV following the attention of the one above) and a linear-attention one.
Off the hardware the Triton kernels of the NPU lowering run in Triton's interpreter, once per MLA
layer, so a fourth layer (a third MLA one) adds a third to the time and nothing to what is tested
(tests/distributed/test_npu_lowering.py runs the same 3 layers on ranks)."""

from dcp_compile.models.config import preset

TINY_512 = preset("tiny-512").with_layers(3)

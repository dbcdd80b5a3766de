"""How a packed all-to-all buffer carries each fp32 LSE: bit for bit, in its trailing words.

`reference.pack_partials` views the fp32 LSE as w = 4 / itemsize elements of the output dtype:
one element for fp32, two 16-bit halves (low half first, little-endian) for bf16 and fp16.
These helpers write and read those words through integer bitcasts inside the kernel, so they
work for any R and any strides: no second fp32 view of the buffer, which would need R even and a
4-byte-aligned row stride.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_lse_words(word_ptr, stride_word, lse, mask, LSE_WORDS: tl.constexpr):
    """Store fp32 `lse` at word_ptr as LSE_WORDS elements of the pointer's dtype."""
    if LSE_WORDS == 1:
        tl.store(word_ptr, lse.to(tl.float32), mask=mask)
    else:
        bits = lse.to(tl.float32).to(tl.int32, bitcast=True)
        low = (bits & 0xFFFF).to(tl.int16).to(word_ptr.dtype.element_ty, bitcast=True)
        high = ((bits >> 16) & 0xFFFF).to(tl.int16).to(word_ptr.dtype.element_ty, bitcast=True)
        tl.store(word_ptr, low, mask=mask)
        tl.store(word_ptr + stride_word, high, mask=mask)


@triton.jit
def load_lse_words(word_ptr, stride_word, mask, LSE_WORDS: tl.constexpr):
    """Load the fp32 LSE stored by `store_lse_words`; masked lanes read -inf (an empty shard)."""
    if LSE_WORDS == 1:
        lse = tl.load(word_ptr, mask=mask, other=float("-inf")).to(tl.float32)
    else:
        low = tl.load(word_ptr, mask=mask, other=0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        high = tl.load(word_ptr + stride_word, mask=mask, other=0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        lse = tl.where(mask, (low | (high << 16)).to(tl.float32, bitcast=True), float("-inf"))
    return lse

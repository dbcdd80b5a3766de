"""Runtime: KV pool, batch metadata, process groups, layout math."""

from dcp_compile.runtime.batch import ForwardBatch, RequestTable
from dcp_compile.runtime.kv_pool import MLAKVPool
from dcp_compile.runtime.parallel import ParallelState

__all__ = ["ForwardBatch", "MLAKVPool", "ParallelState", "RequestTable"]

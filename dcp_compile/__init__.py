"""dcp_compile: decode context parallelism for MLA models, as torch.compile graph passes."""

from dcp_compile import ops  # registers the dcp:: ops
from dcp_compile.api import DCPState, apply, state
from dcp_compile.config import DCPConfig
from dcp_compile.models import load_pretrained

__all__ = ["DCPConfig", "DCPState", "apply", "load_pretrained", "ops", "state"]

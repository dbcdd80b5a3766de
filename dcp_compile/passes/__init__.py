"""Graph passes that rewrite canonical MLA ops into decode context parallelism."""

from dcp_compile.passes.base import GraphPass, PassConfig
from dcp_compile.passes.manager import PASS_NAMES, PassManager, PassReport, default_passes

__all__ = ["GraphPass", "PassConfig", "PASS_NAMES", "PassManager", "PassReport", "default_passes"]

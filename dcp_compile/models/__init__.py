"""The reference MLA model: presets with random weights, or a checkpoint's weights."""

from dcp_compile.models.config import MLAModelConfig, PRESETS, preset
from dcp_compile.models.mla import MLAModel
from dcp_compile.models.pretrained import load_pretrained

__all__ = ["MLAModel", "MLAModelConfig", "PRESETS", "load_pretrained", "preset"]

"""Looking inside models: attention capture and pictures."""

from attnlab.analysis.capture import capture_attention
from attnlab.analysis.plots import plot_attention_heads

__all__ = ["capture_attention", "plot_attention_heads"]

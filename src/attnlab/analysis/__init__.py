"""Looking inside models: capture attention, measure heads, intervene, draw and view.

- ``capture(model, inputs, layers, heads)``: the attention weights per kind, layer and head;
- ``metrics``: entropy, distance, diagonal / previous / first-token shares, broadness,
  Jensen-Shannon head similarity and ``head_report``;
- ``hooks``: the named hook points of any model (q, k, v, scores, pattern, z in every
  attention layer; resid_pre, attn_out, resid_mid, mlp_out, resid_post in every decoder
  block), ``run_with_cache``, ``run_with_hooks`` and the ``hooks`` block;
- ``ablation``: zero / mean head ablation and ``head_importance``;
- ``plots`` (PNG) and ``viewer`` (one self-contained interactive HTML file).
"""

from attnlab.analysis.ablation import ablate_heads, head_importance
from attnlab.analysis.capture import (
    AttentionCapture,
    AttentionMaps,
    capture,
    capture_attention,
)
from attnlab.analysis.hooks import (
    attention_modules,
    hook_names,
    hook_points,
    hooks,
    run_with_cache,
    run_with_hooks,
)
from attnlab.analysis.metrics import (
    attention_distance,
    broadness,
    diagonal_share,
    entropy,
    first_token_share,
    head_report,
    head_similarity,
    js_divergence,
    previous_token_share,
)
from attnlab.analysis.plots import (
    plot_attention_heads,
    plot_head_similarity,
    plot_masks,
    plot_metric_map,
    plot_single_vs_multi,
)
from attnlab.analysis.table import Table
from attnlab.analysis.viewer import save_html

__all__ = [
    "AttentionCapture",
    "AttentionMaps",
    "Table",
    "ablate_heads",
    "attention_distance",
    "attention_modules",
    "broadness",
    "capture",
    "capture_attention",
    "diagonal_share",
    "entropy",
    "first_token_share",
    "head_importance",
    "head_report",
    "head_similarity",
    "hook_names",
    "hook_points",
    "hooks",
    "js_divergence",
    "plot_attention_heads",
    "plot_head_similarity",
    "plot_masks",
    "plot_metric_map",
    "plot_single_vs_multi",
    "previous_token_share",
    "run_with_cache",
    "run_with_hooks",
    "save_html",
]

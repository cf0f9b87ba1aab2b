"""attnlab's functional namespace, as ``torch.nn.functional``: ``linear``, ``softmax``
(:mod:`attnlab.formulas`) and ``scaled_dot_product_attention`` (:mod:`attnlab.attention.sdpa`,
which chooses among the attention backends).
"""

from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.formulas import linear, softmax

__all__ = ["linear", "scaled_dot_product_attention", "softmax"]

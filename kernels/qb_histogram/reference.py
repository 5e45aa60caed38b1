"""Quantile Balancing's histogram update in plain torch: the reference of the Triton kernel and the CPU path.

For one micro-batch's router scores s [N, E] (sigmoid, fp32), each token's cutoff α [N] (its (k+1)-th
biased score) and a grid of B bins of width w from lo (0-d fp32 tensors), every (token i, expert e)
adds one to its bin of expert e's row of the integer counts [E, B]:

    r_ie   = α_i − s_ie
    bin_ie = clamp(⌊(r_ie − lo) / w⌋, 0, B − 1)          (fp32 arithmetic, IEEE division)
    counts[e, bin_ie] += 1

so that counts[e] is the histogram of r_{:, e} from which ``histogram_bias`` reads the quantile.
"""

from __future__ import annotations

import torch


def histogram_add(counts: torch.Tensor, scores: torch.Tensor, cutoff: torch.Tensor, lo: torch.Tensor,
                  width: torch.Tensor) -> None:
    """counts [E, B] int32 (added into), scores [N, E] fp32, cutoff [N] fp32, lo and width 0-d fp32."""
    r = cutoff.unsqueeze(1) - scores
    idx = ((r - lo) / width).floor().long().clamp_(0, counts.shape[1] - 1)  # [N, E]
    counts.scatter_add_(1, idx.t(), torch.ones(idx.t().shape, dtype=counts.dtype, device=counts.device))

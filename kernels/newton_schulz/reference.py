"""Plain-torch reference for the fused kernel: one matrix at a time, float64."""

from k3train.optim.newton_schulz import newton_schulz_reference  # noqa: F401  (single source of truth)

"""vla.training."""

"""vla.eval."""

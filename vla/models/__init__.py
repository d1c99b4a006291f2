"""vla.models."""

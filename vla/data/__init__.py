"""vla.data."""

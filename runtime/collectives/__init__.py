"""runtime.collectives."""

"""runtime.observe."""

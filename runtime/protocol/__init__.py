"""runtime.protocol."""

"""runtime.transport."""

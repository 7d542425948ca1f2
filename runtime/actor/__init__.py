"""runtime.actor."""

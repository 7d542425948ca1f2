"""runtime.coordinator."""

"""paramsync.runtime.actor."""

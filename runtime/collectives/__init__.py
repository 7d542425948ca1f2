"""paramsync.runtime.collectives."""

"""paramsync.actors.testing: harness-side wrappers around a worker's actors (the fault trials')."""

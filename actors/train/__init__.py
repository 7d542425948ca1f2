"""paramsync.actors.train."""

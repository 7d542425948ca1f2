"""paramsync.actors.state."""

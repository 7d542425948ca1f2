"""actors.train."""

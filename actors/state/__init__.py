"""actors.state."""

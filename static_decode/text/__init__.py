"""Text around the tokens: chat templates and stop strings."""

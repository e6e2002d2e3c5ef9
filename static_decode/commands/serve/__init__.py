"""`static-decode serve`: the OpenAI-compatible HTTP server over one decode worker."""

"""The seed's contract: the KV cache written in place, grouped-query attention over it, the float64 reference."""

"""Helpers every layer uses: argument checks, lazy exports, progress bars, profiler ranges."""

"""The built-in layout-search heuristics."""

"""The steps of `quantize`, one per file; pipeline.py lists them in the order they run."""

"""Benchmarks that ship with the package (``vpage bench ...``)."""

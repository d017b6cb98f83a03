"""Benchmarks of the kernels and the engine, each run from the repository root as
`python -m benchmarks.NAME --out DIR`. Results kept in the repository are under
benchmarks/results/ (see CONTRIBUTING.md)."""

"""Everything the ``sparcml`` command runs: the CLI, benchmarks, the simulator,
calibration, the emulated cluster and the training recipes.

The library (everything outside this package) never imports it.
"""

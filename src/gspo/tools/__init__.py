"""tools: what a user runs around training, built on the library.

The offline audit of recorded steps (``audit``), the equal-budget comparison of objectives over
seeds with its statistics and report (``compare``, ``compare_stats``, ``compare_report``), and the
preflight checks of user input before any model is built (``preflight``).

It never imports the CLI; only ``gspo.cli`` is above it. Nothing in the library imports a tool.
"""

"""Reporting a run: the console and the run log (`logs`), progress, metrics.jsonl and
TensorBoard (`metrics`), and the PIL-only figures (`plots`)."""

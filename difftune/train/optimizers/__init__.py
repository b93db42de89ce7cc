"""The optimizers `train.optimizer` names: a table of light facts (specs.py, no torch, read
by the config), the builders from each library (build.py), the lr schedule (schedule.py),
optimizer-side hooks the loop calls (modes.py: evaluation weights, the lr a step used).
"""

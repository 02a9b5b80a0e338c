"""Analytical models of a run: pure functions of the model, layout and cluster, no torch.
(The planner of a later issue — memory per device, step time, search — grows here.)"""

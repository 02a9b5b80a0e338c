"""`meshtrain plan`: analytical models of a run, pure functions of the model, layout and
cluster (no processes).

`shapes.py` transformer shapes and exact parameter counts; `memory.py` model states by ZeRO
stage and activations (the papers' accounting and what meshtrain keeps, moment by moment);
`cost.py` model and executed FLOPs; `traffic.py` every collective of a step per axis;
`cluster.py` GPU presets and their roofline; `profile.py` a measured machine profile and
its rates; `planner.py` one plan (memory, time, MFU); `search.py` all layouts ranked.

The command line's side — the `plan` command's flags and report, measuring this machine,
a real run beside its plan — is `meshtrain.cli.plan`, `cli.calibrate` and `cli.measured`."""

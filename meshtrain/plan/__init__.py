"""`meshtrain plan`: analytical models of a run, pure functions of the model, layout and
cluster (no processes).

`shapes.py` transformer shapes and exact parameter counts; `memory.py` model states by ZeRO
stage and activations (the papers' accounting and what meshtrain keeps, moment by moment);
`cost.py` model and executed FLOPs; `traffic.py` every collective of a step per axis;
`cluster.py` GPU presets and their roofline; `calibrate.py` this machine measured;
`measured.py` a profile as rates, and a real run beside its plan; `planner.py` one plan
(memory, time, MFU); `search.py` all layouts ranked; `command.py` the command line."""

"""`meshtrain plan`: analytical models of a run, pure functions of the model, layout and
cluster (no processes).

`shapes.py` transformer shapes and exact parameter counts; `model_states.py` the parameters
a device holds and their bytes by ZeRO stage; `activations.py` one block's activation bytes
(the papers' accounting and what meshtrain keeps, term by term; `block_terms.py` a Llama's,
a MoE layer's and context parallelism's); `stage_activations.py` a pipeline stage's peak
over a step, moment by moment; `cost.py` model and executed FLOPs; `traffic.py` every collective of a step per axis;
`cluster.py` GPU presets and their roofline; `profile.py` a measured machine profile and
its rates; `planner.py` one plan (memory, time, MFU); `search.py` all layouts ranked.

The command line's side — the `plan` command's flags and report, measuring this machine,
a real run beside its plan — is `meshtrain.cli.plan`, `cli.calibrate` and `cli.measured`."""

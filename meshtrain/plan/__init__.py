"""Analytical models of a run: pure functions of the model, layout and cluster.

`shapes.py`: transformer shapes (meshtrain's GPT presets and the published GPT-3/Llama
architectures) and their exact parameter counts. `memory.py`: model-state bytes by ZeRO
stage (the ZeRO paper's accounting and what meshtrain keeps), the parameters a device holds
under tp and pp, ZeRO-3's gathered peak, activation bytes per layer (Korthikanti et al.'s
accounting, and what meshtrain's GPT keeps) and the micro-batches a pipeline's first stage
holds. `cost.py`: model FLOPs
and peak rates. The `meshtrain plan` command, step time and the layout search come next."""

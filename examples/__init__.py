"""The Python API on models written outside meshtrain, each runnable under torchrun and
checkable with `meshtrain verify --model examples.<name>:factory`."""

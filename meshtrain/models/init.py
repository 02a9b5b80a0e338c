"""Old import path: drawing weights per (seed, name) is `parallel.materialize`'s; each model's
rules are its family's recipe's (`meshtrain.recipes`), resolved lazily."""


def __getattr__(name: str):
    import importlib
    moved = {"init_spec": "meshtrain.recipes.build", "gpt_rules": "meshtrain.recipes.gpt",
             "llama_rules": "meshtrain.recipes.llama", "linear_default_rules": "meshtrain.recipes.mlp"}
    if name in moved:
        rules = name in ("gpt_rules", "llama_rules", "linear_default_rules")
        return getattr(importlib.import_module(moved[name]), "init_rules" if rules else name)
    return getattr(importlib.import_module("meshtrain.parallel.materialize"), name)

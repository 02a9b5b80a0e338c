"""Old import path: Hugging Face folders are `meshtrain.hf`'s (generic) and each family's
recipe's (its name map and config keys: `recipes/llama.py`), resolved lazily."""


def __getattr__(name: str):
    import meshtrain.hf
    return getattr(meshtrain.hf, name)

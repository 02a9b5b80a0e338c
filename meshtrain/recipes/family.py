"""What the rest of meshtrain needs to know about a model family, in one place: its specs and
presets, how to build it, its initial weights, its tensor-parallel and pipeline plans, the
sizes a layout must divide and the shape the planner reads.

A family is a subclass of `Family` whose methods answer for one spec; the strategies never
see it (they take the plans and the initial weights as arguments), and the command line
validates a layout through it. Nothing here imports torch: the command line checks flags and
plans before torch loads, so a family imports its model class inside `build` and `owns`."""

from __future__ import annotations


class HFError(ValueError):
    """A Hugging Face folder meshtrain cannot read as a model of its families: one line naming
    what and why."""


class Family:
    """A model family. `presets`: named specs (instances of `spec_type`) that train builds;
    `published`: released architectures, name -> (spec, vocabulary), which the planner plans
    (and train reaches through `--init-from` a folder of their weights); `inputs`: "tokens"
    (sequences of ids) or "features" ([rows, n_inputs] floats, one class each); `options`:
    the model flags it takes ("dropout", "attention", "hidden")."""
    name: str = ""
    spec_type: type = object
    presets: dict = {}
    published: dict = {}
    inputs: str = "tokens"
    options: tuple[str, ...] = ()
    hf_folders: bool = False  # Hugging Face folders of it are read (`--init-from`) and written (`export --hf`)

    def build(self, spec, *, vocab_size: int = 256, n_inputs: int = 64, n_classes: int = 10):
        """The model's structure (an nn.Module) under the current default device (`meta` when
        training: each rank then draws only its part)."""
        raise NotImplementedError

    def owns(self, model) -> bool:
        """Whether `model` is one of this family's (for `init_rules` on a built model)."""
        return False

    def init_rules(self, model) -> dict:
        """Each parameter's initialisation rule, read off the built structure:
        {name: ("normal", std) | ("uniform", bound) | ("ones",) | ("zeros",)}."""
        raise NotImplementedError

    def tp_plan(self, spec):
        """The tensor-parallel plan (`meshtrain.TensorPlan`), or None: tp refused."""
        return None

    def pipeline_plan(self, spec):
        """How the model is cut into stages (`meshtrain.PipelinePlan`), or None: pp refused."""
        return None

    def blocks(self, spec) -> int:
        """The number of blocks the pipeline cuts."""
        raise NotImplementedError

    def tp_splits(self, spec, vocab_size: int) -> list[tuple[int, str]]:
        """(size, what) of every dimension the tensor-parallel plan splits."""
        return []

    def attention_heads(self, spec) -> list[tuple[str, int]]:
        """("heads", n) of each head count attention splits (context parallelism's ulysses
        needs each divisible); empty: no attention."""
        return []

    def max_positions(self, spec) -> int | None:
        """The positions a learned table holds (a sequence may not be longer), or None."""
        return None

    def pipeline_problem(self, spec) -> str | None:
        """Why this spec cannot be cut into stages (one line), or None."""
        return None

    def layout_problem(self, spec, *, tp: int = 1, sp: bool = False, cp: int = 1, pp: int = 1, dp: int = 1,
                       zero: int = 0, micro_rows: int = 1, microbatches: int = 1) -> str | None:
        """Why this spec cannot train in this layout (one line, after the model's name), or
        None. `micro_rows`: the rows of each micro-batch on a rank; `microbatches`: its
        micro-batches per step."""
        return None

    def with_options(self, spec, *, dropout: float = 0.0, attention: str = "sdpa", hidden: tuple | None = None,
                     moe: dict | None = None):
        """The spec with the command line's model flags applied (those in `options`)."""
        return spec

    def n_params(self, spec, vocab_size: int) -> int | None:
        """The parameters a build holds (what the host must fit while ranks draw their parts),
        or None: not known before it is built."""
        shape = self.shape(spec, vocab_size)
        return shape.n_params() if shape is not None else None

    def flops_per_step(self, spec, batch: int, seq_len: int, *, vocab_size: int = 256, n_inputs: int = 64,
                       n_classes: int = 10) -> float | None:
        """Model FLOPs of one training step (forward and backward) on `batch` samples, what
        MFU is measured by; None: no formula."""
        return None

    # ---- Hugging Face folders (`meshtrain.hf`), for a family with `hf_folders` ----------------

    hf_types: tuple[str, ...] = ()  # the config.json model_types it reads (what a refusal lists)

    def hf_reads(self, config: dict) -> bool:
        """Whether a `config.json` is this family's to read (or to refuse in its own words)."""
        return config.get("model_type") in self.hf_types

    def spec_from_hf(self, config: dict, where: str) -> tuple:
        """(spec, vocabulary) of a `config.json`; HFError (one line) for what the model cannot
        represent."""
        raise HFError(f"{where}: meshtrain's {self.name} reads no Hugging Face config")

    def hf_config(self, spec, vocab_size: int, dtype: str, special_ids: dict) -> dict:
        """The `config.json` transformers reads for `spec` (`special_ids`: bos/eos/pad, None
        where unknown)."""
        raise NotImplementedError

    def hf_name(self, name: str) -> str:
        """A parameter's name in Hugging Face's files."""
        return name

    def our_name(self, hf_name: str) -> str:
        """The parameter a name in Hugging Face's files is."""
        return hf_name

    def hf_parts(self, spec, name: str) -> list[tuple[str, tuple]]:
        """Where parameter `name` of a model of `spec` lies in Hugging Face's files: (key,
        index) for each tensor stored there, `index` the part of ours it is (`()`: all of
        it). One key for most weights; several where transformers writes a tensor it fuses
        in memory in pieces (a stacked MoE's experts: one key per expert and projection)."""
        return [(self.hf_name(name), ())]

    def hf_state_problem(self, spec, name: str, value) -> str | None:
        """Why a saved buffer (`value`, no weight: running state such as a router's bias)
        cannot go into a Hugging Face folder, one line; None: transformers' model does
        without it (it holds nothing, say all zeros)."""
        return f"{name} is state transformers' model has no place for"

    def shape(self, spec, vocab_size: int):
        """The planner's `plan.shapes.Shape` of the spec, or None: not planned."""
        return None

"""A Llama-3-style tokenizer built with `tokenizers` (no download) and a tiny Hugging Face
Llama folder around it, for the tests of whole-document tokenization, `meshtrain prepare` and
fine-tuning on prepared tokens, and the plain transformers loop a fine-tune is compared with.

The tokenizer is Llama 3's recipe on a small vocabulary: its pre-tokenizer's regex (which keeps
".\\n\\n" and "\\n\\n" as single pieces), byte-level BPE, and a post-processor that puts
<|begin_of_text|> before each sequence; tokenizer_config.json names <|end_of_text|> as EOS."""

import json
from pathlib import Path

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_WORDS = ("the king is dead long live the king now is the winter of our discontent made glorious summer by "
          "this sun of york and all the clouds that lowered upon our house in the deep bosom of the ocean buried").split()


def documents(n: int = 12, seed: int = 0) -> list[str]:
    """Multi-paragraph documents: sentences ending in '.', '!' or '?', paragraphs split by
    blank lines, some lines broken inside a paragraph, a trailing newline on some."""
    import random
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        paragraphs = []
        for _ in range(rng.randint(2, 5)):
            sentences = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))).capitalize()
                         + rng.choice(".!?") for _ in range(rng.randint(1, 4))]
            paragraphs.append(rng.choice([" ", "\n"]).join(sentences))
        docs.append("\n\n".join(paragraphs) + rng.choice(["", "\n"]))
    return docs


def llama3_tokenizer(docs: list[str], vocab_size: int = 384):
    """A `tokenizers.Tokenizer` made as Llama 3's is, trained on `docs`: ids 0 and 1 are
    <|begin_of_text|> and <|end_of_text|>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                      special_tokens=[BOS, EOS],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, 0)])])
    return tok


def write_tokenizer(folder: Path, tok) -> Path:
    """tokenizer.json and a tokenizer_config.json naming its BOS and EOS, as Llama 3's folders do."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder / "tokenizer.json"


def hf_llama_folder(folder: Path, tok, vocab_size: int = 384, seed: int = 0):
    """A tiny random LlamaForCausalLM saved in `folder` with the tokenizer beside it (GQA,
    untied head, 2 layers); returns the model."""
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    write_tokenizer(folder, tok)
    return model


def write_documents(folder: Path, docs: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"{i:03}.txt").write_text(doc)
    return folder


def transformers_losses(folder: Path, prep: Path, tr, own_loss: bool = False) -> list[float]:
    """A plain transformers loop on `folder`'s model (`AutoModelForCausalLM`), as `meshtrain
    train` runs `tr` (a `TrainConfig`: its steps, batch, length, learning rate and schedule):
    AdamW where matrices decay (meshtrain's rule), global-norm clipping, warm-up then cosine,
    the mean cross-entropy of each global batch of the prepared ids in `prep` (read through
    TextData, the very rows the run draws) — or with `own_loss` the model's own `.loss` on
    them (the targets given unshifted, as `shift_labels`; a balancing loss added where the
    folder's `output_router_logits` says)."""
    import torch
    import torch.nn.functional as F
    import transformers

    from meshtrain.cli.config import lr_at
    from meshtrain.data.datasets import TextData
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": tr.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=tr.lr, betas=(0.9, 0.95), eps=1e-8)
    data = TextData(prep, tr.seq_len, tr.seed)
    losses = []
    for step in range(tr.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, tr)
        x, y = data.batch(step, tr.batch_size, slice(0, tr.batch_size))
        if own_loss:
            loss = model(input_ids=x, labels=y, shift_labels=y.contiguous()).loss
        else:
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tr.clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses

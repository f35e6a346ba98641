"""What the built-in models' writers share (builtin.py, vlm.py, audio.py, smollm2.py): the project's
byte-level BPE tokenizer, trained on hidden_states/models/data/corpus.txt, its chat template, and
progress lines. The registry (builtin.py) imports the writers; the writers import only this.
"""

from __future__ import annotations

import sys
from pathlib import Path

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def say(line: str) -> None:
    """A build's progress, on stderr: stdout is the paths `python -m` prints."""
    print(f"builtin models: {line}", file=sys.stderr, flush=True)


def folder_mb(path: Path) -> int:
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6)


def train_tokenizer(vocab_size: int):
    """The project's byte-level BPE tokenizer of `vocab_size` tokens, trained on the corpus, with BOS/EOS and
    the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = (Path(__file__).parent / "data" / "corpus.txt").read_text().splitlines()
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )

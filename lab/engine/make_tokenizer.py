"""Build the tiny model's tokenizer (tiny-llama/tokenizer.json) from the project's own docs.

A byte-level BPE of 1,024 tokens (the model's vocabulary): any text encodes, nothing is
ever unknown, and no model hub is asked for anything. Deterministic for the same corpus;
the shipped files were made from the docs of the commit that added them, so rerun it only
to change the tokenizer (the engines and the ingress must then share the new files).

    .venv/bin/python lab/engine/make_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "tiny-llama"
VOCAB_SIZE = 1024
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# One turn per message, then the assistant's cue: what the ingress and vLLM both render.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus() -> list[str]:
    root = HERE.parent.parent
    files = sorted([*root.glob("docs/*.md"), root / "README.md"])
    return [p.read_text(encoding="utf-8") for p in files]


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def main() -> None:
    tok = build()
    assert tok.get_vocab_size() <= VOCAB_SIZE, tok.get_vocab_size()
    tok.save(str(MODEL_DIR / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (MODEL_DIR / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"{MODEL_DIR / 'tokenizer.json'}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()

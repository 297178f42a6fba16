"""A character-level tokenizer for the built-in tasks, built locally (no hub on our machines).

One token per character over a fixed 64-entry vocabulary: `<pad>`=0, `<s>`=1, `</s>`=2 (the ids
`xray.builtin.tiny_llama` configures), `<unk>`=3, then digits, space, lowercase letters and punctuation.
Encoding prepends `<s>`; decoding joins characters with nothing between them. It is saved as a
`transformers` fast tokenizer (`tokenizer.json` + `tokenizer_config.json`) into a model directory,
where `transformers.AutoTokenizer` and vLLM load it like any other. Build the model with
`vocab_size=VOCAB_SIZE` (or larger).
"""
from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARS = tuple(string.digits + " " + string.ascii_lowercase + "+-*/=().,:;?!<>'\"_#%&[]")
VOCAB = (PAD, BOS, EOS, UNK) + CHARS
VOCAB_SIZE = len(VOCAB)
MODEL_MAX_LENGTH = 512


def build_char_tokenizer():
    """The tokenizer as a `transformers.PreTrainedTokenizerFast`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({tok: i for i, tok in enumerate(VOCAB)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                        special_tokens=[(BOS, BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, model_max_length=MODEL_MAX_LENGTH, padding_side="right")


def save_char_tokenizer(directory: str | Path) -> Path:
    """Write the tokenizer files into `directory` (a model directory) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save_pretrained(directory)
    return directory

"""Tiny random models with a byte-level tokenizer, for fast tests of the serving stack.

`tiny:encoder`, `tiny:decoder` and `tiny:seq2seq` build the same weights in every process
(fixed seed), so Ray replicas and the test process agree. Not for real use: outputs are noise.
`tiny:decoder-wide` is tiny:decoder 8x wider and twice as deep (~1 ms a step on one thread): for tests
that need the model, not the HTTP stack, to be what runs out.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from torch import nn

from .config import DecoderConfig, EncoderConfig, Seq2SeqConfig
from .decoder import DecoderLM
from .encoder import EncoderModel
from .seq2seq import Seq2Seq
from .text import TextTokenizer

PAD, EOS, UNK = 0, 1, 2
SPECIALS = ["<pad>", "</s>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def byte_tokenizer(append_eos: bool = False) -> Tokenizer:
    """One token per UTF-8 byte (ids 3..258) after three special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    if append_eos:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    return tok


VOCAB = 3 + 256
SEQ2SEQ_SPREAD = 2.0
_BUILDERS = {
    "encoder": lambda: EncoderModel(EncoderConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_positions=256, pad_token_id=PAD,
        labels=("negative", "neutral", "positive"))),
    "decoder": lambda: DecoderLM(DecoderConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2, max_positions=512,
        position="rotary", norm="rmsnorm", activation="swiglu", attn_bias=False, mlp_bias=False,
        eos_token_ids=(EOS,))),
    "decoder-wide": lambda: DecoderLM(DecoderConfig(
        vocab_size=VOCAB, d_model=256, n_heads=8, n_kv_heads=4, d_ff=768, n_layers=4, max_positions=512,
        position="rotary", norm="rmsnorm", activation="swiglu", attn_bias=False, mlp_bias=False,
        eos_token_ids=(EOS,))),
    "seq2seq": lambda: Seq2Seq(Seq2SeqConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_positions=256, pad_token_id=PAD,
        decoder_start_token_id=PAD, eos_token_id=EOS, scale_embeddings=True)),
}


def tiny_model(family: str, seed: int = 0) -> tuple[nn.Module, TextTokenizer]:
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny model {family!r}; known: {sorted(_BUILDERS)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _BUILDERS[family]().eval()
    if family == "seq2seq":  # at the default init every source decodes to one repeated token: spread the
        with torch.no_grad():  # weights so outputs depend on the source and the beam size (tests can fail)
            for weight in model.parameters():
                if weight.dim() >= 2:
                    weight.mul_(SEQ2SEQ_SPREAD)
    tok = byte_tokenizer(append_eos=family == "seq2seq")
    template = CHAT_TEMPLATE if family.startswith("decoder") else None
    return model, TextTokenizer(tok, template, {"eos_token": "</s>"})

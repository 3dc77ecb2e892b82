"""Our models converted for the peers (run in the peers' environment, env.py):

- translator -> CTranslate2, from our Marian export (models.checkpoints.marian.to_hf_marian). The stock
  `ct2-transformers-converter` assumes Marian's usual layout (a zero start embedding, a <pad> appended
  after the vocabulary); ours starts the decoder from the real embedding of decoder_start_token_id
  and has pad inside the vocabulary, so the loader here says so instead.
- MiniLM + head -> ONNX (one graph: ids, keep -> embedding, label logits), ONNX Runtime's BERT graph
  fusion applied, and an int8 copy with per-channel weight scales (per-tensor loses too much).
- SmolLM2: the pinned Q4_1 GGUF as it is, and an F32 GGUF of the same weights by llama.cpp's own
  `llama-quantize --allow-requantize ... F32` (Q4_1 dequantized: the same weights our fp32 model uses).

    python -m loadtests.peers.convert translator|encoder OUT_DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from .env import run_tool

log = logging.getLogger("bench.peers")


def token_strings(tokenizer) -> list[str]:
    """The vocabulary in id order (CTranslate2 takes and returns token strings)."""
    vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def to_ctranslate2(model, tokenizer, out: Path, quantization: str | None = None) -> None:
    import ctranslate2.converters.transformers as ct2t
    from ctranslate2.converters.converter import Converter
    from transformers import MarianConfig, MarianMTModel

    from models.checkpoints.marian import to_hf_marian

    cfg = model.cfg
    config, state = to_hf_marian(model)
    hf = MarianMTModel(MarianConfig(**config)).eval()
    hf.load_state_dict(state, strict=True)
    tokens = token_strings(tokenizer)
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tokens)} tokens, the model {cfg.vocab_size}")

    class OurMarianLoader(ct2t.BartLoader):
        """Marian post-norm blocks, no embedding norm; decoder starts from its start token's embedding."""

        def get_model_spec(self, m):
            m.config.normalize_before = False
            m.config.normalize_embedding = False
            return super().get_model_spec(m)

        def set_config(self, config_, m, tok) -> None:
            config_.bos_token = tokens[cfg.decoder_start_token_id]
            config_.eos_token = tokens[cfg.eos_token_id]
            config_.unk_token = tokenizer.special_tokens.get("unk_token", tokens[cfg.eos_token_id])
            config_.decoder_start_token = tokens[cfg.decoder_start_token_id]
            config_.layer_norm_epsilon = cfg.norm_eps

        def get_vocabulary(self, m, tok) -> list[str]:
            return tokens

    class OurConverter(Converter):
        def _load(self):
            return OurMarianLoader()(hf, None)

    OurConverter().convert(str(out), quantization=quantization, force=True)


def encoder_graph(model):
    """The module ONNX sees: (ids, keep) -> (pooled embedding, label logits)."""
    import torch

    class EmbedAndClassify(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids, keep):
            emb = self.model.embed(ids, keep.bool())  # (B, C)
            return emb, self.model.head(emb)  # (B, C), (B, L)

    return EmbedAndClassify().eval()


def to_onnx(model, out: Path) -> dict[str, Path]:
    """fp32 graph (fused by ONNX Runtime's BERT optimizer) and its per-channel int8 copy."""
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.transformers.optimizer import optimize_model

    out.mkdir(parents=True, exist_ok=True)
    raw, fused, int8 = out / "encoder.raw.onnx", out / "encoder.onnx", out / "encoder.int8.onnx"
    ids = torch.randint(5, 1000, (2, 11))
    keep = torch.ones(2, 11, dtype=torch.int64)
    keep[1, 7:] = 0  # a padded row, so the export sees masking
    with torch.inference_mode():
        torch.onnx.export(encoder_graph(model), (ids, keep), str(raw), input_names=["ids", "keep"],
                          output_names=["embedding", "logits"], opset_version=17, dynamo=False,
                          dynamic_axes={"ids": {0: "batch", 1: "tokens"}, "keep": {0: "batch", 1: "tokens"},
                                        "embedding": {0: "batch"}, "logits": {0: "batch"}})
    cfg = model.cfg
    opt = optimize_model(str(raw), model_type="bert", num_heads=cfg.n_heads, hidden_size=cfg.d_model)
    log.info("ONNX Runtime fusion: %s", {k: v for k, v in opt.get_fused_operator_statistics().items() if v})
    opt.save_model_to_file(str(fused))
    quantize_dynamic(str(fused), str(int8), weight_type=QuantType.QInt8, per_channel=True,
                     extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})  # fused ops lack shape info
    return {"fp32": fused, "int8": int8}


def f32_gguf(quantize_tool: Path, q4: Path, out: Path) -> Path:
    """The Q4_1 file's weights as F32 (llama.cpp dequantizes; metadata and tokenizer kept); PeerFailed
    ("SIGILL in llama-quantize") when the tool fails, leaving no `out` behind for the next run to trust."""
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        run_tool([str(quantize_tool), "--allow-requantize", str(q4), str(tmp), "F32"], "llama-quantize", 600.0)
        tmp.rename(out)
    return out


def load_fp32(kind: str):
    from models import zoo
    from models.catalog import DEFAULT_SPECS, load_model

    # unfused (the export reads the separate q/k/v projections; fused ones are bitwise the same) and with
    # torch's own Linear layers (ONNX cannot trace oneDNN's packed weights)
    spec = dataclasses.replace(DEFAULT_SPECS[kind], fuse=False, quantize=None, dense_kernel="aten")
    return load_model(spec, zoo.default_cache_dir())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("translator", "encoder"))
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lm = load_fp32(args.kind)
    if args.kind == "translator":
        to_ctranslate2(lm.model, lm.tokenizer, args.out)
    else:
        to_onnx(lm.model, args.out)


if __name__ == "__main__":
    main()

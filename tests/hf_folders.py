"""Tiny Hugging Face checkpoint folders as a user's `save_pretrained` writes them (random weights,
a small config, the tokenizer beside them), one per family `model: {name: hf, path: DIR}` takes.

BERT and DistilBERT carry MiniLM's WordPiece tokenizer; RoBERTa and GPT-2 a byte-level BPE and
LLaMA a BPE with <s> / </s>, each trained here on the shipped SST-2 sentences (the `tokenizers`
library, seconds), so every family reads the same text with its own kind of tokenizer.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from veil.assets import minilm_dir


@lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    from veil.data.text import ASSETS, read_sst2

    return tuple(read_sst2(ASSETS / "sst2" / "train.tsv.gz")[0][:4000])


def _bpe(kind: str, vocab: int = 3000) -> Any:
    """A transformers fast tokenizer of `kind` (roberta | gpt2 | llama) trained on SST-2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast, PreTrainedTokenizerFast, RobertaTokenizerFast

    specials = {
        "roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        "gpt2": ["<|endoftext|>"],
        "llama": ["<unk>", "<s>", "</s>"],
    }["llama" if kind in ("mistral", "qwen2") else kind]
    tok = Tokenizer(models.BPE(unk_token="<unk>" if kind == "llama" else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(sentences(), trainer)
    if kind == "roberta":
        return RobertaTokenizerFast(tokenizer_object=tok)
    if kind == "gpt2":
        return GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tokenizer(kind: str) -> Any:
    from transformers import BertTokenizerFast

    if kind in ("bert", "distilbert"):
        return BertTokenizerFast.from_pretrained(str(minilm_dir()), local_files_only=True)
    return _bpe(kind)


def write_family(
    kind: str, folder: Path, dim: int = 128, depth: int = 2, heads: int = 4, seed: int = 0, **extra: Any
) -> Path:
    """A `kind` checkpoint folder with random weights (seeded) and its tokenizer, as save_pretrained writes it."""
    import transformers as tf

    tf.logging.set_verbosity_error()

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = None
    if kind not in ("vit", "deit"):  # saved first: the vocabulary is what AutoTokenizer reads back
        from transformers import AutoTokenizer

        tokenizer(kind).save_pretrained(str(folder))
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    # Qwen2's tokenizer class (picked from config.json once it is written) adds <|endoftext|>;
    # its real checkpoints keep spare embedding rows, as here
    vocab = len(tok) + (16 if kind == "qwen2" else 0) if tok is not None else None
    common = dict(hidden_size=dim, num_hidden_layers=depth, num_attention_heads=heads, intermediate_size=4 * dim)
    if kind == "bert":
        cfg = tf.BertConfig(vocab_size=vocab, max_position_embeddings=64, **common, **extra)
        model = tf.BertForSequenceClassification(cfg)
    elif kind == "roberta":
        cfg = tf.RobertaConfig(
            vocab_size=vocab, max_position_embeddings=66, pad_token_id=1, type_vocab_size=1, **common, **extra
        )
        model = tf.RobertaForSequenceClassification(cfg)
    elif kind == "distilbert":
        cfg = tf.DistilBertConfig(
            vocab_size=vocab,
            dim=dim,
            n_layers=depth,
            n_heads=heads,
            hidden_dim=4 * dim,
            max_position_embeddings=64,
            **extra,
        )
        model = tf.DistilBertForSequenceClassification(cfg)
    elif kind == "gpt2":
        eos = tok.eos_token_id
        cfg = tf.GPT2Config(
            vocab_size=vocab,
            n_embd=dim,
            n_layer=depth,
            n_head=heads,
            n_positions=64,
            bos_token_id=eos,
            eos_token_id=eos,
            **extra,
        )
        model = tf.GPT2LMHeadModel(cfg)
    elif kind in ("llama", "mistral", "qwen2"):
        cls = {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        }[kind]
        cfg = cls[0](
            vocab_size=vocab,
            max_position_embeddings=64,
            num_key_value_heads=heads,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=False,
            **{**common, "intermediate_size": 2 * dim},
            **extra,
        )
        model = cls[1](cfg)
    elif kind in ("vit", "deit"):
        cfgc, modc = (
            (tf.ViTConfig, tf.ViTForImageClassification)
            if kind == "vit"
            else (tf.DeiTConfig, tf.DeiTForImageClassification)
        )
        geometry = dict(
            image_size=extra.pop("image_size", 8),
            patch_size=extra.pop("patch_size", 2),
            num_channels=extra.pop("num_channels", 1),
        )
        model = modc(cfgc(**common, **geometry, num_labels=extra.pop("num_labels", 10), **extra))
        emb = model.base_model.embeddings
        with torch.no_grad():  # HF initialises DeiT's tables to zero; a trained checkpoint's are not
            for t in (emb.position_embeddings, emb.cls_token, getattr(emb, "distillation_token", None)):
                if t is not None and not t.abs().sum():
                    t.normal_(std=0.02)
    else:
        raise ValueError(kind)
    model.save_pretrained(str(folder))
    return folder


def write_from_minilm(kind: str, folder: Path, depth: int = 2) -> Path:
    """A bert / roberta / distilbert folder holding the first `depth` blocks of the real MiniLM-L6
    in that family's layout, with MiniLM's WordPiece tokenizer: trained weights, as a user's
    fine-tuned encoder has (the span attack needs them: at HF's random init the layer-1 gradient
    of a [CLS]-pooled encoder loses rank). RoBERTa's table is stored at HF's offset (row t + 2 is
    slot t, ``pad_token_id = 1``) and its head's dense layer is MiniLM's pooler, so the three
    compute the same first-token features; DistilBERT folds the segment row into its positions."""
    import transformers as tf

    tf.logging.set_verbosity_error()

    folder.mkdir(parents=True, exist_ok=True)
    src = tf.BertModel.from_pretrained(str(minilm_dir()), local_files_only=True, num_hidden_layers=depth)
    c = src.config
    sd = src.state_dict()
    torch.manual_seed(0)
    if kind == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(**{**c.to_dict(), "num_labels": 2}))
        model.bert.load_state_dict(sd)
    elif kind == "roberta":
        cfg = tf.RobertaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_hidden_layers=depth,
            num_attention_heads=c.num_attention_heads,
            intermediate_size=c.intermediate_size,
            max_position_embeddings=c.max_position_embeddings + 2,
            pad_token_id=1,
            type_vocab_size=1,
            layer_norm_eps=c.layer_norm_eps,
        )
        model = tf.RobertaForSequenceClassification(cfg)
        body = {k: v for k, v in sd.items() if not k.startswith("pooler.")}
        pos = body.pop("embeddings.position_embeddings.weight")
        body["embeddings.position_embeddings.weight"] = torch.cat([torch.zeros(2, pos.shape[1]), pos])
        body["embeddings.token_type_embeddings.weight"] = body["embeddings.token_type_embeddings.weight"][:1]
        missing, unexpected = model.roberta.load_state_dict(body, strict=False)
        assert not unexpected and all("position_ids" in k or "token_type_ids" in k for k in missing), (
            missing,
            unexpected,
        )
        model.classifier.dense.load_state_dict(src.pooler.dense.state_dict())
    elif kind == "distilbert":
        cfg = tf.DistilBertConfig(
            vocab_size=c.vocab_size,
            dim=c.hidden_size,
            n_layers=depth,
            n_heads=c.num_attention_heads,
            hidden_dim=c.intermediate_size,
            max_position_embeddings=c.max_position_embeddings,
        )
        model = tf.DistilBertForSequenceClassification(cfg)
        e, d = model.distilbert.embeddings, sd
        with torch.no_grad():
            e.word_embeddings.weight.copy_(d["embeddings.word_embeddings.weight"])
            e.position_embeddings.weight.copy_(
                d["embeddings.position_embeddings.weight"] + d["embeddings.token_type_embeddings.weight"][0]
            )
            e.LayerNorm.load_state_dict(src.embeddings.LayerNorm.state_dict())
            for blk, ref in zip(model.distilbert.transformer.layer, src.encoder.layer):
                a, s = blk.attention, ref.attention
                for mine, theirs in (
                    (a.q_lin, s.self.query),
                    (a.k_lin, s.self.key),
                    (a.v_lin, s.self.value),
                    (a.out_lin, s.output.dense),
                ):
                    mine.load_state_dict(theirs.state_dict())
                blk.sa_layer_norm.load_state_dict(s.output.LayerNorm.state_dict())
                blk.ffn.lin1.load_state_dict(ref.intermediate.dense.state_dict())
                blk.ffn.lin2.load_state_dict(ref.output.dense.state_dict())
                blk.output_layer_norm.load_state_dict(ref.output.LayerNorm.state_dict())
    else:
        raise ValueError(kind)
    model.save_pretrained(str(folder))
    tokenizer("bert").save_pretrained(str(folder))
    return folder

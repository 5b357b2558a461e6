"""Convert a llama.cpp GGUF checkpoint into an ``mlx_lm``-loadable directory.

The output is plain float32 safetensors (quantised matmuls are 50x slower than
float32 on the CPU backend), a Hugging Face ``config.json`` and a byte-level
BPE ``tokenizer.json`` rebuilt from the GGUF vocabulary and merges.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

CONVERTER_VERSION = "1"
GROUP_SIZE = 32  # llama.cpp Q4_0/Q4_1/Q8_0 blocks are 32 weights wide

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class ModelConversionError(RuntimeError):
    pass


def _scalar(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelConversionError(f"GGUF metadata has no '{key}'")
    value = meta[key]
    return value.item() if hasattr(value, "item") else value


def _dequantize(weights: dict[str, mx.array], stem: str) -> mx.array:
    w = weights[f"{stem}.weight"]
    if f"{stem}.scales" not in weights:
        return w.astype(mx.float32)
    # Bits differ per tensor (Q8_0 embedding, Q4_1 elsewhere): infer them from
    # how many packed uint32 columns hold one row of in_features.
    scales = weights[f"{stem}.scales"].astype(mx.float32)
    biases = weights[f"{stem}.biases"].astype(mx.float32)
    in_features = scales.shape[-1] * GROUP_SIZE
    bits = w.shape[-1] * 32 // in_features
    return mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=bits)


def _unpermute_rope(w: mx.array, n_heads: int) -> mx.array:
    # llama.cpp's converter interleaves each head's rotary halves; undo it so
    # the weights match the Hugging Face (non-traditional) rope layout.
    rows, cols = w.shape
    head = rows // n_heads
    return w.reshape(n_heads, head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ModelConversionError(f"only llama-architecture GGUF files are supported, got '{arch}'")
    g = lambda k: _scalar(meta, f"llama.{k}")  # noqa: E731
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(g("embedding_length")),
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length")),
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(g("vocab_size")),
        "rope_theta": float(g("rope.freq_base")),
        "max_position_embeddings": int(g("context_length")),
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": int(_scalar(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(meta, "tokenizer.ggml.eos_token_id")),
    }


def _convert_weights(weights: dict[str, mx.array], cfg: dict[str, Any]) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {
        "model.embed_tokens.weight": _dequantize(weights, "token_embd"),
        "model.norm.weight": weights["output_norm.weight"].astype(mx.float32),
    }
    if "output.weight" in weights:
        out["lm_head.weight"] = _dequantize(weights, "output")
        cfg["tie_word_embeddings"] = False
    for layer in range(cfg["num_hidden_layers"]):
        for gguf_name, hf_name in _LAYER_NAMES.items():
            w = _dequantize(weights, f"blk.{layer}.{gguf_name}")
            if gguf_name == "attn_q":
                w = _unpermute_rope(w, cfg["num_attention_heads"])
            elif gguf_name == "attn_k":
                w = _unpermute_rope(w, cfg["num_key_value_heads"])
            out[f"model.layers.{layer}.{hf_name}.weight"] = w
    return out


def _tokenizer_files(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise ModelConversionError("only byte-level BPE (gpt2) GGUF tokenizers are supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = np.asarray(meta["tokenizer.ggml.token_type"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") == "smollm":
        # SmolLM splits every digit into its own token before byte-level BPE.
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    special = [tokens[i] for i in np.flatnonzero(types == 3)]  # 3 = control tokens
    tok.add_special_tokens(special)

    name = lambda key: tokens[int(_scalar(meta, key))]  # noqa: E731
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta, "llama.context_length")),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return json.loads(tok.to_str()), tok_config


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write an mlx_lm model directory for ``gguf_path`` at ``out_dir`` (atomic rename)."""
    try:
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
    except Exception as exc:  # mlx raises bare RuntimeError/ValueError on bad files
        raise ModelConversionError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    cfg = _hf_config(meta)
    hf_weights = _convert_weights(weights, cfg)
    tokenizer_json, tokenizer_config = _tokenizer_files(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), hf_weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (tmp / "source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "converter_version": CONVERTER_VERSION}, indent=2)
        )
        if (out_dir / "model.safetensors").is_file():  # a concurrent first run finished first: keep its copy
            shutil.rmtree(tmp)
            return out_dir
        if out_dir.exists():  # an incomplete leftover (no weights): never a directory another process uses
            shutil.rmtree(out_dir)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").is_file():
                raise
            shutil.rmtree(tmp)  # lost the race to another process's identical conversion
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

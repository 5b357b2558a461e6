"""Tiny randomly initialised models + a byte-level BPE tokenizer, for fast tests and demos.

One per supported architecture (``ppo_core.models.SUPPORTED_MODEL_TYPES``),
each written as a real model directory so it exercises exactly the loading
path of a downloaded one.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ppo_core.config import PROJECT_ROOT

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _architecture(model_type: str, hidden: int, layers: int) -> dict:
    """What a Hugging Face config.json of each architecture sets beyond the common fields."""
    return {
        "llama": {"rope_theta": 10000.0, "tie_word_embeddings": True},
        "mistral": {"rope_theta": 10000.0, "tie_word_embeddings": False, "sliding_window": None},
        # Qwen2 has biased q/k/v projections and (at 7B) an untied head
        "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": False},
        # Qwen3 normalises queries and keys per head and sets head_dim explicitly
        "qwen3": {"rope_theta": 1000000.0, "tie_word_embeddings": True, "head_dim": hidden // 4},
    }[model_type]


def make_tiny_model(
    out_dir: Path, seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = 384, model_type: str = "llama"
) -> Path:
    """Write an mlx_lm-loadable tiny model of ``model_type`` to ``out_dir`` (idempotent)."""
    import importlib

    from mlx_lm.utils import MODEL_REMAPPING
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [json.loads(line)["prompt"] for line in (PROJECT_ROOT / "data" / "prompts.jsonl").read_text().splitlines()]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 512,
            },
            indent=2,
        )
    )
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 512,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        **_architecture(model_type, hidden, layers),
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    arch = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out_dir

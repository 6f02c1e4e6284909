"""A model folder's generation_config.json lists end-of-turn tokens that config.json does not (GPT-OSS's
``<|call|>``, Llama 3's ``<|eot_id|>``): turnout stops on them as HF transformers' generate does."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from turnout import LLM, SamplingParams  # noqa: E402

KW = dict(kv_cache_memory=2 << 20, enforce_eager=True, device="cpu", dtype="float32")


def test_generation_config_eos_ids_stop_like_hf(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2, eos_token_id=1,
                                   max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    prompt = [5, 17, 33, 9, 70, 2]
    free = LLM(str(tmp_path), **KW).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0),
                                             use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] != 1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, free[stop_at]]}))

    out = LLM(str(tmp_path), **KW).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0),
                                            use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:stop_at + 1] and out.finish_reason == "stop"
    gen = transformers.GenerationConfig.from_pretrained(tmp_path)
    ref = hf.generate(torch.tensor([prompt]), generation_config=gen, max_new_tokens=12, do_sample=False,
                      pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref

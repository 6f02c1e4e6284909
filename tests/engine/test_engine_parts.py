"""The engine's three parts and their seams: input processing admits or refuses (a ValueError naming the
field: the context limit, the per-request cost budget, the vocabulary), the scheduler side and the
input/output processors import no torch, kv/ imports nothing of engine/, and LLM.generate shows vLLM's
progress bar by default."""

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import turnout.kv
from turnout.engine.input_processor import ContextLengthError, InputProcessor, request_cost
from turnout.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

from turnout import LLM  # noqa: E402


def test_the_parts_without_the_model_import_no_torch_and_kv_imports_no_engine():
    code = ("import sys; import turnout.engine.input_processor, turnout.engine.output_processor, "
            "turnout.engine.core; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    kv = pathlib.Path(turnout.kv.__file__).parent
    for path in kv.glob("*.py"):  # not even under TYPE_CHECKING: the Protocol says what kv needs
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("turnout.engine") for n in names), f"{path.name} imports {names}"


def _ip(limit=None, max_model_len=64, vocab=100):
    return InputProcessor(None, vocab, max_model_len, limit, seed=0)


def test_admission_names_the_field():
    ip = _ip()
    with pytest.raises(ContextLengthError, match="^prompt:") as e:
        ip.process("a", list(range(64)), SamplingParams(max_tokens=None), 0.0)
    assert e.value.param == "prompt" and e.value.prompt_len == 64 and e.value.max_model_len == 64
    with pytest.raises(ContextLengthError, match="^max_tokens:") as e:
        ip.process("a", list(range(10)), SamplingParams(max_tokens=55), 0.0)
    assert e.value.param == "max_tokens"
    with pytest.raises(ValueError, match=r"^prompt: token id 100 is outside the vocabulary \[0, 100\)"):
        ip.process("a", [1, 100], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="^stop_token_ids:"):
        ip.process("a", [1], SamplingParams(stop_token_ids=[100]), 0.0)
    with pytest.raises(ValueError, match="^prompt: must not be empty"):
        ip.process("a", [], SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="^prompt: this model has no tokenizer"):
        ip.process("a", "text", SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="^stop: stop strings need a tokenizer"):
        ip.process("a", [1], SamplingParams(stop="x"), 0.0)
    req = ip.process("a", [1, 2], SamplingParams(top_k=1000, seed=2**64 - 1), 5.0)
    assert req.params.top_k == 0 and req.seed == (2**64 - 1) % 2**63 and req.arrival_time == 5.0


def test_the_cost_budget_counts_samples_prompt_tokens_and_logprobs():
    assert request_cost(10, SamplingParams(n=4, max_tokens=6), 64) == 4 * 16
    assert request_cost(10, SamplingParams(n=2, max_tokens=6, logprobs=3), 64) == 2 * 16 + 2 * 6 * 4
    assert request_cost(10, SamplingParams(max_tokens=None), 64) == 64  # up to the context limit
    ip = _ip(limit=64)
    ip.process("ok", list(range(10)), SamplingParams(n=4, max_tokens=6), 0.0)  # exactly the budget
    with pytest.raises(ValueError, match=r"^max_tokens_per_request: .* 80 tokens .* limit of 64"):
        ip.process("big", list(range(10)), SamplingParams(n=5, max_tokens=6), 0.0)
    with pytest.raises(ValueError, match="^max_tokens_per_request:.*logprob"):
        ip.process("lp", list(range(10)), SamplingParams(n=1, max_tokens=6, logprobs=20), 0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    d = tmp_path_factory.mktemp("llama_parts")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    return str(d)


def test_llm_takes_the_budget_and_refuses_over_it_with_nothing_admitted(tiny):
    llm = LLM(tiny, kv_cache_memory=2 << 20, max_tokens_per_request=40)
    with pytest.raises(ValueError, match="^max_tokens_per_request:"):
        llm.generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=4), SamplingParams(n=8, max_tokens=4)],
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [4, 4]
    with pytest.raises(ValueError, match="max_tokens_per_request"):
        LLM(tiny, kv_cache_memory=2 << 20, max_tokens_per_request=0)


def test_generate_shows_vllms_progress_bar_by_default(tiny, capsys):
    llm = LLM(tiny, kv_cache_memory=2 << 20)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3))
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "est. speed input:" in err and "toks/s" in err
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err

"""lm-eval itself (``local-completions``) scores a multiple-choice task against a real ``turnout serve``: every
choice's log-likelihood comes from ``/v1/completions`` with ``echo`` and ``logprobs`` (the prompt's logprobs),
and must equal HF transformers' log_softmax on the same float32 weights.

lm-eval lives in its own environment, ``.venv/lm-eval`` (made by .ci/run: a venv whose .pth line adds this one's
site-packages, plus ``pip install lm-eval``), so its many dependencies never enter the main one; without it this
test skips. The task is a YAML file and a local JSONL dataset written here: nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import REPO, ServerProcess  # noqa: E402
from test_serve_rl_fields import _save  # noqa: E402  (the tiny float32 Qwen3 with a word-level tokenizer)

LM_EVAL = Path(os.environ.get("TURNOUT_TEST_LM_EVAL_VENV", REPO / ".venv" / "lm-eval")) / "bin" / "lm_eval"
pytestmark = pytest.mark.skipif(not LM_EVAL.exists(), reason=f"lm-eval is not installed at {LM_EVAL} (.ci/run)")

# questions and choices over the word-level vocabulary "t0" .. "t95"; each choice is one or several tokens
DOCS = [{"question": "t3 t17 t42", "choices": ["t8", "t91 t5", "t60"], "answer": 0},
        {"question": "t11 t2 t77 t30", "choices": ["t1 t2 t3", "t40", "t50 t51"], "answer": 1},
        {"question": "t5", "choices": ["t6", "t7", "t9", "t10"], "answer": 2},
        {"question": "t20 t21 t22 t23 t24", "choices": ["t25", "t26 t27"], "answer": 1}]

TASK = """task: turnout_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@torch.no_grad()
def _hf_loglikelihood(hf, tok, context: str, continuation: str) -> float:
    """lm-eval's split of a request: the whole text encoded, the context's tokens, the rest the continuation's."""
    ctx = tok.encode(context, add_special_tokens=False)
    whole = tok.encode(context + continuation, add_special_tokens=False)
    lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(float(lp[p - 1, whole[p]]) for p in range(len(ctx), len(whole)))


def test_lm_eval_multiple_choice_equals_hf(tmp_path):
    model_dir = tmp_path / "model"
    hf = _save(model_dir, with_tokenizer=True)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    data = tmp_path / "tasks" / "tiny_mc.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (data.parent / "tiny_mc.yaml").write_text(TASK.format(data=data))
    srv = ServerProcess(str(model_dir), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                        "--served-model-name", "tiny", "--seed", "0", env={"OMP_NUM_THREADS": "1"})
    try:
        srv.wait_healthy()
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "TOKENIZERS_PARALLELISM": "false"}
        p = subprocess.run([str(LM_EVAL), "run", "--model", "local-completions", "--model_args",
                            f"model=tiny,base_url={srv.base_url}/v1/completions,tokenizer={model_dir},"
                            "tokenized_requests=True,num_concurrent=1,max_retries=1",
                            "--tasks", "turnout_tiny_mc", "--include_path", str(data.parent),
                            "--output_path", str(tmp_path / "out"), "--log_samples"],
                           capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:] + srv.log()
    finally:
        srv.stop()
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    acc = results["results"]["turnout_tiny_mc"]["acc,none"]
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_turnout_tiny_mc_*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    correct = 0
    for s in samples:
        doc = DOCS[s["doc_id"]]
        want = [_hf_loglikelihood(hf, tok, doc["question"], " " + c) for c in doc["choices"]]
        got = [r[0] for r in s["filtered_resps"]]
        assert len(got) == len(want)
        assert max(abs(float(g) - w) for g, w in zip(got, want)) <= 1e-4, (doc, got, want)
        correct += max(range(len(want)), key=want.__getitem__) == doc["answer"]
    assert acc == pytest.approx(correct / len(DOCS))

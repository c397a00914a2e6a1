"""lm-eval's `local-completions` model against the real tiny-model engine.

A local task pair (jsonl through ``dataset_path: json``, nothing from the hub): a
multiple-choice task runs the loglikelihood path (``echo``, ``logprobs``, ``max_tokens``
0 or 1, lists of token-id prompts) and a ``generate_until`` task the generation path,
both with ``--batch_size 4``. Each scored continuation's loglikelihood is checked against
`transformers` on the same weights.

lm-eval is not in the dev extra (its ``typepy[datetime]`` pins python-dateutil<3, which
kubernetes>=37 cannot use): it lives in its own venv, ``.venv-lmeval`` (``make lmeval``,
which ``make test`` runs), and the test runs ``lm_eval`` with that venv's python as a
subprocess. ``INFERGATE_LMEVAL_PYTHON`` names another interpreter; the test skips only
when no interpreter with lm_eval is found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .conftest import API_KEY, MODEL, Server

REPO = Path(__file__).resolve().parents[3]


def lm_eval_python() -> str:
    """An interpreter that has lm_eval: $INFERGATE_LMEVAL_PYTHON, .venv-lmeval, or ours."""
    candidates = [
        os.environ.get("INFERGATE_LMEVAL_PYTHON", ""),
        str(REPO / ".venv-lmeval" / "bin" / "python"),
        sys.executable,
    ]
    for python in candidates:
        if python and Path(python).exists():
            probe = subprocess.run([python, "-c", "import lm_eval"], capture_output=True)
            if probe.returncode == 0:
                return python
    pytest.skip("no python with lm_eval: run `make lmeval` (creates .venv-lmeval)")

MC_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Fire is", "choices": ["hot", "cold", "wet", "slow"], "answer": 0},
    {"question": "A cat says", "choices": ["meow", "woof"], "answer": 0},
    {"question": "Water is", "choices": ["wet", "dry"], "answer": 0},
]
GEN_DOCS = [
    {"question": f"Question {i}: name a colour.\nAnswer:", "answer": " blue"} for i in range(6)
]

MC_TASK = """
task: infergate_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """
task: infergate_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    for name, docs, template in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(template.format(data=data))
    return tasks


def samples(out_dir: Path, task: str) -> list[dict[str, Any]]:
    files = sorted(out_dir.rglob(f"samples_{task}_*.jsonl"))
    assert files, f"lm-eval wrote no samples for {task}"
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line]


def test_lm_eval_loglikelihood_and_generate_until(
    real_server: Server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    python = lm_eval_python()
    tasks = write_tasks(tmp_path)
    out_dir = tmp_path / "out"
    model_args = (
        f"model={MODEL},base_url={real_server.url}/v1/completions,"
        f"tokenizer={tiny_model_dir},tokenizer_backend=huggingface,"
        "num_concurrent=1,max_retries=1,timeout=120"
    )
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    argv = [
        python, "-m", "lm_eval", "run", "--model", "local-completions",
        "--model_args", model_args, "--tasks", "infergate_tiny_mc,infergate_tiny_gen",
        "--include_path", str(tasks), "--batch_size", "4", "--output_path", str(out_dir),
        "--log_samples",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["infergate_tiny_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["infergate_tiny_gen"]["exact_match,none"] <= 1.0

    # Every scored choice's loglikelihood is the model's own (transformers, same weights).
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    mc = samples(out_dir, "infergate_tiny_mc")
    assert len(mc) == len(MC_DOCS)
    for sample in mc:
        doc = sample["doc"]
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            # lm-eval's split: encode context + " " + choice, no special tokens.
            context = tok(doc["question"], add_special_tokens=False)["input_ids"]
            whole = tok(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
            want = sum(float(lp[i - 1, whole[i]]) for i in range(len(context), len(whole)))
            assert float(resp[0][0]) == pytest.approx(want, abs=1e-2)
    gen = samples(out_dir, "infergate_tiny_gen")
    assert len(gen) == len(GEN_DOCS)
    assert all(isinstance(s["resps"][0][0], str) for s in gen)

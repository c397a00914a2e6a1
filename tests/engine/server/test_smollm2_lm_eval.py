"""lm-eval on a real model: the engine's score equals lm-eval's own `hf` backend.

SmolLM2-135M-Instruct (the GGUF fetched from PyPI) answers a local multiple-choice task,
``data/facts_mc.jsonl`` (80 questions written for this repo, nothing from the hub), twice
in one test:

* ``local-completions`` against ``infergate engine serve`` on the GGUF (the loglikelihood
  path: ``echo``, ``logprobs``, ``max_tokens`` 0);
* lm-eval's ``hf`` backend, which loads the same GGUF through transformers' own
  dequantizer (``gguf_file=``), so it shares nothing with the engine but the file.

With the weights dequantized to float32 (``--quantization none``) the bar is accuracy
within 1 point (0.01). With 80 questions one question is 1.25 points, so the answers must
agree on every question. Each scored choice's loglikelihood must also agree within
LOGLIK_ATOL: both compute float32 on CPU in a different order (fused q/k/v, paged
attention against SDPA), which moves a sum of a few token logprobs by well under 1e-2; a
real error (a wrong position, a missing token) moves it by whole nats.

Served as by default on CPU (the Q4_1 blocks kept quantized, bfloat16 activations in the
matmuls, docs/engine.md), the bar is accuracy within QUANTIZED_POINTS (0.02) of the same
``hf`` run: the roundings move loglikelihoods by tenths of a nat, which may flip a close
question but not the task's score.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from infergate.engine.gguf_model import prepare_model_dir

from infergate.procs import ProcessGroup

from .conftest import API_KEY, MODEL, Server, _start
from .test_lm_eval import MC_TASK, lm_eval_python, samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

DATA = Path(__file__).with_name("data") / "facts_mc.jsonl"
TASK_NAME = "infergate_facts_mc"
# test_lm_eval.py's multiple-choice task under this task's name, scoring acc_norm too.
TASK = MC_TASK.replace("task: infergate_tiny_mc", f"task: {TASK_NAME}") + "  - metric: acc_norm\n"
ACC_POINTS = 0.01
QUANTIZED_POINTS = 0.02
LOGLIK_ATOL = 1e-2


@contextmanager
def _serve(smollm2_gguf: Path, infergate_cli: list[str], *extra: str) -> Iterator[Server]:
    with ProcessGroup() as group:
        yield _start(group, infergate_cli, "engine-smollm2-lmeval", smollm2_gguf,
                     "--device", "cpu", "--dtype", "float32", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def plain_smollm2(smollm2_gguf: Path, infergate_cli: list[str]) -> Iterator[Server]:
    with _serve(smollm2_gguf, infergate_cli, "--quantization", "none",
                "--kv-cache-dtype", "float32") as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tasks = tmp_path_factory.mktemp("tasks")
    (tasks / "facts.yaml").write_text(TASK.format(data=DATA))
    return tasks


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model_dir(smollm2_gguf, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf_run(
    smollm2_gguf: Path, tasks: Path, tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], Path]:
    """lm-eval's ``hf`` backend on the GGUF: (results, output dir), run once."""
    out = tmp_path_factory.mktemp("hf")
    results = _run_lm_eval(
        "hf",
        f"pretrained={smollm2_gguf.parent},gguf_file={smollm2_gguf.name},"
        f"tokenizer={tokenizer_dir},dtype=float32",
        tasks, out, "--device", "cpu",
    )  # fmt: skip
    return results, out


def _run_engine(server: Server, tasks: Path, tokenizer_dir: Path, out: Path) -> dict[str, Any]:
    return _run_lm_eval(
        "local-completions",
        f"model={MODEL},base_url={server.url}/v1/completions,"
        f"tokenizer={tokenizer_dir},tokenizer_backend=huggingface,"
        "num_concurrent=4,max_retries=1,timeout=300",
        tasks, out,
    )  # fmt: skip


def _run_lm_eval(
    model: str, model_args: str, tasks: Path, out_dir: Path, *extra: str
) -> dict[str, Any]:
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    argv = [
        lm_eval_python(), "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
        "--tasks", TASK_NAME, "--include_path", str(tasks), "--batch_size", "8",
        "--output_path", str(out_dir), "--log_samples", *extra,
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())["results"]
    return dict(results[TASK_NAME])


def _logliks(out_dir: Path) -> dict[int, list[float]]:
    """Each document's scored loglikelihoods, one per choice, by document id."""
    return {
        s["doc_id"]: [float(resp[0][0]) for resp in s["resps"]] for s in samples(out_dir, TASK_NAME)
    }


def test_engine_scores_like_lm_evals_hf_backend(
    plain_smollm2: Server,
    tasks: Path,
    tokenizer_dir: Path,
    hf_run: tuple[dict[str, Any], Path],
    tmp_path: Path,
) -> None:
    hf, hf_out = hf_run
    engine = _run_engine(plain_smollm2, tasks, tokenizer_dir, tmp_path / "engine")
    print(f"facts_mc: engine acc {engine['acc,none']:.4f} acc_norm {engine['acc_norm,none']:.4f}; "
          f"hf acc {hf['acc,none']:.4f} acc_norm {hf['acc_norm,none']:.4f}")  # fmt: skip
    for metric in ("acc,none", "acc_norm,none"):
        assert abs(engine[metric] - hf[metric]) <= ACC_POINTS, (metric, engine, hf)
    # The task discriminates: neither chance (0.25) nor a ceiling a broken scorer could hit.
    assert 0.3 < hf["acc,none"] < 1.0, hf

    ours, theirs = _logliks(tmp_path / "engine"), _logliks(hf_out)
    assert sorted(ours) == sorted(theirs) == list(range(len(DATA.read_text().splitlines())))
    for doc_id, want in theirs.items():
        assert ours[doc_id] == pytest.approx(want, abs=LOGLIK_ATOL), doc_id


def test_quantized_engine_scores_within_two_points(
    smollm2_gguf: Path,
    infergate_cli: list[str],
    tasks: Path,
    tokenizer_dir: Path,
    hf_run: tuple[dict[str, Any], Path],
    tmp_path: Path,
) -> None:
    """The default CPU path (the GGUF's blocks kept quantized) against the same hf run."""
    hf, _ = hf_run
    with _serve(smollm2_gguf, infergate_cli) as server:
        engine = _run_engine(server, tasks, tokenizer_dir, tmp_path / "engine")
    print(f"facts_mc quantized: engine acc {engine['acc,none']:.4f} acc_norm "
          f"{engine['acc_norm,none']:.4f}; hf acc {hf['acc,none']:.4f} acc_norm "
          f"{hf['acc_norm,none']:.4f}")  # fmt: skip
    for metric in ("acc,none", "acc_norm,none"):
        assert abs(engine[metric] - hf[metric]) <= QUANTIZED_POINTS, (metric, engine, hf)

"""lm-evaluation-harness as a client of `serve`: its `local-completions` and `local-chat-completions` models against a
live server, on small local tasks (a multiple-choice task and a generation task, written here as JSONL + YAML).

Pins: with lm-eval's default model_args (the tokenizer from the checkpoint), and with batch_size 4 (the prompts sent
as one list), every multiple-choice loglikelihood equals lm-eval's own `hf` backend on the same checkpoint within
1e-4 (the issue's bar is 1e-3), and the accuracies are equal; greedy generations equal the `hf` backend's; the chat
model's generations equal the library's greedy reply to the rendered conversation.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("starlette")

from lm_eval.tasks import TaskManager  # noqa: E402

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import default_model_path, load_tokenizer  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402
from tests.support.servers import TEMPLATE, Server  # noqa: E402

CHOICE = [
    {"question": "def fib(n):\n    return", "choices": [" fib(n - 1)", " n", " None", "\x00"], "answer": 0},
    {"question": "import os\nimport", "choices": [" sys", " os", " re"], "answer": 0},
    {"question": "class A:\n    def", "choices": [" __init__(self):", " run(self):"], "answer": 0},
    {"question": "for i in", "choices": [" range(10):", " x:", " []:"], "answer": 0},
    {"question": "x =", "choices": [" 1", " None", " []", " {}", " ''"], "answer": 1},
]
GEN = [{"prompt": "def fib(n):", "target": ""}, {"prompt": "import os\n", "target": ""},
       {"prompt": "class Point:", "target": ""}]
YAML_CHOICE = """task: sd_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
YAML_GEN = """task: sd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint with a chat template, the tasks' directory, a live server on it)."""
    root = tmp_path_factory.mktemp("lm_eval")
    model = root / "model"
    model.mkdir()
    for f in default_model_path().iterdir():
        if f.is_file():
            shutil.copy(f, model / f.name)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    # lm-eval's backends read the tokenizer's EOS (token 0, the byte 0, whose byte-level piece is "\u0100")
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "\u0100"}))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows, yaml in (("choice", CHOICE, YAML_CHOICE), ("gen", GEN, YAML_GEN)):
        data = tasks / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(yaml.format(path=data))
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    server = Server(model)
    yield model, tasks, server
    server.stop()


def evaluate(model_kind: str, model_args: str, tasks: Path, names: list[str], **kw) -> dict:
    return lm_eval.simple_evaluate(model=model_kind, model_args=model_args, tasks=names,
                                   task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                                   **kw)


def loglikelihoods(result: dict) -> list[list[float]]:
    return [[r[0][0] for r in s["resps"]] for s in sorted(result["samples"]["sd_choice"], key=lambda s: s["doc_id"])]


def generations(result: dict, task: str = "sd_gen") -> list[str]:
    return [s["resps"][0][0] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def hf_result(setup):
    model, tasks, _ = setup
    return evaluate("hf", f"pretrained={model},dtype=float32", tasks, ["sd_choice", "sd_gen"], device="cpu")


@pytest.mark.parametrize("batch", [None, 4], ids=["default model_args", "batch_size 4"])
def test_local_completions_equal_the_hf_backend(setup, hf_result, batch):
    model, tasks, server = setup
    name = server.line.split(": ", 1)[1].split(" on ")[0].rsplit("/", 1)[-1]
    args = f"base_url={server.url}/v1/completions,model={name},tokenizer={model}"
    if batch:
        args += f",batch_size={batch}"
    got = evaluate("local-completions", args, tasks, ["sd_choice", "sd_gen"])
    want = hf_result
    for g, w in zip(loglikelihoods(got), loglikelihoods(want), strict=True):
        assert g == pytest.approx(w, abs=1e-4)
    assert got["results"]["sd_choice"]["acc,none"] == want["results"]["sd_choice"]["acc,none"]
    assert generations(got) == generations(want)


def test_local_chat_completions_equal_the_library(setup):
    model, tasks, server = setup
    name = server.line.split(": ", 1)[1].split(" on ")[0].rsplit("/", 1)[-1]
    got = evaluate("local-chat-completions", f"base_url={server.url}/v1/chat/completions,model={name}", tasks,
                   ["sd_gen"], apply_chat_template=True)
    gen, tok, template = Generator(load_model(model), max_len=512), load_tokenizer(model), load_chat_template(model)
    for row, text in zip(GEN, generations(got), strict=True):
        ids = tok.encode(template.render([{"role": "user", "content": row["prompt"]}]), add_special_tokens=False).ids
        out = gen.generate(ids, 24)
        want = tok.decode([t for t in out if t not in gen.eos_token_ids], skip_special_tokens=True)
        assert text == want.split("\n\n")[0]

"""`static-decode bench --requests`: logprobs, the samplers and structured output timed beside plain greedy.

Pins: the forms are parsed and refused naming the value (an unknown or repeated name, or forms without the
static-decode system to time them); each form is its own system, named after it, that decodes exactly the tokens
`Generator.generate` (eager) gives with the same SamplingParams; logprobs keep the greedy tokens and are compared
with plain static-decode's, the other forms with nothing; the JSON names each form's fields, the command line
repeats --requests, and the check puts each form's ms/token over plain greedy's at the same context. The
json-schema form's text is a valid prefix of its schema's. No timing thresholds.
"""

from __future__ import annotations

import json

import pytest

from capture import CompileSettings
from static_decode.checkpoints.loading import default_model_path, load_model, load_tokenizer
from static_decode.commands import cli
from static_decode.commands.bench import config as bench_config
from static_decode.commands.bench import report as bench_report
from static_decode.commands.bench import requests as bench_requests
from static_decode.commands.bench import systems as bench_systems
from static_decode.commands.bench import timing as bench_timing
from static_decode.generation.generator import Generator
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES

EAGER = CompileSettings(backend="eager")


@pytest.mark.parametrize(("value", "match"), [
    ("greedy,bogus", "--requests must be distinct names from greedy, logprobs, .* got greedy,bogus"),
    ("min-p,min-p", "got min-p,min-p"),
    (",", r"got \(\)"),
])
def test_bad_forms_are_refused_naming_them(value, match):
    with pytest.raises(ValueError, match=match):
        bench_config.BenchConfig(requests=value)


def test_forms_need_the_static_decode_system():
    with pytest.raises(ValueError, match="--requests min-p times the static-decode system, which --systems "
                                         "static-decode-eager leaves out"):
        bench_config.BenchConfig(requests="min-p", systems=("static-decode-eager",))
    assert bench_config.BenchConfig().requests == ("greedy",)
    assert bench_config.BenchConfig(requests=" greedy , logprobs ").requests == ("greedy", "logprobs")


@pytest.mark.parametrize("form", sorted(bench_requests.FORMS))
def test_each_form_decodes_what_generate_gives_with_its_options(form):
    path = default_model_path()
    model = load_model(path)
    request = bench_requests.FORMS[form]
    system, why = bench_systems.build("static-decode", model, path=path, max_len=64, settings=EAGER, request=request)
    assert system is not None, why
    params = bench_requests.sampling(request, path, model.config.vocab_size)
    extra = {"max_logprobs": bench_requests.LOGPROBS} if "logprobs" in request.options else {}
    if request.grammar:
        extra["grammar_tables"] = DEFAULT_GRAMMAR_TABLES
    reference = Generator(model, max_len=64, batch=1, **extra)  # eager: the steps uncompiled
    prompt = [5, 17, 33, 2, 9, 40, 11]
    want = [getattr(t, "token", t) for t in reference.generate(prompt, 7, params)]
    for _ in range(2):  # the second request starts from scratch on the same system
        assert bench_timing.request(system, prompt, 6, None) == want, form
    if request.grammar:  # the text so far is a prefix of an object with a title first
        assert load_tokenizer(path).decode(want) == '{"title'  # one byte per token: 7 tokens


def test_bench_run_with_forms_names_compares_and_checks(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main([
        "bench", "--systems", "static-decode", "--requests", "greedy,logprobs,min-p,json-schema", "--contexts",
        "5,12", "--max-len", "40", "--steps", "4", "--repeats", "1", "--warmup", "0", "--compile-backend", "eager",
        "--no-attention", "--threads", "1", "--quiet", "--json", str(out),
    ])
    assert rc == 0
    doc = json.loads(out.read_text())
    names = ["static-decode", "static-decode logprobs", "static-decode min-p", "static-decode json-schema"]
    assert [s["system"] for s in doc["systems"]] == names
    fields = {s["system"]: s.get("request_fields") for s in doc["systems"]}
    assert fields["static-decode"] is None
    assert fields["static-decode logprobs"] == "logprobs=5"
    assert fields["static-decode min-p"] == "temperature=0.8, seed=0, min_p=0.1"
    assert "json_schema" in fields["static-decode json-schema"]
    assert "--requests greedy,logprobs,min-p,json-schema" in doc["bench"]["command"]
    rows = {(r["system"], r["context"]): r for r in doc["rows"]}
    for c in (5, 12):
        assert rows["static-decode logprobs", c]["compared_with"] == "static-decode"
        assert rows["static-decode logprobs", c]["tokens_match"] is True  # logprobs change no token
        assert rows["static-decode min-p", c]["compared_with"] is None
        assert rows["static-decode min-p", c]["tokens_match"] is None
    check = doc["checks"]["request_forms_over_greedy"]
    assert [(f["system"], f["context"]) for f in check["by_context"]] == [(n, c) for n in names[1:] for c in (5, 12)]
    for f in check["by_context"]:
        want = rows[f["system"], f["context"]]["ms_per_token"] / rows["static-decode", f["context"]]["ms_per_token"]
        assert f["over"] == "static-decode" and f["ratio"] == pytest.approx(want, abs=1e-3)
        assert f["met"] == (f["ratio"] <= bench_report.REQUEST_SLACK)
    assert "request_forms_over_greedy" in capsys.readouterr().out

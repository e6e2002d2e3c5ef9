"""--min-p, --presence-penalty, --frequency-penalty and --logit-bias on the command line.

The reference is the library in this process: `Generator.generate` on the same checkpoint with the same
SamplingParams. Pins: --logit-bias parses ID=BIAS,... and a JSON object into (id, bias) pairs and refuses what is
neither, naming the entry; `generate` prints exactly the library's tokens for each flag (greedy and seeded
sampling); a value SamplingParams refuses, or an id past the vocabulary, stops the command in one line naming the
flag; with speculation every one of them (and --repeat-penalty) is refused by flag before a request runs.
"""

from __future__ import annotations

import argparse

import pytest

from static_decode import Generator, load_model
from static_decode.commands.samplers import check_sampler_flags, logit_bias_arg
from tests.support.checkpoints import VOCAB
from tests.support.cli import PROMPT_IDS, run


def test_logit_bias_forms():
    assert logit_bias_arg("15=-100,7=2.5") == ((15, -100.0), (7, 2.5))
    assert logit_bias_arg(" 15 = -100 , 7=2 ") == ((15, -100.0), (7, 2.0))
    assert logit_bias_arg('{"15": -100, "7": 2.5}') == ((15, -100.0), (7, 2.5))


@pytest.mark.parametrize(("text", "words"), [
    ("x=1", "token id 'x' is not an int"),
    ("5=big", "bias 'big' of token 5 is not a number"),
    ("5", "bias '' of token 5 is not a number"),
    ('{"5": "1"}', "bias '1' of token 5 is not a number"),
    ('{"5": true}', "bias True of token 5 is not a number"),
    ("[1, 2]", "token id '[1' is not an int"),
    ('{"5": 1', "not a JSON object"),
    (",", "at least one ID=BIAS entry"),
])
def test_logit_bias_refusals_name_the_entry(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words.replace("[", r"\[")):
        logit_bias_arg(text)


@pytest.fixture(scope="module")
def gen(plain):
    return Generator(load_model(plain), max_len=64, eos_token_ids=[])


def _new_ids(out: str) -> list[int]:
    line = out.splitlines()[1]
    assert line.startswith("new ids: ")
    return [int(t) for t in line.split()[2:]]


CASES = [
    (["--presence-penalty", "1.5"], dict(presence_penalty=1.5)),
    (["--frequency-penalty", "-2"], dict(frequency_penalty=-2.0)),
    (["--logit-bias", "FIRST=-100,3=5"], dict(logit_bias={"FIRST": -100.0, 3: 5.0})),
    (["--temperature", "1.3", "--seed", "4", "--min-p", "0.3"], dict(temperature=1.3, seed=4, min_p=0.3)),
    (["--temperature", "1.0", "--seed", "2", "--min-p", "0.05", "--logit-bias", '{"FIRST": -100}',
      "--frequency-penalty", "0.7"], dict(temperature=1.0, seed=2, min_p=0.05, logit_bias={"FIRST": -100.0},
                                          frequency_penalty=0.7)),
]


@pytest.mark.parametrize(("flags", "options"), CASES)
def test_generate_prints_the_librarys_tokens(plain, gen, capsys, flags, options):
    first = gen.generate(PROMPT_IDS, 12)[0]  # the greedy first token: banning it changes the output
    flags = [f.replace("FIRST", str(first)) for f in flags]
    if "logit_bias" in options:
        options = {**options, "logit_bias": {first if k == "FIRST" else k: v for k, v in options["logit_bias"].items()}}
    rc, out, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", ",".join(map(str, PROMPT_IDS)),
                       "--max-new-tokens", "12", *flags)
    assert rc == 0, err
    want = gen.generate(PROMPT_IDS, 12, **options)
    assert _new_ids(out) == want
    plain_options = {k: v for k, v in options.items() if k in ("temperature", "seed")}
    assert want != gen.generate(PROMPT_IDS, 12, **plain_options)  # the flag changed the output


@pytest.mark.parametrize(("flags", "words"), [
    (["--min-p", "1.5"], "--min-p 1.5: min_p must be a number in [0, 1]"),
    (["--presence-penalty", "2.5"], "--presence-penalty 2.5: presence_penalty must be a number in [-2, 2]"),
    (["--frequency-penalty", "nan"], "--frequency-penalty nan: frequency_penalty must be"),
    (["--logit-bias", "5=101"], "--logit-bias 5=101: logit_bias[5] must be a number in [-100, 100]"),
    (["--logit-bias", "5=1,5=2"], "--logit-bias 5=1,5=2: logit_bias gives token id 5 twice"),
    (["--logit-bias", f"{VOCAB}=1"], f"logit_bias names token id {VOCAB}; token ids must be in 0..{VOCAB - 1}"),
    (["--logit-bias", "x=1"], "argument --logit-bias: token id 'x' is not an int"),
])
def test_bad_values_stop_generate_in_one_line(plain, capsys, flags, words):
    try:
        rc, out, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2,3", *flags)
    except SystemExit as e:  # argparse's own refusal of a value its type cannot parse
        (rc, (out, err)) = e.code, capsys.readouterr()
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert words in lines[0] and "Traceback" not in err, err


def test_generate_with_speculation_refuses_them(plain, capsys):
    rc, _, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2,3", "--speculate",
                     "prompt-lookup", "--min-p", "0.1")
    assert rc == 2 and "min_p=0.1 is not supported with speculative decoding" in err
    rc, out, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2,3", "--speculate",
                       "prompt-lookup", "--min-p", "0", "--logit-bias", "3=0")
    assert rc == 0, err  # off values are allowed


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("min_p", 0.1, "--min-p 0.1"), ("presence_penalty", -1.0, "--presence-penalty -1.0"),
    ("frequency_penalty", 0.5, "--frequency-penalty 0.5"), ("logit_bias", ((5, -100.0),), "--logit-bias 5=-100"),
    ("repeat_penalty", 1.2, "--repeat-penalty 1.2"),
])
def test_speculating_commands_refuse_each_flag(name, value, shown):
    args = argparse.Namespace(**{name: value})
    check_sampler_flags(args, speculating=False)  # fine alone
    with pytest.raises(ValueError, match=f"^{shown} is not supported with --speculate$"):
        check_sampler_flags(args, speculating=True)
    off = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": (), "repeat_penalty": 1.0}
    check_sampler_flags(argparse.Namespace(**{name: off[name]}), speculating=True)
    with pytest.raises(ValueError, match="--logit-bias: token id 96 is past the vocabulary"):
        check_sampler_flags(argparse.Namespace(logit_bias=((96, 1.0),)), False, vocab_size=96)

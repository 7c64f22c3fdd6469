"""`hydragen generate` and the CLI's plumbing: streaming, stdin, --version, flag-named errors, the summary."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch

from hydragen import __version__
from hydragen.cli import main
from hydragen.cli.common import flag_named
from hydragen.cli.generate import summary_lines
from hydragen.streaming import StreamResult

GREEDY = ["--temperature", "0", "--max-tokens", "12"]
_LOADED: dict = {}


@pytest.fixture
def reused_llm(monkeypatch):
    """`main` loads the embedded model once per sharing mode for this file (loads are slow on a shared
    machine), each time with a fresh prefix cache and fresh statistics, as a new process would have."""
    import hydragen
    from hydragen.llm import thread_governor

    real = hydragen.LLM

    def load(model=None, *, prefix_sharing=True, threads=None, **kwargs):
        if model is not None:
            return real(model, prefix_sharing=prefix_sharing, threads=threads, **kwargs)
        if prefix_sharing not in _LOADED:
            _LOADED[prefix_sharing] = real(prefix_sharing=prefix_sharing, kv_cache_tokens=16384)
        llm = _LOADED[prefix_sharing]
        llm.reset_prefix_cache()
        llm.engine.stats = type(llm.engine.stats)()
        llm.engine.threads = thread_governor(threads, torch.device("cpu"))  # as a fresh load sets it
        return llm

    monkeypatch.setattr(hydragen, "LLM", load)
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)  # the automatic count follows the machine: other tests keep theirs
    for llm in _LOADED.values():
        llm.engine.threads = None


class Recorder(io.StringIO):
    """stdout that remembers each write, to tell streamed output from output printed at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_version(capsys):
    for argv in (["--version"], ["generate", "--version"], ["chat", "--version"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"hydragen {__version__} (torch {torch.__version__}")


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["-n", "0"], "-n must be at least 1"),
        (["--top-p", "2"], "--top-p must be"),
        (["--temperature", "-1"], "--temperature must be"),
        (["--max-tokens", "0"], "--max-tokens must be"),
        (["--top-k", "-3"], "--top-k must be"),
        (["--min-p", "2"], "--min-p must be"),
        (["--stop", ""], "--stop must be"),
        (["--threads", "0"], "--threads must be a positive integer or 'auto', got 0"),
        (["--max-model-len", "1"], "--max-model-len must be at least 2"),
    ],
)
def test_bad_flags_are_named_before_loading_the_model(capsys, monkeypatch, argv, flag):
    import hydragen

    monkeypatch.setattr(hydragen, "LLM", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag}") and "SamplingParams" not in err and err.count("\n") == 1


def test_flag_named_rewrites_sampling_params_messages():
    assert flag_named("SamplingParams.top_p must be in (0, 1], got 2") == "--top-p must be in (0, 1], got 2"
    assert flag_named("max_tokens must be an integer >= 1") == "--max-tokens must be an integer >= 1"
    assert flag_named("SamplingParams.n must be >= 1") == "-n must be >= 1"


def test_stream_one_completion_and_summary(capsys, monkeypatch, reused_llm):
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "Write a poem about the sea.", *GREEDY]) == 0
    text = out.getvalue()
    pieces = [w for w in out.writes if w.strip()]
    assert len(pieces) >= 3, out.writes  # streamed token by token, not printed once at the end
    assert "".join(out.writes).strip() == text.strip() and text.strip()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("--- SmolLM2-135M-Instruct.Q4_1.gguf loaded in ") and "not counted" in err[0]
    assert re.match(r"--- 1 completion, \d+ tokens \((hit --max-tokens|ended by the model)\) in ", err[1])
    assert "first token after" in err[1] and "tokens/s" in err[1]
    assert err[2].startswith("--- prompt: ") and err[2].endswith("tokens, all computed")
    assert err[3].startswith("--- KV cache: ") and err[3].endswith("MiB at peak")  # nothing to compare with
    assert re.match(r"--- \d+ CPU threads? of \d+ cores?", err[4])  # which thread count it used


def test_prompt_from_stdin_and_system(capsys, monkeypatch, reused_llm):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name three colors.\n"))
    assert main(["generate", "-", *GREEDY, "-q"]) == 0
    from_stdin = capsys.readouterr()
    assert main(["generate", "Name three colors.", *GREEDY, "-q"]) == 0
    assert capsys.readouterr().out == from_stdin.out and from_stdin.out.strip()
    assert from_stdin.err == ""  # -q: no summary
    assert main(["generate", "Name three colors.", *GREEDY, "-q", "--system", "Answer in French."]) == 0
    assert capsys.readouterr().out != from_stdin.out
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    assert main(["generate", "-", "-q"]) == 2
    assert "standard input (-) is empty" in capsys.readouterr().err


def test_several_completions_summary_counts_reuse_and_memory(capsys, reused_llm):
    # The test session shares every node two sequences hold (conftest), so a short prompt is shared too.
    long_prompt = "Summarize this: " + "the quick brown fox jumps over the lazy dog. " * 4
    assert main(["generate", long_prompt, "-n", "4", "--max-tokens", "4", "--seed", "0"]) == 0
    cap = capsys.readouterr()
    assert cap.out.count("--- completion ") == 4
    err = cap.err.splitlines()
    assert "4 completions, 16 tokens in " in err[1]
    prompt_len = int(err[2].split("prompt: ")[1].split()[0])
    computed, reused = (int(x) for x in err[2].split("; ")[1].replace(",", "").split()[0:3:2])
    assert computed + reused == 4 * prompt_len and computed < prompt_len + 4  # computed once, not 4 times
    assert "a private copy of prompt and output per completion would total" in err[3]  # the prompt is shared

    assert main(["generate", long_prompt, "-n", "4", "--max-tokens", "4", "--seed", "0", "--no-sharing"]) == 0
    err = capsys.readouterr().err
    assert "copied into each completion's own KV (sharing off)" in err and "reused" not in err
    assert "(sharing off: each completion holds its own copy)" in err and " vs " not in err


def test_max_model_len_and_threads(capsys, reused_llm):
    threads = torch.get_num_threads()
    # --ignore-eos: a sampled reply may end by itself first (it did, in 1 of many runs).
    argv = [
        "generate",
        "Hello",
        "--max-model-len",
        "40",
        "--max-tokens",
        "50",
        "--threads",
        "1",
        "--ignore-eos",
    ]
    try:
        assert main(argv) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "(hit the context limit)" in err  # not "--max-tokens": 50 was lowered to fit the context
    tokens = int(err.split("1 completion, ")[1].split()[0])
    prompt = int(err.split("prompt: ")[1].split()[0])
    assert prompt + tokens == 40  # the context limit, and nothing else, stops generation
    assert main(["generate", "Hello " * 30, "--max-model-len", "40"]) == 2
    assert "--max-model-len allows 40" in capsys.readouterr().err
    assert main(["generate", "Hello", "--max-model-len", "100000"]) == 2
    assert "--max-model-len 100000 exceeds the model's context of 8192" in capsys.readouterr().err
    assert main(["generate", "Hello", "--raw", "--system", "x"]) == 2
    assert "--system needs the chat template" in capsys.readouterr().err


def test_unreadable_model_file_is_one_line_exit_2(capsys, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    for argv in (["generate", "hi", "--model", str(bad)], ["chat", "--model", str(bad)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}: truncated or corrupt") and err.count("\n") == 1


def _result(tokens: int, first_step_tokens: int = 1, stopped: bool = False) -> StreamResult:
    return StreamResult(None, [""], stopped, 10.0, 12.0, 10.5, tokens, first_step_tokens)


def test_summary_lines_show_only_comparable_numbers():
    common = dict(model="m.gguf", load_s=1.0, max_tokens=8, prompt_len=100, bytes_per_token=2**20)
    shared = summary_lines(
        result=_result(32, 4), n=4, computed=103, reused=297, peak_kv_tokens=140, copies_kv_tokens=428,
        sharing=True, **common,
    )  # fmt: skip
    assert shared[1] == (
        "4 completions, 32 tokens in 2.00 s: first token after 0.50 s, "
        "then 18.7 tokens/s over all completions"
    )
    assert (
        shared[2]
        == "prompt: 100 tokens x 4 completions = 400; 103 computed, 297 reused from the prefix cache"
    )
    assert shared[3] == (
        "KV cache: 140.0 MiB at peak; a private copy of prompt and output per completion would total "
        "428.0 MiB (3.1x)"
    )
    copied = summary_lines(
        result=_result(32, 4), n=4, computed=103, reused=297, peak_kv_tokens=500, copies_kv_tokens=428,
        sharing=True, **common,
    )  # fmt: skip
    assert "vs" not in copied[3] and "too short for a shared read to pay" in copied[3]
    off = summary_lines(
        result=_result(32, 4), n=4, computed=103, reused=297, peak_kv_tokens=430, copies_kv_tokens=428,
        sharing=False, **common,
    )  # fmt: skip
    assert off[2] == (
        "prompt: 100 tokens x 4 completions = 400; 103 computed, then copied into each completion's own KV "
        "(sharing off)"
    )
    assert off[3] == "KV cache: 430.0 MiB at peak (sharing off: each completion holds its own copy)"
    one = summary_lines(
        result=_result(1), n=1, computed=100, reused=0, peak_kv_tokens=101, copies_kv_tokens=100,
        sharing=True, **common,
    )  # fmt: skip
    assert "tokens/s" not in one[1]  # one token: no decode rate to speak of
    assert one[3] == "KV cache: 101.0 MiB at peak"


def test_live_rate_line_for_several_completions(capsys):
    from hydragen.cli.generate import RateLine

    line = RateLine(4, enabled=True)
    line(10, 2.0)
    line(12, 2.05)  # redrawn at most every 0.1 s
    line.clear()
    err = capsys.readouterr().err
    assert err == "\rgenerating 4 completions: 10 tokens in 2.0 s, 5.0 tokens/s\x1b[K\r\x1b[K"
    quiet = RateLine(4, enabled=False)  # -q, or stderr not a terminal
    quiet(10, 2.0)
    quiet.clear()
    assert capsys.readouterr().err == ""


def test_random_weights_shape_and_scheme_run_like_a_downloaded_file(
    capsys, tmp_path, monkeypatch, tiny_models
):
    """--random-weights SHAPE:SCHEME writes its random GGUF once into the cache and runs it as --model would
    (with the embedded model's tokenizer, so a text prompt works); a bare shape, a bad scheme, or both flags
    at once are one line and exit 2."""
    import json
    from pathlib import Path

    from hydragen.native.build import load_ops

    load_ops()  # built (or found) in the usual cache before the random file's cache moves to tmp_path
    monkeypatch.setenv("HYDRAGEN_CACHE_DIR", str(tmp_path / "cache"))
    shape = json.loads((Path(tiny_models["llama"]) / "config.json").read_text())
    shape["vocab_size"] = 49152  # the embedded tokenizer's ids fit
    config = tmp_path / "config.json"
    config.write_text(json.dumps(shape))
    argv = ["generate", "Hello", "--random-weights", f"{config}:Q8_0", "--max-tokens", "3", *GREEDY[:2]]
    assert main(argv) == 0
    written = list((tmp_path / "cache" / "random-gguf").glob("*.Q8_0.gguf"))
    out = capsys.readouterr()
    assert len(written) == 1 and f"{written[0].name} loaded in" in out.out + out.err
    assert main(argv) == 0  # written once: the second run loads the same file
    assert list((tmp_path / "cache" / "random-gguf").glob("*.gguf")) == written
    capsys.readouterr()
    for bad, message in [
        (["generate", "Hi", "--random-weights", str(config)], "needs SHAPE:SCHEME"),
        (["generate", "Hi", "--random-weights", f"{config}:Q9_Z"], "'Q9_Z' is not one of"),
        (["serve", "--model", "x.gguf", "--random-weights", f"{config}:Q8_0"], "not both"),
    ]:
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_generate_and_chat_pass_min_p_to_sampling():
    from hydragen.cli.common import sampling_params
    from hydragen.cli.parser import build_parser

    for command in (["generate", "hi"], ["chat"]):
        args = build_parser().parse_args([*command, "--min-p", "0.2", "--top-k", "5"])
        params = sampling_params(args, max_tokens=4)
        assert (params.min_p, params.top_k) == (0.2, 5)

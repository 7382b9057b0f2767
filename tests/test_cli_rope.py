"""llama-server's RoPE and context flags on `stratad serve` / `stratad generate` (--rope-scaling, --rope-scale,
--rope-freq-scale, --yarn-orig-ctx, -c/--ctx-size): each sets its config key (rope_scaling, rope_scale,
yarn_orig_ctx, context_length) with the key's own validation, over the config file's value; a bad value is refused
naming the flag, an error at start naming a key a flag set names the flag too; llama-server's RoPE flags without a
config key are not taken. Through the daemon, the flags give the lanes the logits of the same keys in the config
file."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from daemon_harness import ROOT, Daemon
from stratad import cli, config
from stratad.engine.generation import Generation
from stratad.engine.reference import ReferenceEngine
from stratad.engine.sampling import SamplingParams
from stratad.model.gguf_file import ModelFile
from test_config import lane_config

PROMPT = "The experts of a scaled model"


def serve_config(args: list[str], conf=None) -> config.DaemonConfig:
    """The configuration `stratad serve ARGS` starts with (as _serve loads it)."""
    a = cli.build_parser().parse_args(["serve", "--model", "m.gguf", *args] + (["--config", str(conf)] if conf else []))
    return config.load(a.config, cli.serve_overrides(a)[0])


def rope_keys(cfg) -> tuple:
    return cfg.rope_scaling, cfg.rope_scale, cfg.yarn_orig_ctx, cfg.context_length


def test_flags_set_the_config_keys():
    cfg = serve_config(["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32768", "-c", "131072"])
    assert rope_keys(cfg) == ("yarn", 4.0, 32768, 131072)
    assert "context_length" in cfg.model_fields_set  # explicit: above the model's it is refused, not capped
    for ctx in ("-c", "--ctx-size", "--context-length"):  # llama-server's names and stratad's own
        assert serve_config([ctx, "4096"]).context_length == 4096
    assert serve_config(["--rope-scaling", "linear", "--rope-freq-scale", "0.25"]).rope_scale == 4.0  # 1/N
    assert rope_keys(serve_config([])) == (None, None, None, 8192)  # no flag: the file's RoPE, the default length
    assert "context_length" not in serve_config([]).model_fields_set
    cfg = serve_config(["--rope-scaling", "none"])
    assert cfg.rope_scaling == "none"  # turns the file's scaling off (with_rope_overrides)
    # and each lane gets them (its LaneConfig, through its command line)
    lc = lane_config(**{k: v for k, v in cli.serve_overrides(cli.build_parser().parse_args(
        ["serve", "--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "32768"]))[0].items()
        if v is not None})
    assert (lc.rope_scaling, lc.rope_scale, lc.yarn_orig_ctx) == ("yarn", 4.0, 32768)


def test_a_flag_overrides_the_config_file(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text('rope_scaling = "linear"\nrope_scale = 2.0\nyarn_orig_ctx = 1024\ncontext_length = 4096\n')
    assert rope_keys(serve_config([], conf)) == ("linear", 2.0, 1024, 4096)  # no flag: the file's
    assert rope_keys(serve_config(["--rope-scaling", "yarn", "--rope-scale", "4"], conf)) == ("yarn", 4.0, 1024, 4096)
    assert rope_keys(serve_config(["--yarn-orig-ctx", "2048", "-c", "8192"], conf)) == ("linear", 2.0, 2048, 8192)
    assert serve_config(["--rope-freq-scale", "0.125"], conf).rope_scale == 8.0


@pytest.mark.parametrize("args, error", [
    (["--rope-scaling", "ntk"], "argument --rope-scaling: Input should be 'none', 'linear' or 'yarn' (config key "
                                "rope_scaling), got 'ntk'"),
    (["--rope-scale", "1"], "argument --rope-scale: Input should be greater than 1 (config key rope_scale), got '1'"),
    (["--rope-scale", "four"], "argument --rope-scale: Input should be a valid number"),
    (["--rope-scale", "inf"], "argument --rope-scale: Input should be a finite number (config key rope_scale), got "
                              "'inf'"),
    (["--rope-scale", "nan"], "argument --rope-scale: Input should be a finite number"),
    (["--rope-freq-scale", "4"], "argument --rope-freq-scale: must be within (0, 1): it expands the context by 1/N"),
    (["--rope-freq-scale", "0"], "argument --rope-freq-scale: must be within (0, 1)"),
    (["--rope-scale", "4", "--rope-freq-scale", "0.25"], "argument --rope-freq-scale: not allowed with argument "
                                                         "--rope-scale"),
    (["--yarn-orig-ctx", "0"], "argument --yarn-orig-ctx: 0 (llama-server: the model's trained length) is not taken"),
    (["--yarn-orig-ctx", "8"], "argument --yarn-orig-ctx: Input should be greater than or equal to 16 (config key "
                               "yarn_orig_ctx), got '8'"),
    (["--yarn-orig-ctx", "4096.5"], "argument --yarn-orig-ctx: Input should be a valid integer"),
    (["-c", "0"], "argument -c/--ctx-size/--context-length: 0 (llama-server: the model's length) is not taken"),
    (["--ctx-size", "8"], "argument -c/--ctx-size/--context-length: Input should be greater than or equal to 16 "
                          "(config key context_length), got '8'"),
])
def test_bad_values_are_refused_naming_the_flag(args, error, capsys):
    for cmd in (["serve", "--model", "m.gguf"], ["generate", "--model", "m.gguf", "text"]):
        with pytest.raises(SystemExit) as e:
            cli.build_parser().parse_args(cmd + args)
        assert e.value.code == 2
        err = capsys.readouterr().err  # generate's -c has no --context-length
        assert (error if cmd[0] == "serve" else error.replace("/--context-length", "")) in err, (cmd, err)


@pytest.mark.parametrize("flag", ["--rope-freq-base", "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow",
                                  "--yarn-beta-fast"])
def test_llama_server_flags_without_a_config_key_are_not_taken(flag, capsys):
    """stratad reads these from the model file only (no config key): refused, not ignored."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--model", "m.gguf", flag, "1.0"])
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_start_errors_name_the_flag_that_set_the_key(tiny_model_path, tmp_path):
    """The overrides are checked against the model at start (with_rope_overrides, the context check): the error
    names the key and the flag that gave it; nothing is left in the runtime dir."""
    a = cli.build_parser().parse_args(["serve", "--rope-freq-scale", "0.5", "--ctx-size", "20000"])
    given = cli.serve_overrides(a)[1]
    assert given == {"rope_scale": "--rope-freq-scale 0.5", "context_length": "--ctx-size 20000"}
    assert cli.name_flags("rope_scale need rope_scaling", given) == \
        "rope_scale need rope_scaling (rope_scale given as --rope-freq-scale 0.5)"
    assert cli.name_flags("rope_scaling is off", given) == "rope_scaling is off"  # rope_scale: a whole word only
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rt = tmp_path / "rt"
    r = subprocess.run([sys.executable, "-m", "stratad.cli", "serve", "--model", str(tiny_model_path), "--cards", "cpu",
                        "--http", "", "--runtime-dir", str(rt), "--rope-scale", "2"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("error: rope_scale need rope_scaling linear or yarn (the model has none) (rope_scale given as "
            "--rope-scale 2)") in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in rt.iterdir()) == []


def reference(model, prompt: list[int], n_ctx: int) -> tuple[list[int], str]:
    g = Generation(ReferenceEngine(model), model.tokenizer, prompt, SamplingParams(max_tokens=12, ignore_eos=True),
                   n_ctx, digest=True)
    return [t for t, _ in g if t is not None], g.digest.hexdigest()


def scaled(path, *overrides) -> ModelFile:
    m = ModelFile(path)
    m.config = m.config.with_rope_overrides(*overrides)
    return m


def test_generate_takes_the_flags(tiny_model_path, capsys):
    """`stratad generate` applies the flags as the daemon applies the keys: the reference's text with the same
    overrides; a bad combination is refused naming the flag."""
    args = ["generate", "--model", str(tiny_model_path), "--raw", "--max-tokens", "12", "--ignore-eos", PROMPT]
    assert cli.main(args + ["--rope-scaling", "yarn", "--rope-scale", "4", "--yarn-orig-ctx", "16"]) == 0
    out = capsys.readouterr().out
    m = scaled(tiny_model_path, "yarn", 4.0, 16)
    try:
        g = Generation(ReferenceEngine(m), m.tokenizer, m.tokenizer.encode(PROMPT),
                       SamplingParams(max_tokens=12, ignore_eos=True), m.config.max_context)
        assert out == "".join(piece for _, piece in g)
    finally:
        m.close()
    assert cli.main(args) == 0 and capsys.readouterr().out != out  # without the flags: the file's RoPE
    assert cli.main(args + ["--rope-scaling", "linear", "--rope-scale", "2", "-c", "16385"]) == 2
    assert ("context_length 16385 exceeds the model's 16384 tokens (linear RoPE scaling: original length 8192 x "
            "rope_scale 2); lower context_length or raise rope_scale (rope_scale given as --rope-scale 2; "
            "context_length given as -c 16385)") in capsys.readouterr().err


def test_flags_reach_the_lanes(tiny_model, tiny_model_path, tmp_path):
    """A daemon whose config file sets other RoPE values, given --rope-scaling / --rope-scale / --yarn-orig-ctx / -c
    on its command line, serves the tokens and logits (digest) of a daemon given the same values as config keys,
    which are the reference's with those overrides and not the file's values'."""
    n = tiny_model.config.context_length
    prompt = tiny_model.tokenizer.encode(PROMPT)
    keys = tmp_path / "keys.toml"
    keys.write_text(f'context_length = {2 * n}\nrope_scaling = "yarn"\nrope_scale = 2.0\nyarn_orig_ctx = {n}\n')
    other = tmp_path / "other.toml"
    other.write_text(f'context_length = {n}\nrope_scaling = "linear"\nrope_scale = 4.0\n')
    flags = ["--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", str(n), "-c", str(2 * n)]
    got = {}
    for name, conf, extra in (("keys", keys, []), ("flags", other, flags)):
        d = Daemon(tiny_model_path, tmp_path / f"run-{name}", cards="cpu", config=conf, extra=extra).start()
        try:
            with d.client() as c:
                s = c.generate(tokens=prompt, max_tokens=12, ignore_eos=True, digest=True)
                s.result()
            got[name] = (list(s.tokens), s.stats.logits_sha256)
        finally:
            d.stop()
    assert got["flags"] == got["keys"]
    want, file_values = (scaled(tiny_model_path, "yarn", 2.0, n), scaled(tiny_model_path, "linear", 4.0, None))
    try:
        assert got["flags"] == reference(want, prompt, 2 * n)
        assert got["flags"][1] != reference(file_values, prompt, n)[1]  # the file's values would move the logits
    finally:
        want.close()
        file_values.close()

"""``sm120-fp4 selftest --model DIR`` (sm120_fp4.sglang.model_check): a checkpoint's own layers, verified
without a server, through SGLang's real layers (simulated SM120, CPU)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from helpers import faults
from helpers.cases import case
from helpers.checkpoints import COMPRESSED_TENSORS, MODELOPT, write_checkpoint
from helpers.common import simulated_moe_skip_reason, slow_but_one
from helpers.plugins import plugin_site
from helpers.procs import Popen, background, clean_env
from helpers.workers import model_workers_in_process
from safetensors.torch import save_file

from sm120_fp4 import backends, checkpoints, cli
from sm120_fp4.errors import CheckpointError, ConfigError

if simulated_moe_skip_reason() is not None:
    pytest.skip(simulated_moe_skip_reason(), allow_module_level=True)
model_check = pytest.importorskip("sm120_fp4.sglang.model_check")
pytestmark = pytest.mark.sglang
SIM = {"SM120_FP4_SIMULATE": "12.0", "SM120_FP4_BACKENDS": "emulated", "SM120_FP4_MOE_BACKENDS": "emulated"}


def _selftest_model(folder, fmt, **env):
    path = write_checkpoint(str(folder / "ckpt"), seed=9, fmt=fmt)
    if "PYTHONPATH" in env:
        env["PYTHONPATH"] = f"{plugin_site(folder / 'plugins')}:{env['PYTHONPATH']}"
    return Popen(
        [sys.executable, "-m", "sm120_fp4", "selftest", "--model", path, "--json"],
        clean_env(**{**SIM, **env}),
        folder,
        cwd=folder,
        timeout=900,
    )


def _selftest_model_in_process(tmp_path, monkeypatch, capsys, fmt, **env) -> tuple[int, dict]:
    """``sm120-fp4 selftest --model DIR --json`` with its worker in this process (cli's worker seam)."""
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9, fmt=fmt)
    for name, value in {**SIM, **env}.items():
        monkeypatch.setenv(name, value)
    with model_workers_in_process():
        rc = cli.main(["selftest", "--model", path, "--json"])
    [result] = json.loads(capsys.readouterr().out).values()
    return rc, result


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.slow
def test_selftest_model_verifies_each_distinct_layer_configuration(
    sglang_unpatched, tmp_path, monkeypatch, capsys, fmt
):
    rc, result = _selftest_model_in_process(tmp_path, monkeypatch, capsys, fmt)
    assert rc == 0, result
    configs = [layer["config"] for d in result["decisions"] for layer in d["layers"] if layer["passed"]]
    kind = "ModelOpt" if fmt == MODELOPT else "CompressedTensors"
    assert len(configs) == 3 and all(c.startswith(kind) for c in configs), configs
    assert any("N=512 K=256" in c for c in configs), "q, k and v are verified as the one fused GEMM SGLang serves"
    assert result["checked"]["layers"] == 6, "2 layers x (qkv, o_proj, experts)"
    assert result["pid"] == os.getpid() and result["rank"] == {}, "the table's pid and rank (none: no engine ranks)"


def test_selftest_model_exits_1_with_a_broken_dense_kernel(sglang_unpatched, tmp_path, monkeypatch, capsys):
    backends.register("zeros", faults.returns_zeros)
    rc, result = _selftest_model_in_process(tmp_path, monkeypatch, capsys, MODELOPT, SM120_FP4_BACKENDS="zeros")
    assert rc == 1, result
    assert not result["ok"] and "refusing to serve NVFP4" in result["message"] and "zeros" in result["message"]


# One true end to end: the CLI, its worker process, an entry-point kernel found there, the exit code.
@background(
    lambda folder: _selftest_model(folder, MODELOPT, PYTHONPATH=str(folder), SM120_FP4_MOE_BACKENDS="moe-zeros"),
    heavy=True,
)
@pytest.mark.timeout(3600)
def test_selftest_model_worker_process_exits_1_with_a_broken_entry_point_moe_kernel(background):
    rc, out, err = background
    assert rc == 1, err[-3000:]
    [result] = json.loads(out).values()
    assert not result["ok"] and "refusing to serve NVFP4" in result["message"]
    assert "moe-zeros" in result["message"]


def test_discover_groups_shards_as_sglang_fuses_them(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    layers = model_check.discover(path)
    dense, moe = layers.distinct()
    assert [(d.name, d.sizes, d.k) for d in dense] == [
        ("model.layers.0.self_attn.qkv_proj", [256, 128, 128], 256),
        ("model.layers.0.self_attn.o_proj", [256], 256),
    ]
    assert [(m.prefix, m.key) for m in moe] == [("model.layers.0.mlp.experts", (8, 256, 128, True))]
    assert len(layers.dense) == 4 and len(layers.moe) == 2


def test_an_architecture_sglang_does_not_know_is_fused_as_most_models_are_and_said_once(tmp_path, monkeypatch, caplog):
    import logging

    from sm120_fp4 import errors

    monkeypatch.setattr(errors, "_said", set())  # "once per process": this test's process starts now
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    with caplog.at_level(logging.WARNING, logger="sm120_fp4"):
        for _ in range(2):
            dense, _ = model_check.discover(path).distinct()
    said = [r.getMessage() for r in caplog.records if "model class" in r.getMessage()]
    assert len(said) == 1 and "['NoSuchForCausalLM']" in said[0] and "qkv_proj = q_proj + k_proj + v_proj" in said[0]
    assert "set config.json's architectures" in said[0], said
    assert dense[0].name == "model.layers.0.self_attn.qkv_proj"


def test_discover_reads_mixtral_style_expert_names(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    renamed = {
        k.replace(".gate_proj.", ".w1.").replace(".up_proj.", ".w3.").replace(".down_proj.", ".w2.")
        if ".experts." in k
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, f"{path}/model.safetensors")
    _, moe = model_check.discover(path).distinct()
    assert [m.key for m in moe] == [(8, 256, 128, True)]


def test_a_checkpoint_without_nvfp4_is_a_config_error(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    (tmp_path / "m" / "hf_quant_config.json").unlink()
    with pytest.raises(ConfigError, match="is not NVFP4"):
        model_check.discover(path)


def test_no_safetensors_is_a_checkpoint_error(tmp_path):
    path = write_checkpoint(str(tmp_path / "m"), seed=1)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        model_check.discover(path)
    assert torch.__version__  # the module imported torch: nothing else needed it


# ---- a checkpoint's faults: named in one line (file, tensor, what is accepted), exit 2, no kernel blamed ----


def _edit_tensors(path, change):
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    change(tensors)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


def _edit_config(path, change):
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def _set(name, value):
    def change(tensors):
        tensors[name] = torch.full_like(tensors[name], value)

    return change


def _nan_block_byte(name):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(torch.uint8)[1, 3] = 0xFF

    return change


def _drop(*names):
    def change(tensors):
        for key in [k for k in tensors if any(k.startswith(n) for n in names)]:
            del tensors[key]

    return change


ATTN, EXPERTS = "model.layers.1.self_attn", "model.layers.0.mlp.experts"
# (checkpoint format, what is done to it, what the one line must name)
FAULTS = {
    "missing weight_scale": (
        MODELOPT,
        lambda p: _edit_tensors(p, _drop(f"{ATTN}.k_proj.weight_scale")),
        f"{ATTN}.k_proj.weight_scale is missing",
    ),
    "missing weight_scale_2": (
        MODELOPT,
        lambda p: _edit_tensors(p, _drop(f"{ATTN}.o_proj.weight_scale_2")),
        f"{ATTN}.o_proj.weight_scale_2 is missing",
    ),
    "missing input_global_scale": (
        COMPRESSED_TENSORS,
        lambda p: _edit_tensors(p, _drop(f"{ATTN}.q_proj.input_global_scale")),
        f"{ATTN}.q_proj.input_global_scale is missing",
    ),
    "float16 block scales": (
        MODELOPT,
        lambda p: _edit_tensors(
            p, lambda t: t.__setitem__(f"{ATTN}.v_proj.weight_scale", t[f"{ATTN}.v_proj.weight_scale"].half())
        ),
        "float16; accepted: float8_e4m3fn",
    ),
    "an expert missing": (
        MODELOPT,
        lambda p: _edit_tensors(p, _drop(f"{EXPERTS}.5.down_proj.")),
        f"{EXPERTS}.5.down_proj.weight is missing (expert 5 of 8)",
    ),
    "an expert's block scales missing": (
        COMPRESSED_TENSORS,
        lambda p: _edit_tensors(p, _drop(f"{EXPERTS}.2.up_proj.weight_scale")),
        f"{EXPERTS}.2.up_proj.weight_scale is missing",
    ),
    "NaN weight_scale_2": (
        MODELOPT,
        lambda p: _edit_tensors(p, _set(f"{ATTN}.o_proj.weight_scale_2", float("nan"))),
        f"{ATTN}.o_proj.weight_scale_2 = nan; accepted: a finite positive scale",
    ),
    "negative weight_scale_2 of an expert": (
        MODELOPT,
        lambda p: _edit_tensors(p, _set(f"{EXPERTS}.1.gate_proj.weight_scale_2", -0.5)),
        f"{EXPERTS}.1.gate_proj.weight_scale_2 = -0.5",
    ),
    "zero input_scale": (
        MODELOPT,
        lambda p: _edit_tensors(p, _set(f"{ATTN}.q_proj.input_scale", 0.0)),
        f"{ATTN}.q_proj.input_scale = 0.0",
    ),
    "infinite weight_global_scale": (
        COMPRESSED_TENSORS,
        lambda p: _edit_tensors(p, _set(f"{ATTN}.k_proj.weight_global_scale", float("inf"))),
        f"{ATTN}.k_proj.weight_global_scale = inf",
    ),
    "zero input_global_scale": (
        COMPRESSED_TENSORS,
        lambda p: _edit_tensors(p, _set(f"{EXPERTS}.0.down_proj.input_global_scale", 0.0)),
        f"{EXPERTS}.0.down_proj.input_global_scale = 0.0",
    ),
    "a NaN block-scale byte": (
        MODELOPT,
        lambda p: _edit_tensors(p, _nan_block_byte(f"{EXPERTS}.7.down_proj.weight_scale")),
        f"{EXPERTS}.7.down_proj.weight_scale[1, 3] is a NaN block scale (E4M3 byte 0xff)",
    ),
    "truncated safetensors": (
        MODELOPT,
        lambda p: os.truncate(p / "model.safetensors", os.path.getsize(p / "model.safetensors") - 100),
        "model.safetensors: tensor",
    ),
    "a corrupt header": (
        COMPRESSED_TENSORS,
        lambda p: _overwrite(p / "model.safetensors", 8, b"\x00garbage{"),
        "model.safetensors: its safetensors header is invalid JSON",
    ),
    "a header length past the end": (
        MODELOPT,
        lambda p: _overwrite(p / "model.safetensors", 0, (1 << 40).to_bytes(8, "little")),
        "model.safetensors: ",
    ),
    "a symlink loop": (
        MODELOPT,
        lambda p: os.symlink("loop.safetensors", p / "loop.safetensors"),
        "loop.safetensors: cannot open it",
    ),
    "group_size 32": (
        MODELOPT,
        lambda p: _edit_config(p, lambda c: c["quantization_config"].update(group_size=32)),
        "config.json: group_size = 32; accepted: 16",
    ),
    "compressed-tensors group_size 32": (
        COMPRESSED_TENSORS,
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32)
        ),
        "config.json: config_groups.group_0.weights.group_size = 32; accepted: 16",
    ),
    "an ignore list naming a quantized layer": (
        MODELOPT,
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"].update(ignore=["lm_head", "model.layers.1.self_attn.o_proj"])
        ),
        "names model.layers.1.self_attn.o_proj",
    ),
    "a compressed-tensors ignore regex naming the experts": (
        COMPRESSED_TENSORS,
        lambda p: _edit_config(p, lambda c: c["quantization_config"].update(ignore=["lm_head", "re:.*mlp.experts.*"])),
        "re:.*mlp.experts.*",
    ),
    "hidden_size contradicting the tensors": (
        MODELOPT,
        lambda p: _edit_config(p, lambda c: c.update(hidden_size=512)),
        "config.json's hidden_size is 512",
    ),
    "num_experts contradicting the tensors": (
        COMPRESSED_TENSORS,
        lambda p: _edit_config(p, lambda c: c.update(num_experts=16, num_local_experts=16)),
        "is missing (expert 8 of 16)",
    ),
    "heads * head_dim contradicting the tensors": (
        MODELOPT,
        lambda p: _edit_config(p, lambda c: c.update(num_key_value_heads=4)),
        "num_key_value_heads * head_dim is 256",
    ),
    # safetensors' own rules: the tensors cover the data exactly, metadata maps strings to strings
    "trailing bytes after the tensors' data": (
        MODELOPT,
        lambda p: _append(p / "model.safetensors", b"\0" * 8),
        "model.safetensors: its tensors cover",
    ),
    "a gap between two tensors' bytes": (
        COMPRESSED_TENSORS,
        lambda p: _edit_header(p / "model.safetensors", lambda h: _shift_last(h, 16), b"\0" * 16),
        "(a gap or an overlap)",
    ),
    "two tensors' bytes overlapping": (
        MODELOPT,
        lambda p: _edit_header(p / "model.safetensors", lambda h: _shift_last(h, -2), b"\0\0"),
        "(a gap or an overlap)",
    ),
    "a non-string __metadata__ value": (
        MODELOPT,
        lambda p: _edit_header(p / "model.safetensors", lambda h: h.update(__metadata__={"format": 1})),
        "model.safetensors: its __metadata__ is",
    ),
    # files that are not what they are named: never opened for reading, never parsed past Python's recursion
    "deeply nested JSON in config.json": (
        MODELOPT,
        lambda p: (p / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        "config.json: invalid JSON (nested too deeply)",
    ),
    "deeply nested JSON in a safetensors header": (
        COMPRESSED_TENSORS,
        lambda p: _edit_header(p / "model.safetensors", lambda h: h.update(__metadata__=_Nested())),
        "model.safetensors: its safetensors header is invalid JSON (nested too deeply)",
    ),
    "a directory named model.safetensors": (
        MODELOPT,
        lambda p: (os.unlink(p / "model.safetensors"), os.mkdir(p / "model.safetensors")),
        "model.safetensors: not a regular file",
    ),
    "config.json as a FIFO": (
        MODELOPT,
        lambda p: (os.unlink(p / "config.json"), os.mkfifo(p / "config.json")),
        "config.json: not a regular file",
    ),
    "the index as a FIFO": (
        COMPRESSED_TENSORS,
        lambda p: os.mkfifo(p / "model.safetensors.index.json"),
        "model.safetensors.index.json: not a regular file",
    ),
    # config.json values the engines reject when they build the model
    "num_experts_per_tok 99 of 8 experts": (
        MODELOPT,
        lambda p: _edit_config(p, lambda c: c.update(num_experts_per_tok=99)),
        "config.json: num_experts_per_tok = 99; accepted: 1 to the number of experts (8)",
    ),
    "num_experts_per_tok 0": (
        COMPRESSED_TENSORS,
        lambda p: _edit_config(p, lambda c: c.update(num_experts_per_tok=0)),
        "config.json: num_experts_per_tok = 0; accepted: 1 to the number of experts",
    ),
    "num_key_value_heads not dividing num_attention_heads": (
        MODELOPT,
        lambda p: _edit_config(p, lambda c: c.update(num_key_value_heads=3)),
        "config.json: num_key_value_heads = 3; accepted: a divisor of num_attention_heads",
    ),
    # a module the engines fuse with its siblings, missing as a whole
    "layer 0's k_proj missing as a whole": (
        MODELOPT,
        lambda p: _edit_tensors(p, _drop("model.layers.0.self_attn.k_proj.")),
        "model.layers.0.self_attn.k_proj is missing, while model.layers.0.self_attn.q_proj is NVFP4 (config.json "
        "says 2 KV heads)",
    ),
    # the index: what it names is what the engines load
    "layer 1's tensors only in a file the index leaves out": (
        MODELOPT,
        lambda p: _split_unlisted(p, "model.layers.1."),
        "unlisted.safetensors: holds tensor model.layers.1.",
    ),
    "an index naming its file by an absolute path": (
        COMPRESSED_TENSORS,
        lambda p: _write_index(p, lambda name: str(p / name)),
        "model.safetensors.index.json: names the file of tensor",
    ),
    # NVFP4's own limits
    "ModelOpt config_groups group_size 32": (
        MODELOPT,
        lambda p: _edit_config(
            p, lambda c: c["quantization_config"].update(config_groups={"group_0": {"weights": {"group_size": 32}}})
        ),
        "config.json: config_groups.group_0.weights.group_size = 32; accepted: 16",
    ),
    "hf_quant_config.json group_size 32 at its top level": (
        MODELOPT,
        lambda p: _legacy_group_size(p, 32),
        "hf_quant_config.json: group_size = 32; accepted: 16",
    ),
    "a weight_scale_2 of 1e-45 (alpha underflows)": (
        MODELOPT,
        lambda p: _edit_tensors(p, _set(f"{ATTN}.o_proj.weight_scale_2", 1e-45)),
        f"{ATTN}.o_proj.weight_scale_2 = 1.401298464324817e-45; accepted: a finite positive scale, a normal float32",
    ),
    "global scales whose alpha underflows (each one normal)": (
        COMPRESSED_TENSORS,
        lambda p: _edit_tensors(
            p,
            lambda t: (
                _set(f"{ATTN}.o_proj.weight_global_scale", 1e30)(t),
                _set(f"{ATTN}.o_proj.input_global_scale", 1e30)(t),
            ),
        ),
        f"{ATTN}.o_proj: its global scales (1.0000000150474662e+30 and 1.0000000150474662e+30) give the GEMM an alpha",
    ),
    "a block-scale byte with the sign bit set": (
        MODELOPT,
        lambda p: _edit_tensors(p, _block_byte(f"{ATTN}.q_proj.weight_scale", 0xB8)),
        f"{ATTN}.q_proj.weight_scale[1, 3] is a negative block scale (the sign bit set) (E4M3 byte 0xb8)",
    ),
}


class _Nested(dict):
    """A header value nested 100,000 levels deep as JSON (written by hand: json.dumps would recurse)."""


def _header_bytes(header) -> bytes:
    if isinstance(header.get("__metadata__"), _Nested):
        rest = json.dumps({k: v for k, v in header.items() if k != "__metadata__"})
        return ('{"__metadata__": ' + "[" * 100_000 + "]" * 100_000 + ", " + rest[1:]).encode()
    return json.dumps(header).encode()


def _edit_header(path, change, extra=b""):
    """Rewrite a safetensors file's header (`change` edits its dict), its data kept, `extra` appended."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = _header_bytes(header)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :] + extra)


def _shift_last(header, by):
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"] = [o + by for o in header[last]["data_offsets"]]


def _append(path, data):
    with open(path, "ab") as f:
        f.write(data)


def _block_byte(name, byte):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(torch.uint8)[1, 3] = byte

    return change


def _write_index(path, file_name, files=None):
    from safetensors import safe_open

    weight_map = {}
    for name in files or ["model.safetensors"]:
        with safe_open(str(path / name), "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), file_name(name)))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _split_unlisted(path, prefix):
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    save_file({k: v for k, v in tensors.items() if k.startswith(prefix)}, f"{path}/unlisted.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith(prefix)}, f"{path}/model.safetensors")
    _write_index(path, lambda name: name)


def _legacy_group_size(path, size):
    _edit_config(path, lambda c: c.pop("quantization_config"))
    legacy = json.loads((path / "hf_quant_config.json").read_text())
    (path / "hf_quant_config.json").write_text(json.dumps({**legacy, "group_size": size}))


def _overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@case(
    "configuration",
    "`sm120-fp4 selftest --model DIR` with a checkpoint with {fault}",
    "exit 2 before any worker or kernel runs; one line on stderr naming the file and the tensor (or config key) and what "
    "is accepted; no traceback, no REFUSED row",
)
@pytest.mark.parametrize(
    "fault", slow_but_one(FAULTS, keep=list(FAULTS).index("hf_quant_config.json group_size 32 at its top level"))
)
def test_a_checkpoint_fault_is_named_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys, fault):
    fmt, damage, named = FAULTS[fault]
    path = tmp_path / "ckpt"
    write_checkpoint(str(path), seed=9, fmt=fmt)
    damage(path)
    for name, value in SIM.items():
        monkeypatch.setenv(name, value)
    with model_workers_in_process():
        rc = cli.main(["selftest", "--model", str(path)])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, (out, err)
    assert len(lines) == 1 and named in lines[0] and "accepted" in lines[0], err
    assert "Traceback" not in err and "REFUSED" not in out and "kernel" not in lines[0].replace("not a kernel", "")


@case(
    "configuration",
    "`sm120-fp4 selftest --model DIR` with a safetensors file that cannot be read (mode 000)",
    "exit 2; one line naming the file and that it cannot be opened",
)
def test_an_unreadable_safetensors_file_is_named(tmp_path, monkeypatch, capsys):
    if os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file")
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9)
    os.chmod(f"{path}/model.safetensors", 0)
    monkeypatch.setenv("SM120_FP4_SIMULATE", "12.0")
    assert cli.main(["selftest", "--model", path]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert "model.safetensors: cannot open it" in line


def test_both_demo_checkpoints_pass_the_validation_pass(tmp_path):
    for fmt in (MODELOPT, COMPRESSED_TENSORS):
        checkpoint = checkpoints.inspect(write_checkpoint(str(tmp_path / fmt), seed=3, fmt=fmt))
        assert len(checkpoint.linear()) == 8 and sorted(checkpoint.experts) == [
            f"model.layers.{i}.mlp.experts" for i in (0, 1)
        ]


def _rescale(path: str, name: str, factor: float) -> None:
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/model.safetensors")
    tensors[name] = tensors[name] * factor
    save_file(tensors, f"{path}/model.safetensors")


@pytest.mark.parametrize("fmt, tensor", [(MODELOPT, "weight_scale_2"), (COMPRESSED_TENSORS, "weight_global_scale")])
@pytest.mark.parametrize("factor", [0.25, 0.0], ids=["4x smaller", "zero"])
@case(
    "configuration",
    "selftest --model on a checkpoint ({fmt}) whose second layer's q_proj {tensor} is {factor} times k_proj's and v_proj's",
    "exit 2 naming the checkpoint's fault (the fused layer, its shards and their values; a zero scale by its tensor), "
    "although its configuration's first layer is fine; no kernel blamed",
)
def test_selftest_model_refuses_shards_with_different_global_scales(
    sglang_unpatched, tmp_path, monkeypatch, capsys, fmt, tensor, factor
):
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9, fmt=fmt)
    _rescale(path, f"model.layers.1.self_attn.q_proj.{tensor}", factor)
    for name, value in SIM.items():
        monkeypatch.setenv(name, value)
    with model_workers_in_process():
        rc = cli.main(["selftest", "--model", path, "--json"])
    captured = capsys.readouterr()
    assert rc == 2, (captured.out, captured.err)
    if factor:  # found where SGLang's fusion of the shards is known: the worker that builds the layers
        [result] = json.loads(captured.out).values()
        message = result["message"]
        assert result["usage"] and not result["ok"], result
        assert (
            "model.layers.1.self_attn.qkv_proj" in message
            and "q_proj" in message
            and "differ in the checkpoint" in message
        ), message
    else:  # a zero scale is the validation pass's, in the parent, before any worker
        assert f"model.layers.1.self_attn.q_proj.{tensor} = 0.0" in captured.err and captured.err.count("\n") == 1, (
            captured.err
        )


def test_an_unfused_layer_with_a_bad_scale_is_named_as_one_layer_not_as_shards(tmp_path):
    """The model check's message for an unfused layer says what is wrong with its scale, not "the fused layer"."""
    path = write_checkpoint(str(tmp_path / "ckpt"), seed=9)
    _edit_tensors(path, _set(f"{ATTN}.o_proj.weight_scale_2", 0.0))
    with pytest.raises(CheckpointError) as err:
        model_check.check_model(path, torch.device("cpu"))
    message = str(err.value)
    assert f"the NVFP4 layer {ATTN}.o_proj: the checkpoint's weight_scale_2 of o_proj = 0.0; accepted" in message
    assert "the fused layer" not in message and "largest" not in message and "shards" not in message, message


def test_a_copy_of_the_model_in_another_layout_beside_the_index_is_left_alone(tmp_path):
    """A file the index leaves out whose tensors are another layout's (Mistral's consolidated.safetensors) is not
    the served model's: the engines never read it, and neither does the validation."""
    path = tmp_path / "ckpt"
    write_checkpoint(str(path), seed=9)
    _write_index(path, lambda name: name)
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    (path / "broken.safetensors").write_bytes(b"not safetensors")
    assert len(checkpoints.inspect(str(path)).linear()) == 8

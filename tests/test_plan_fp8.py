"""`threefold plan --fp8` (the dry run's ``train.fp8`` in the search) and the B200 entry."""

from __future__ import annotations

import json

import pytest

from threefold.accounting import comm_bytes_per_step
from threefold.commands.plan_options import build_parser
from threefold.commands.planning import _setup, main
from threefold.config import load_config
from threefold.hardware.catalogue import GPUS, peak_flops_for_device_name
from threefold.launch.dryrun import predict
from threefold.layout import Layout
from threefold.plan.memory import memory_per_rank
from threefold.plan.step import predict_step


def _plan_setup(*argv):
    return _setup(build_parser().parse_args(list(argv)))


def _tiny(tmp_path, fp8: str):
    return load_config(None, [("model.preset", "tiny"), ("data.vocab_size", "512"),
                              ("train.dtype", "bfloat16"), ("train.fp8", fp8),
                              ("train.output_dir", str(tmp_path))])


def test_plan_fp8_shortens_compute_as_the_dry_run_does(tmp_path, monkeypatch):
    """--fp8 tensorwise gives the search the dry run's FP8: for the dry run's own layout, the
    compute time FP8 saves and the activation bytes its scales add are the dry run's."""
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    dry = {r: predict(_tiny(tmp_path, r), 1) for r in ("none", "tensorwise")}
    cfg = _tiny(tmp_path, "none")
    toml = tmp_path / "m.toml"
    toml.write_text('[model]\npreset = "tiny"\n[data]\nvocab_size = 512\n')
    seq, batch = cfg.data.seq_len, cfg.train.global_batch_size
    plan = {r: _plan_setup("--model", str(toml), "--gpus", "1", "--seq-len", str(seq),
                           "--global-batch-tokens", str(seq * batch), "--fp8", r)
            for r in ("none", "tensorwise")}
    assert plan["tensorwise"][2].fp8 == dry["tensorwise"].work.fp8 == "tensorwise"
    layout = dry["none"].layout
    mcfg, cluster = plan["none"][0], plan["none"][1]
    assert mcfg.hidden_size == dry["none"].model.hidden_size
    step = {r: predict_step(mcfg, layout, plan[r][2], cluster) for r in plan}
    assert step["tensorwise"].compute_s < step["none"].compute_s
    saved = step["none"].compute_s - step["tensorwise"].compute_s
    dry_saved = dry["none"].step.compute_s - dry["tensorwise"].step.compute_s
    assert saved == pytest.approx(dry_saved, rel=1e-9)
    act = {r: memory_per_rank(mcfg, layout, plan[r][2]).activations for r in plan}
    dry_act = {r: dry[r].memory.activations for r in dry}
    assert act["tensorwise"] - act["none"] == pytest.approx(
        dry_act["tensorwise"] - dry_act["none"]) and act["tensorwise"] > act["none"]


def test_plan_fp8_gathers_in_8_bits_only_where_the_runtime_does():
    """tensorwise under ZeRO-3 at tp 1 gathers the projections in e4m3 (fewer bytes sent
    than rowwise, which gathers in bf16); at tp 2 or ZeRO-2 neither does, and both send the
    same over dp_shard."""
    args = ("--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096")
    sent = {}
    for recipe in ("tensorwise", "rowwise"):
        cfg, _, work, _ = _plan_setup(*args, "--fp8", recipe)
        for tp, zero in ((1, 3), (2, 3), (1, 2)):
            lay = Layout(tp=tp, dp_shard=8 // tp, zero_stage=zero, recompute="full")
            sent[recipe, tp, zero] = comm_bytes_per_step(cfg, lay, work, stage=0)["dp_shard"]
    assert sent["tensorwise", 1, 3] < 0.8 * sent["rowwise", 1, 3]
    assert sent["tensorwise", 2, 3] == sent["rowwise", 2, 3]
    assert sent["tensorwise", 1, 2] == sent["rowwise", 1, 2]


@pytest.mark.parametrize("argv, match", [
    (["--gpu", "a100", "--fp8", "rowwise"], "--fp8: a100 has no FP8 peak"),
    (["--fp8", "e4m3"], "--fp8"),
    (["--lora-r", "8", "--fp8", "tensorwise", "--tp", "2"],
     "--fp8: tensorwise with --lora-r and --tp > 1 is not available"),
])
def test_plan_fp8_refusals_are_one_line(capsys, argv, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def test_plan_fp8_with_lora_searches_tp_1_only():
    *_, space = _plan_setup("--model", "llama3-8b", "--lora-r", "8", "--fp8", "rowwise")
    assert space.tp == (1,)
    *_, space = _plan_setup("--model", "llama3-8b", "--lora-r", "8")
    assert space.tp is None


def test_b200_is_planned_at_its_catalogue_peaks(capsys):
    b200, h100 = GPUS["b200"], GPUS["h100"]
    # dense, no sparsity: FP8 twice bf16, as on H100, and both above H100's
    assert b200.peak_flops("fp8") == 2 * b200.peak_flops("bf16") > h100.peak_flops("fp8")
    assert b200.memory_bytes > GPUS["h200"].memory_bytes
    assert b200.intra_node_bw == 2 * h100.intra_node_bw  # NVLink 5 against NVLink 4
    rc, out, err = main(["--model", "llama3-8b", "--gpu", "b200", "--top", "1"]), \
        *capsys.readouterr()
    assert rc == 0, err
    assert f"peak {b200.peak_flops('bf16') / 1e12:.0f} TF/s" in out
    assert f"{b200.memory_bytes / 1e9:.0f} GB" in out
    rc, out, err = main(["--model", "llama3-8b", "--gpu", "B200", "--fp8", "tensorwise",
                         "--top", "1"]), *capsys.readouterr()
    assert rc == 0 and f"+ fp8 tensorwise ({b200.peak_flops('fp8') / 1e12:.0f} TF/s)" in out
    steps = {}
    for gpu in ("h100", "b200"):
        assert main(["--model", "llama3-8b", "--gpu", gpu, "--json", "--top", "1"]) == 0
        steps[gpu] = json.loads(capsys.readouterr().out)[0]["step_time_s"]
    assert steps["b200"] < steps["h100"]


def test_device_names_find_b200_but_not_gb200():
    assert peak_flops_for_device_name("NVIDIA B200", "bf16") == GPUS["b200"].peak_flops("bf16")
    assert peak_flops_for_device_name("NVIDIA B200", "fp8") == GPUS["b200"].peak_flops("fp8")
    assert peak_flops_for_device_name("NVIDIA GB200", "bf16") is None  # a higher-power part


def _aligned(preset: str, **kw):
    """A tiny model whose every projection meets FP8's 16-multiple rule (so each target
    layer the runtime finds is an FP8 one)."""
    from threefold.config import ModelConfig
    return ModelConfig(preset=preset, vocab_size=256, **kw).resolved()


@pytest.mark.parametrize("cfg", [
    _aligned("tiny", intermediate_size=512),
    # a shared expert and a dense first block beside the routed experts
    _aligned("tiny-moe", shared_expert_intermediate_size=64, first_k_dense_replace=1,
             dense_intermediate_size=512),
], ids=["dense", "moe"])
def test_the_fp8_share_is_the_flops_of_the_layers_the_runtime_makes_fp8(cfg):
    """The planner's FP8 share of a token's forward FLOPs is what ``apply_fp8`` turns into
    FP8 layers on the model itself: attention projections, dense MLPs and shared experts
    (tiny-moe's routed experts, 344 wide, fail FP8's rule of 16 and stay in the compute dtype;
    tests/test_fp8_experts.py counts aligned ones)."""
    import torch

    from threefold.accounting import flops_per_token
    from threefold.layout import Workload
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.fp8_linear import Float8Linear, apply_fp8
    from threefold.plan.compute import fp8_flops_fraction

    with torch.device("meta"):
        model = CausalLM(cfg)
    assert apply_fp8(model, "tensorwise") == []  # every target layer made FP8
    fp8 = sum(2 * m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    work = Workload(seq_len=64, global_batch=8, fp8="tensorwise")
    assert fp8_flops_fraction(cfg, work) == pytest.approx(fp8 / (flops_per_token(cfg, 64) / 3))
    if cfg.num_local_experts:
        shared = [n for n, m in model.named_modules()
                  if isinstance(m, Float8Linear) and "shared_expert" in n]
        assert len(shared) == 3 * (cfg.num_hidden_layers - 1)
        assert not any(isinstance(m, Float8Linear) for m in model.model.layers[1].mlp.experts
                       .modules())


def test_plan_and_dry_run_say_the_routed_experts_run_in_bf16(tmp_path, capsys, monkeypatch):
    note = "the routed experts run in bf16"
    argv = ["--model", "tiny-moe", "--gpus", "8", "--seq-len", "256", "--top", "1"]
    assert main(argv + ["--fp8", "tensorwise"]) == 0
    assert note in capsys.readouterr().out
    assert main(argv) == 0
    assert note not in capsys.readouterr().out
    monkeypatch.setenv("THREEFOLD_HARDWARE", "h100")
    overrides = [("model.preset", "tiny-moe"), ("data.vocab_size", "512"),
                 ("train.dtype", "bfloat16"), ("train.output_dir", str(tmp_path))]
    for recipe, said in (("rowwise", True), ("none", False)):
        notes = predict(load_config(None, overrides + [("train.fp8", recipe)]), 1).notes
        assert any(note in n for n in notes) == said, recipe


def test_a_moe_blocks_fp8_scales_are_the_planners():
    """Tensorwise FP8 adds two fp32 scales per FP8 layer to what a block saves: in a mixture
    of experts' block with a shared expert, q/k/v/o and the shared expert's three."""
    import torch

    from tests.test_tp_layer import SavedBytes
    from threefold.layout import Workload
    from threefold.model.decoder import CausalLM
    from threefold.parallel.transforms.fp8_linear import apply_fp8
    from threefold.plan.activations import fp8_scale_bytes

    cfg = _aligned("tiny-moe", shared_expert_intermediate_size=64)
    b, s = 2, 32
    x = torch.randn(b, s, cfg.hidden_size, requires_grad=True)
    saved = {}
    for recipe in ("none", "tensorwise"):
        torch.manual_seed(0)
        model = CausalLM(cfg)
        apply_fp8(model, recipe)
        cos, sin = model.model.rotary(torch.arange(s).expand(b, s))
        with SavedBytes(list(model.parameters())) as got:
            model.model.layers[0](x, cos, sin, None)
        saved[recipe] = got.total
    extra = fp8_scale_bytes(cfg, Workload(s, b, fp8="tensorwise"))
    assert saved["tensorwise"] - saved["none"] == extra == 2 * 4 * 7

"""benchmarks/multidevice.py: its per-round ratios and medians."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("peft")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "multidevice.py"


def _module():
    spec = importlib.util.spec_from_file_location("multidevice_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _threads(seconds: float) -> dict:
    return {
        "step_seconds": seconds,
        "compute_seconds": seconds * 0.9,
        "averaging_seconds": 0.001,
        "update_seconds": seconds * 0.1,
    }


def _round(threads: float, one: float, ddp: float, **others: float) -> dict:
    """One round's systems: their step times (the threads' with its split)."""
    systems = {"threads": _threads(threads), "one": {"step_seconds": one}}
    systems["ddp"] = {"step_seconds": ddp}
    return systems | {name: {"step_seconds": seconds} for name, seconds in others.items()}


def test_ratios_are_paired_per_round_and_medians_over_rounds() -> None:
    bench = _module()
    rounds = [
        {"threads": _threads(0.05), "one": {"step_seconds": 0.09}, "ddp": {"step_seconds": 0.06}},
        {"threads": _threads(0.10), "one": {"step_seconds": 0.20}, "ddp": {"step_seconds": 0.08}},
        {"threads": _threads(0.06), "one": {"step_seconds": 0.11}, "ddp": {"step_seconds": 0.12}},
    ]
    table = bench.summarise(rounds, 16)
    assert table["threads"]["step_seconds"] == pytest.approx(0.06)
    assert table["threads"]["samples_per_second"] == pytest.approx(16 / 0.06)
    assert table["one"]["step_seconds"] == pytest.approx(0.11)
    # per round: 1.8, 2.0, 1.8333 -> median 1.8333 (not 0.11 / 0.06 of the medians: same here)
    assert table["speedup_over_one"] == pytest.approx(0.11 / 0.06)
    # per round: 0.8333, 1.25, 0.5 -> 0.8333 (the medians' ratio would be 0.06 / 0.08 = 0.75)
    assert table["step_ratio_to_ddp"] == pytest.approx(0.05 / 0.06)


def test_a_batch_smaller_than_the_replicas_is_refused() -> None:
    bench = _module()
    with pytest.raises(SystemExit, match="at least 2"):
        bench.main(["--batch", "1"])


def test_the_limit_column_is_paired_per_round_like_the_others() -> None:
    bench = _module()
    rounds = [
        _round(0.05, 0.09, 0.06, limit=0.045),
        _round(0.10, 0.20, 0.08, limit=0.08),
        _round(0.06, 0.11, 0.12, limit=0.05),
    ]
    table = bench.summarise(rounds, 16)
    assert table["limit"]["step_seconds"] == pytest.approx(0.05)
    # per round: 2.0, 2.5, 2.2 -> 2.2; threads / limit: 1.111, 1.25, 1.2 -> 1.2
    assert table["limit_speedup_over_one"] == pytest.approx(2.2)
    assert table["step_ratio_to_limit"] == pytest.approx(1.2)
    # the existing keys are unchanged by the new column
    assert table["speedup_over_one"] == pytest.approx(0.11 / 0.06)


def test_the_baseline_thread_check_times_both_threads(tmp_path: Path) -> None:
    """benchmarks/baseline_thread.py runs the one-replica step on the main thread and on another,
    reports both medians, and leaves torch's thread count as it found it (a tiny run: the
    figures themselves are for a quiet machine)."""
    import json

    import torch

    spec = importlib.util.spec_from_file_location(
        "baseline_thread", SCRIPT.parent / "baseline_thread.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    out = tmp_path / "baseline.json"
    result = module.main(["--blocks", "2", "--steps", "2", "--batch", "4", "--json", str(out)])
    assert torch.get_num_threads() == threads
    assert json.loads(out.read_text()) == result
    assert result["steps_each"] == 2
    assert result["main_thread_ms"] > 0 and result["other_thread_ms"] > 0


def test_the_optimizer_flag_picks_adamws_implementation_for_every_system() -> None:
    import torch

    bench = _module()
    assert bench.build_parser().parse_args([]).optimizer == "default"
    net = torch.nn.Linear(2, 2)
    net.bias.requires_grad_(False)
    for kind, flags in (("default", (None, None)), ("foreach", (True, None))):
        made = bench.optimizer(net, kind)
        assert isinstance(made, torch.optim.AdamW)
        assert (made.defaults["foreach"], made.defaults["fused"]) == flags
        assert made.param_groups[0]["params"] == [net.weight]  # the trainable ones only
    assert bench.optimizer(net, "fused").defaults["fused"] is True
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--optimizer", "sgd"])


@pytest.mark.soak  # a threads worker in a fresh process, about 5 s: make soak
def test_the_baseline_column_is_paired_per_round_and_a_worker_imports_the_code_asked() -> None:
    bench = _module()
    baseline = bench.BASELINE
    rounds = [
        _round(0.05, 0.09, 0.06, **{baseline: 0.04}),
        _round(0.10, 0.20, 0.08, **{baseline: 0.125}),
        _round(0.06, 0.11, 0.12, **{baseline: 0.06}),
    ]
    table = bench.summarise(rounds, 16)
    assert table[bench.BASELINE]["step_seconds"] == pytest.approx(0.06)
    # per round: 1.25, 0.8, 1.0 -> 1.0
    assert table["step_ratio_to_baseline"] == pytest.approx(1.0)
    args = bench.build_parser().parse_args(["--steps", "1", "--warmup", "0", "--batch", "2"])
    result = bench.run_threads_in(SCRIPT.parent.parent, args)
    assert result["step_seconds"] > 0 and Path(result["code"]) == SCRIPT.parent.parent


def test_a_baseline_without_the_multidevice_package_is_refused(tmp_path: Path) -> None:
    bench = _module()
    with pytest.raises(SystemExit, match="no paramsync/actors/multidevice"):
        bench.main(["--baseline", str(tmp_path)])


def test_the_phases_time_each_replica_and_both_updates_in_their_order() -> None:
    bench = _module()
    args = bench.build_parser().parse_args(["--steps", "2", "--warmup", "1", "--batch", "4"])
    phases = bench.run_phases(args)
    assert set(phases) == {
        "replica 0 forward/backward",
        "replica 1 forward/backward",
        "finish gap",
        "first optimizer step",
        "second optimizer step",
        "first digest",
        "second digest",
    }
    assert all(ms >= 0 for ms in phases.values()) and phases["first optimizer step"] > 0
    unchecked = bench.build_parser().parse_args(["--steps", "2", "--warmup", "1", "--batch", "4"])
    unchecked.check_interval = 0
    assert "first digest" not in bench.run_phases(unchecked)


def test_the_device_option_places_every_systems_replicas() -> None:
    import torch

    bench = _module()
    parser = bench.build_parser()
    args = parser.parse_args([])
    assert args.device == "cpu" and bench.device_of(args, 1) == "cpu"
    options = bench._worker_options(parser.parse_args(["--device", "cuda"]))
    assert options[options.index("--device") + 1] == "cuda"  # the DDP ranks' processes too
    on_gpu = parser.parse_args(["--device", "cuda"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"torch.cuda.is_available\(\) is False"):
            bench.device_of(on_gpu, 0)
        return
    count = torch.cuda.device_count()  # pragma: no cover (on a GPU)
    assert [bench.device_of(on_gpu, i) for i in (0, 1)] == [f"cuda:{i % count}" for i in (0, 1)]

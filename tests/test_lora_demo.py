"""``make demo-lora`` (`paramsync.actors.demo_job.lora_demo`) end to end with tiny settings: 2
processes x 2 CPU devices fine-tune peft LoRA adapters of a frozen character transformer.

What the demo claims, checked from its workers' reports: the adapters' gradients are averaged
(every replica of every process ends with the same adapters, and they moved from their initial
values, though each process trained on its own data), the frozen base is untouched and identical
everywhere (every replica's frozen weights equal the pre-trained base's), the adapter is saved
as a small safetensors file holding only the adapters, and the summary is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "peft", reason="demo-lora needs the `lora` extra (peft): pip install 'paramsync[lora]'"
)

ROOT = Path(__file__).resolve().parent.parent


def test_demo_lora_averages_the_adapters_and_leaves_the_base_frozen(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "demo-lora"
    command = [sys.executable, "-m", "paramsync.actors.demo_job.lora_demo", "--pretrain-steps", "3"]
    command += ["--steps", "16", "--batch-size", "8", "--corpus-bytes", "200000"]
    command += ["--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in (
        "pre-training loss:",
        "fine-tuning loss:",
        "trainable:",
        "identical adapters:    True (2 processes x 2 replicas",
        "frozen base untouched: True",
        "adapter (safetensors):",
    ):
        assert line in done.stdout, done.stdout

    results = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in results] == [0, 1]
    adapters = {d for r in results for d in r["replica_adapter_digests"]}
    assert len(adapters) == 1  # every replica of every process: the same averaged adapters
    assert all(len(r["replica_adapter_digests"]) == 2 for r in results)
    assert all(r["initial_adapter_digest"] not in adapters for r in results)  # they trained
    assert all(len(r["losses"]) == 16 for r in results)
    # The frozen base: the same pre-trained weights in both processes, never changed.
    frozen = {d for r in results for d in (r["frozen_digest_before"], *r["replica_frozen_digests"])}
    assert len(frozen) == 1
    assert all(len(r["replica_frozen_digests"]) == 2 for r in results)

    first = results[0]
    assert 0 < first["adapter_parameters"] < first["model_parameters"]
    saved = load_file(first["adapter_file"])
    assert sum(t.numel() for t in saved.values()) == first["adapter_parameters"]
    assert all("lora_" in name for name in saved)  # the adapters only, not the base
    assert first["adapter_bytes"] < 4 * first["model_parameters"]  # not the whole model

# paramsync: every target sets up its own .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test torch-suite demo demo-3d demo-lora demo-allreduce bench bench-ddp bench-torch-backend bench-torchdist bench-multidevice bench-multihost bench-torchrun-hosts bench-groups bench-control-plane gpu-check reliability-hostile soak lint format clean setup api-docs

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,lora,frameworks]'
	touch $(STAMP)

# The wheel tests' venv (tests/test_wheel.py): this tree's wheel with torch and the rest of its
# dependencies, made once; the tests reinstall the wheel of the tree as it is at each run.
WHEEL_ENV := $(VENV)/wheel-env
WHEEL_STAMP := $(WHEEL_ENV)/.installed

$(WHEEL_STAMP): $(STAMP)
	rm -rf $(WHEEL_ENV) out/wheel
	$(BIN)/python -m venv $(WHEEL_ENV)
	$(BIN)/python -m pip wheel -q --no-deps -w out/wheel .
	$(WHEEL_ENV)/bin/python -m pip install -q -c constraints.txt out/wheel/paramsync-*.whl
	touch $(WHEEL_STAMP)

test: $(STAMP) $(WHEEL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

torch-suite: $(STAMP)
	$(BIN)/python tests/torch_suite/run_torch_suite.py --world-sizes 2 3 4 --large-world-size 8 --json out/torch_suite.json --markdown out/torch_suite.md

soak: $(STAMP)
	$(BIN)/python -m pytest -q -m soak

demo: $(STAMP)
	$(BIN)/python -m paramsync.actors.demo_job.demo

demo-3d: $(STAMP)
	$(BIN)/python -m paramsync.actors.demo_job.demo3d

demo-lora: $(STAMP)
	$(BIN)/python -m paramsync.actors.demo_job.lora_demo

demo-allreduce: $(STAMP)
	$(BIN)/python -m paramsync.runtime.cli.allreduce_demo

bench: $(STAMP)
	$(BIN)/python benchmarks/allreduce.py --json out/allreduce.json

bench-multihost: $(STAMP)
	$(BIN)/python benchmarks/multihost.py --json out/multihost.json

bench-torchrun-hosts: $(STAMP)
	$(BIN)/python benchmarks/torchrun_hosts.py --rounds 3 --nproc 2 --json out/torchrun_hosts.json

bench-groups: $(STAMP)
	$(BIN)/python benchmarks/groups.py --json out/groups.json

bench-ddp: $(STAMP)
	$(BIN)/python benchmarks/ddp.py --rounds 4 --steps 60 --check-cost --check-split 3 --json out/ddp.json

bench-torch-backend: $(STAMP)
	$(BIN)/python benchmarks/torch_backend.py --rounds 3 --proof-cost --json out/torch_backend.json

bench-torchdist: $(STAMP)
	$(BIN)/python benchmarks/torchdist.py --rounds 3 --json out/torchdist.json

bench-multidevice: $(STAMP)
	$(BIN)/python benchmarks/multidevice.py --rounds 15 --steps 30 --json out/multidevice.json

bench-control-plane: $(STAMP)
	$(BIN)/python benchmarks/control_plane.py --json out/control_plane.json

gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py --logs out/gpu-check --json out/gpu_check.json

reliability-hostile: $(STAMP)
	$(BIN)/python benchmarks/hostile.py --count 200 --flood 200 --baseline --json out/hostile.json

api-docs: $(STAMP)
	$(BIN)/python docs/api_page.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) out *.egg-info

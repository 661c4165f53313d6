# The two entry points of the README. Both set up what they need first (scripts/setup.sh).
.PHONY: setup bench test test-fast

setup:
	@scripts/setup.sh

# Main job: the fused MoE layer benchmark on the qwen3-30b-a3b preset, every available path vs naive.
bench: setup
	.venv/bin/cpumoe info --preset qwen3-30b-a3b
	.venv/bin/cpumoe bench layer --preset qwen3-30b-a3b --tokens 1,8,32,128,512,2048 --dtype bf16

# All tests, the slow ones included (what CI runs).
test: setup
	.venv/bin/python -m pytest -q

# The everyday loop: skips the cases marked slow.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

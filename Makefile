# The two entry points of the README. Both set up what they need first (scripts/setup.sh).
.PHONY: setup bench bench-layer bench-layer-quant bench-quant bench-suite test test-fast

setup:
	@scripts/setup.sh

# The main job's embedded default: a synthetic checkpoint with Qwen3-30B-A3B's real layer shapes (4 layers,
# vocabulary 32768, bf16, 5.3 GB), made once. Written aside and renamed, so an interrupted run leaves no half.
MODEL ?= checkpoints/qwen3-30b-a3b-4l

# Main job: the model benchmark (TTFT, ITL, throughput, decode GB/s against the measured bandwidth, prefill
# against the measured GEMM rate, peak memory) on the default checkpoint, at batch 1 and 16.
bench: setup $(MODEL)
	.venv/bin/cpumoe info --preset qwen3-30b-a3b
	.venv/bin/cpumoe bench model $(MODEL) --batch 1,16 --input-len 128,512 --output-len 128 --json bench-model.json

$(MODEL): | setup
	rm -rf $@.partial
	.venv/bin/cpumoe make-model --preset qwen3-30b-a3b --layers 4 --vocab 32768 --out $@.partial
	mv $@.partial $@

# The default checkpoint quantized by `cpumoe quantize` to each format (made once, beside it), and the model benchmark
# of all of them side by side against the bf16 one: decode and prefill speed-ups with their bounds, memory.
# The -head twins quantize the lm_head too (`--lm-head`, as GPTQ's lm_head=true checkpoints).
QUANT_FORMATS ?= int8 int4 fp8 mxfp4 int8-head int4-head
QUANT_MODELS = $(foreach f,$(QUANT_FORMATS),$(MODEL)-$(f))

$(MODEL)-%-head: | $(MODEL)
	rm -rf $@.partial
	.venv/bin/cpumoe quantize $(MODEL) $@.partial --format $* --lm-head
	mv $@.partial $@

$(MODEL)-%: | $(MODEL)
	rm -rf $@.partial
	.venv/bin/cpumoe quantize $(MODEL) $@.partial --format $*
	mv $@.partial $@

bench-quant: setup $(MODEL) $(QUANT_MODELS)
	.venv/bin/cpumoe bench model $(MODEL) $(QUANT_MODELS) --batch 1 --input-len 512 --output-len 128 \
		--json bench-quant.json

# The fused MoE layer alone, every available backend against the naive loop.
bench-layer: setup
	.venv/bin/cpumoe bench layer --preset qwen3-30b-a3b --tokens 1,8,32,128,512,2048 --dtype bf16

# The quantized formats beside bf16, on the backends the oracle would choose and the naive loop.
bench-layer-quant: setup
	.venv/bin/cpumoe bench layer --preset qwen3-30b-a3b --tokens 1,8,2048 --dtype bf16,int8,int4,fp8,mxfp4

# The benchmark suite on the default checkpoint (about 40 minutes here): the paper's layer sweeps, the runtime sweep,
# expert activation, pruning and serving, all in one results database, drawn as cpumoe-report/index.html.
SUITE_DB ?= cpumoe-results.db
bench-suite: setup $(MODEL)
	scripts/bench-suite.sh $(MODEL) $(SUITE_DB) cpumoe-report

# All tests, the slow ones included (what CI runs).
test: setup
	.venv/bin/python -m pytest -q

# The everyday loop: skips the cases marked slow.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

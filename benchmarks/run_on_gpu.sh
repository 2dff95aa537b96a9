#!/usr/bin/env bash
# One GPU session's checks, in order of importance: the cuda test suite, then bench_gpu.py's
# five-minute run (every section, the exact scans but the 8B one). Run from the project root on a
# machine whose image has torch (CUDA) but not transformer-lens / transformers 5.23, after
#   bash ../shared/gpu/prepare_wheels.sh      # on a machine with a registry: fills .whl/
# with .whl/ sent along. Outputs go to ${OUT:-gpu_out}/: cuda.log, cuda.xml, bench.log,
# bench_gpu.json, env.txt. Total about 7 minutes on one H200.
set -uo pipefail
out=${OUT:-gpu_out}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  nvidia-smi -L
  python3 -c "import torch, transformers, transformer_lens; print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('transformers', \
transformers.__version__, 'transformer_lens', __import__('importlib.metadata').metadata.version('transformer-lens'))"
} 2>&1 | tee "$out/env.txt"
# The cuda suite: every public function on the device, compared with the CPU.
timeout "${CUDA_SUITE_S:-150}" python3 -m pytest -q -m cuda -p no:cacheprovider \
  --junitxml="$out/cuda.xml" tests/test_devices.py 2>&1 | tee "$out/cuda.log"
echo "cuda suite exit: ${PIPESTATUS[0]}" | tee -a "$out/cuda.log"
# The benchmark; it rewrites its JSON after every section, so a run cut short keeps what it did.
timeout "${BENCH_S:-360}" python3 benchmarks/bench_gpu.py \
  --scan-models "${SCAN_MODELS:-mamba2-1.3b,mamba2-130m,llama-3.2-1b}" \
  --deadline "${DEADLINE_S:-280}" --out "$out/bench_gpu.json" 2>&1 | tee "$out/bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$out/bench.log"

#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks, each under its own time limit.
# Usage: bench/gpu_run.sh OUT_DIR [tests|kernels|decode]...   (default: all three)
set -u
out=${1:?usage: bench/gpu_run.sh OUT_DIR [parts]}; shift
parts=${*:-tests kernels decode}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
for part in $parts; do
  case $part in
    tests) timeout "${TESTS_S:-240}" python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25 ;;
    kernels) timeout "${KERNELS_S:-240}" python3 bench/kernels.py --out "$out/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee "$out/kernels.log" | tail -40 ;;
    decode) timeout "${DECODE_S:-300}" torchrun --nproc-per-node 2 bench/decode.py --out "$out/decode.json" --plot "$out/decode.png" ${DECODE_ARGS:-} 2>&1 | tee "$out/decode.log" | grep -v "^W1" | tail -60 ;;
  esac
done

#!/usr/bin/env bash
# One prepared GPU check, for a lent CUDA machine whose python3 already holds torch,
# transformers, pytest and hypothesis (nothing is installed there): the CUDA tests of both
# families, then NVIDIA's gr-inference protocol at full size (issue 24: qwen3-sid-1.7b, bf16,
# W=256, contexts 1000 and 5000 x batches 1 and 8, HF generate, top-1 vs float32, the online
# row; xrec with and without CUDA graphs), then the headline offline cases of both families
# on the GPU, in float32 (results compared with HF's) and in bfloat16, with the engine's
# default CUDA graphs and without them (--cuda-graphs false: the rows before graphs).
# About 7 minutes in all.
# Usage: bash scripts/gpu_check.sh OUT_DIR   (OUT_DIR receives one JSON per run)
set -u
out=${1:?usage: gpu_check.sh OUT_DIR}
work=$(mktemp -d)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15
echo "== gr-inference (${SECONDS}s so far)"
timeout 210 python3 -m xrec.cli bench offline --family qwen3 --case gr-inference --device cuda \
  --hf-repeats 2 --no-progress --out "$work/gr-inference" 2>&1 | grep -v '^ *$' | tail -32
cp "$work/gr-inference"/*.json "$out/gr-inference.json" 2>/dev/null
for family in qwen3 onerec; do
  for dtype in float32 bfloat16; do
    contenders=xrec,xrec-full; [ "$dtype" = float32 ] && contenders=xrec,xrec-full,hf
    echo "== $family $dtype (${SECONDS}s so far)"
    timeout 90 python3 -m xrec.cli bench offline --family "$family" --case targets \
      --device cuda --dtype "$dtype" --contenders "$contenders" --hf-repeats 2 --repeats 10 \
      --no-progress --out "$work/$family-$dtype" 2>&1 | grep -v '^ *$' | tail -14
    cp "$work/$family-$dtype"/*.json "$out/$family-$dtype.json" 2>/dev/null
  done
  echo "== $family bfloat16, eager (${SECONDS}s so far)"
  timeout 60 python3 -m xrec.cli bench offline --family "$family" --case targets --device cuda \
    --dtype bfloat16 --cuda-graphs false --contenders xrec,xrec-full --repeats 10 \
    --no-progress --out "$work/$family-eager" 2>&1 | grep -v '^ *$' | tail -8
  cp "$work/$family-eager"/*.json "$out/$family-bfloat16-eager.json" 2>/dev/null
done
echo "== done (${SECONDS}s)"

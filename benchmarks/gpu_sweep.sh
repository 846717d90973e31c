#!/usr/bin/env bash
# The accelerator sweep in one command: fedjax_het against the PyTorch loop (on the GPU's torch when there is one),
# round cost over clients 10..1000 and architecture groups 1..10 with compile counts and peak device memory, and
# the XLA-analysed plan of docs/performance.md; all merged into OUT/gpu_sweep_<backend>.json.
#
#   bash benchmarks/gpu_sweep.sh [OUT] [PART ...]     PART: vs_pytorch, scaling, plan (default: all three)
#   TINY=1 bash benchmarks/gpu_sweep.sh OUT           the smallest sizes, for the CPU tests (tests/test_gpu_sweep.py)
#
# Each part is one process and writes its own results under OUT before the merge, so the parts can also be run as
# separate commands on a machine that limits a command's time (each full part takes minutes on one H100-class GPU;
# not measured yet).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "${1:-$here/results/gpu_sweep}" && cd "${1:-$here/results/gpu_sweep}" && pwd)"
shift || true
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(vs_pytorch scaling plan)
cd "$here"

if [ "${TINY:-0}" = 1 ]; then
  vs=(--num_clients=2 --samples_per_client=48 --batch_size=8 --rounds=1 --nodisk_io)
  scaling=(--algorithms=fedre --num_clients=4 --groups=2 --models=mlp --group_family=mlp,small_cnn_narrow
           --samples_per_client=48 --batch_sizes=8 --rounds=1)
  plan=(--settings=quickstart)
else
  vs=(--num_clients=10,20,50,100,200,500,1000 --rounds=3)
  scaling=(--algorithms=fedre,fedavg --num_clients=10,50,200,1000 --groups=1,2,5,10 --models=cnn4 --rounds=2)
  plan=()
fi

for part in "${parts[@]}"; do
  case "$part" in
    vs_pytorch) python vs_pytorch.py "${vs[@]}" --out="$out" ;;
    scaling) python scaling.py "${scaling[@]}" --out="$out" ;;
    plan) python gpu_plan.py "${plan[@]}" --out="$out" ;;
    *) echo "gpu_sweep.sh: unknown part '$part'; choose vs_pytorch, scaling or plan." >&2; exit 2 ;;
  esac
done

python - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
parts = {}
for path in sorted(glob.glob(os.path.join(out, '*.json'))):
  name = os.path.basename(path)[:-len('.json')]
  if not name.startswith('gpu_sweep'):
    with open(path) as f:
      parts[name] = json.load(f)
backend = next(iter(parts.values()))['backend'] if parts else 'none'
merged = os.path.join(out, f'gpu_sweep_{backend}.json')
with open(merged, 'w') as f:
  json.dump({'tiny': os.environ.get('TINY', '0') == '1', 'parts': parts}, f, indent=2)
print('wrote', merged, '(' + ', '.join(parts) + ')')
EOF

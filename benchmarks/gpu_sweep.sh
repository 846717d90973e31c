#!/usr/bin/env bash
# The accelerator sweep in one command: fedjax_het against the PyTorch loop (on the GPU's torch when there is one),
# round cost over clients 10..1000 and architecture groups 1..10 with compile counts and peak device memory, and
# the XLA-analysed plan of docs/performance.md; all merged into OUT/gpu_sweep_<backend>.json.
#
#   bash benchmarks/gpu_sweep.sh [OUT] [PART ...]
#     PART: vs_pytorch, scaling_g1, scaling_g2, scaling_g5, scaling_g10 (FedRE and grouped FedAvg over 10, 50, 200
#     and 1,000 clients with that many architecture groups), plan; default: all of them, in that order; merge: only
#     merge the parts already under OUT (e.g. copied there from separate machines or commands)
#   PYTHON=...: the interpreter (default python3); the repository is put on PYTHONPATH, so nothing needs installing
#   where JAX, Flax, Optax and PyTorch are (a lent GPU machine's image).
#   TINY=1 bash benchmarks/gpu_sweep.sh OUT           the smallest sizes, for the CPU tests (tests/test_gpu_sweep.py)
#
# Each part is one process writing its own results under OUT (a scaling part under OUT/scaling_gN/) before the
# merge, which reads every part found there, so parts can run as separate commands where a command's time is
# limited (no part has been timed on a GPU yet). The PyTorch loop's per-round disk I/O is left out on an
# accelerator (HtFLlib's save/load per client is a CPU-side cost; `vs_pytorch.py --disk_io` measures it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "${1:-$here/results/gpu_sweep}" && cd "${1:-$here/results/gpu_sweep}" && pwd)"
shift || true
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(vs_pytorch scaling_g1 scaling_g2 scaling_g5 scaling_g10 plan)
  [ "${TINY:-0}" = 1 ] && parts=(vs_pytorch scaling_g2 plan)  # the tiny family has two architectures
fi
cd "$here"
py="${PYTHON:-python3}"
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"

if [ "${TINY:-0}" = 1 ]; then
  vs=(--num_clients=2 --samples_per_client=48 --batch_size=8 --rounds=1 --nodisk_io)
  scaling=(--algorithms=fedre --num_clients=4 --models=mlp --group_family=mlp,small_cnn_narrow
           --samples_per_client=48 --batch_sizes=8 --rounds=1)
  plan=(--settings=quickstart)
else
  vs=(--num_clients=10,20,50,100,200,500,1000 --rounds=3 --nodisk_io)
  scaling=(--algorithms=fedre,fedavg --num_clients=10,50,200,1000 --models=cnn4 --rounds=2)
  plan=()
fi

for part in "${parts[@]}"; do
  case "$part" in
    vs_pytorch) "$py" vs_pytorch.py "${vs[@]}" --out="$out" ;;
    scaling_g1|scaling_g2|scaling_g5|scaling_g10)
      "$py" scaling.py "${scaling[@]}" --groups="${part#scaling_g}" --out="$out/$part" ;;
    plan) "$py" gpu_plan.py "${plan[@]}" --out="$out" ;;
    merge) ;;
    *) echo "gpu_sweep.sh: unknown part '$part'; choose vs_pytorch, scaling_g1, scaling_g2, scaling_g5," \
            "scaling_g10, plan or merge." >&2; exit 2 ;;
  esac
done

"$py" - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
parts = {}
for path in sorted(glob.glob(os.path.join(out, '*.json')) + glob.glob(os.path.join(out, '*', '*.json'))):
  name = os.path.relpath(path, out)[:-len('.json')].replace(os.sep, '/')
  if not os.path.basename(name).startswith('gpu_sweep'):
    with open(path) as f:
      parts[name] = json.load(f)
backend = next(iter(parts.values()))['backend'] if parts else 'none'
merged = os.path.join(out, f'gpu_sweep_{backend}.json')
with open(merged, 'w') as f:
  json.dump({'tiny': os.environ.get('TINY', '0') == '1', 'parts': parts}, f, indent=2)
print('wrote', merged, '(' + ', '.join(parts) + ')')
EOF

#!/usr/bin/env bash
# The accelerator sweep in one command: fedjax_het against the PyTorch loop (on the GPU's torch when there is one),
# round cost over clients 10..1000 and architecture groups 1..10 with compile counts and peak device memory, and
# the XLA-analysed plan of docs/performance.md; all merged into OUT/gpu_sweep_<backend>.json, with the tables in
# OUT/gpu_sweep_<backend>.md and a figure in OUT/gpu_sweep_<backend>.png.
#
#   bash benchmarks/gpu_sweep.sh [OUT] [PART ...]
#     PART: paper_settings (the seed papers' settings against the PyTorch loop: FedRE Table 1's ten architectures at
#     10 and 20 clients, GeFL's and Felo's clients; cold and warm start, s/round, per architecture; under
#     OUT/paper_settings/), vs_pytorch (FedRE against the PyTorch loop at 10 and 100 clients), scaling_g1 (FedRE
#     over 10, 100, 1,000 and 10,000 clients, one architecture), scaling_g2, scaling_g5, scaling_g10 (10 clients
#     over that many architecture groups: their compilation); default: paper_settings vs_pytorch scaling_g5
#     scaling_g1. Also xla_flags (a cold start and a round of FedRE Table 1's ResNet-50 and ViT-B/16, one client
#     each, under XLA flag variants and with the blocks scanned: benchmarks/xla_flags.py, under OUT/xla_flags/),
#     host_cpu (the comparison on the machine's own CPU, 20 and 50 clients, fedjax_het's client threads 2, 4, 8
#     and 16 up to the cores, one process each under OUT/host_cpu_tN/), plan (XLA's analyses of the round) and
#     vmap_conv (the convolution formulations under vmap side by side at 256 and 1,024 clients, im2col against the
#     Pallas kernels of kernels/pallas_conv.py: cnn4's whole SGD step and three layers; benchmarks/vmap_conv.py, under
#     OUT/vmap_conv/); merge: only merge the parts already under OUT (e.g. copied there from separate machines or
#     commands)
#   ALGORITHMS="fedre fedavg": the methods of the scaling parts (default fedre)
#   SWEEP_SECONDS=...: the command's time limit; each part gets its share of what is left when it starts (by
#   weight: paper_settings 3, xla_flags 2, the others 1), is stopped at its share and keeps the rows it finished
#   (each part rewrites its results after every row)
#   VS_CLIENTS=10,100 and SCALING_CLIENTS=10,100,1000,10000: the client counts of vs_pytorch and scaling_g1
#   CONV=...: fedjax_het's convolution formulation in vs_pytorch and the scaling parts (default: the backend's;
#   CONV=pallas times a whole round with the Pallas kernels)
#   PYTHON=...: the interpreter (default python3); the repository is put on PYTHONPATH, so nothing needs installing
#   where JAX, Flax, Optax and PyTorch are (a lent GPU machine's image).
#   TINY=1 bash benchmarks/gpu_sweep.sh OUT           the smallest sizes, for the CPU tests (tests/test_gpu_sweep.py)
#
# Each part is a process writing its own results under OUT (a scaling part one process per algorithm, under
# OUT/scaling_gN_<algorithm>/) before the report (benchmarks/sweep_report.py: OUT/gpu_sweep_<backend>.json, .md
# and .png), which reads every part found there, so parts can run as separate commands where a command's time is
# limited (no part has been timed on a GPU yet). A part that fails is reported and the others go on; the exit
# status is then 1. The PyTorch loop's
# per-round disk I/O is left out on an accelerator (HtFLlib's save/load per client is a CPU-side cost;
# `vs_pytorch.py --disk_io` measures it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "${1:-$here/results/gpu_sweep}" && cd "${1:-$here/results/gpu_sweep}" && pwd)"
shift || true
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(paper_settings vs_pytorch scaling_g5 scaling_g1)  # the longest last: it gets the time the others leave
  [ "${TINY:-0}" = 1 ] && parts=(host_cpu vs_pytorch scaling_g2 plan)  # the tiny family has two architectures
fi
cd "$here"
py="${PYTHON:-python3}"
export PYTHONPATH="$(dirname "$here")${PYTHONPATH:+:$PYTHONPATH}"

if [ "${TINY:-0}" = 1 ]; then
  vs=(--num_clients=2 --samples_per_client=48 --batch_size=8 --rounds=1 --nodisk_io)
  host=(--num_clients=2 --samples_per_client=48 --batch_size=8 --rounds=1 --nodisk_io)
  host_threads=(1 2)
  algorithms=(fedre)
  scaling=(--num_clients=4 --models=mlp --group_family=mlp,small_cnn_narrow --samples_per_client=48 --batch_sizes=8
           --rounds=1)
  scaling_groups=("${scaling[@]}")
  plan=(--settings=quickstart)
  paper=(--settings=fedre_table1 --archs=cnn4 --steps_per_client=1 --rounds=1)
  convs=(--clients=2 --batch_size=2 --models= --layers=cnn4_conv2 --formulations=im2col,pallas --nobf16 --repeats=1)
  xla=(--archs=cnn4 --variants=default --steps_per_client=1 --rounds=1)
else
  vs=(--num_clients="${VS_CLIENTS:-10,100}" --rounds=3 --nodisk_io)
  host=(--num_clients=20,50 --rounds=3 --nodisk_io)
  host_threads=(2 4 8 16)
  algorithms=(${ALGORITHMS:-fedre})
  # 384 pool rows per client (288 train: 9 steps of 32) up to 1,000 clients; the 480,000-row pool then gives the
  # 10,000 clients 48 rows each (36 train: one step).
  scaling=(--num_clients="${SCALING_CLIENTS:-10,100,1000,10000}" --max_pool_rows=480000 --models=cnn4 --rounds=2)
  scaling_groups=(--num_clients=10 --models=cnn4 --rounds=2)  # several groups: their compilation
  plan=()
  # the tables' sizes, 2 timed rounds: FedRE Table 1 first (each setting's rows are kept as it ends)
  paper=(--rounds=2 --settings=fedre_table1,fedre_table1_20,gefl_table2,felo_table2)
  xla=(--archs=resnet50,vit_b16 --steps_per_client=20 --rounds=2)  # a ResNet's convolutions, a ViT's matmuls
  convs=(--clients=256,1024 --formulations=im2col,pallas --nobf16)
fi

for part in "${parts[@]}"; do
  case "$part" in
    paper_settings|xla_flags|vs_pytorch|host_cpu|scaling_g1|scaling_g2|scaling_g5|scaling_g10|plan|vmap_conv|merge) ;;
    *) echo "gpu_sweep.sh: unknown part '$part'; choose paper_settings, xla_flags, vs_pytorch, host_cpu, scaling_g1," \
            "scaling_g2, scaling_g5, scaling_g10, plan, vmap_conv or merge." >&2; exit 2 ;;
  esac
done

# SWEEP_SECONDS: this command's time; each part gets an equal share of what is left (less 15 s for the report),
# so a part that ends early leaves more to the next, and one stopped at its share keeps its finished rows.
budget="${SWEEP_SECONDS:-0}"
if ! [[ "$budget" =~ ^[0-9]+$ ]]; then
  echo "gpu_sweep.sh: SWEEP_SECONDS='$budget' is not a whole number of seconds; e.g. SWEEP_SECONDS=560." >&2; exit 2
fi
budget=$((10#$budget))
conv=()
[ -n "${CONV:-}" ] && conv=(--conv="$CONV")
failed=()
# A scaling part runs each algorithm in its own process (OUT/scaling_gN_<algorithm>/): a process's peak memory only
# grows, so its rows, smaller client counts first, then each report the peak of their own round.
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # the cores this process may use, not OpenMP's limit
units=()
for part in "${parts[@]}"; do
  case "$part" in
    merge) ;;
    scaling_g*) for algorithm in "${algorithms[@]}"; do units+=("${part}_$algorithm"); done ;;
    host_cpu)
      before=${#units[@]}
      for threads in "${host_threads[@]}"; do
        [ "$threads" -le "$cores" ] && units+=("host_cpu_t$threads")
      done
      if [ ${#units[@]} = "$before" ]; then
        echo "gpu_sweep.sh: part host_cpu not started: none of ${host_threads[*]} client threads fits $cores cores" >&2
        failed+=("host_cpu (not started)")
      fi ;;
    *) units+=("$part") ;;
  esac
done

results_of() {  # the pattern of the results files a unit writes
  case "$1" in
    vs_pytorch) echo "$out/vs_pytorch_*.json" ;;
    plan) echo "$out/gpu_plan_*.json" ;;
    *) echo "$out/$1/*.json" ;;
  esac
}

weight() {  # a unit's weight in the time shares: the paper settings compile ten architectures per setting
  case "$1" in paper_settings) echo 3 ;; xla_flags) echo 2 ;; *) echo 1 ;; esac
}
start=$SECONDS
left_weight=0
for part in ${units[@]+"${units[@]}"}; do left_weight=$((left_weight + $(weight "$part"))); done
for part in ${units[@]+"${units[@]}"}; do
  cap=()
  share=0
  w=$(weight "$part")
  if [ "$budget" -gt 0 ]; then
    share=$(( (budget - (SECONDS - start) - 15) * w / left_weight ))
    if [ "$share" -lt 5 ]; then
      echo "gpu_sweep.sh: part $part not started: its share of SWEEP_SECONDS=$budget would be $share s" >&2
      failed+=("$part (not started)"); left_weight=$((left_weight - w)); continue
    fi
    cap=(timeout -k 10 "$share")
  fi
  rc=0
  case "$part" in
    vs_pytorch) ${cap[@]+"${cap[@]}"} "$py" vs_pytorch.py "${vs[@]}" ${conv[@]+"${conv[@]}"} --out="$out" || rc=$? ;;
    paper_settings) ${cap[@]+"${cap[@]}"} "$py" paper_settings.py "${paper[@]}" --out="$out/$part" || rc=$? ;;
    xla_flags) ${cap[@]+"${cap[@]}"} "$py" xla_flags.py "${xla[@]}" --out="$out/$part" || rc=$? ;;
    vmap_conv) ${cap[@]+"${cap[@]}"} "$py" vmap_conv.py "${convs[@]}" --seconds="$share" --out="$out/$part" \
                 || rc=$? ;;
    scaling_g*)
      groups="${part#scaling_g}"
      args=("${scaling[@]}")
      [ "${groups%%_*}" != 1 ] && args=("${scaling_groups[@]}")
      ${cap[@]+"${cap[@]}"} "$py" scaling.py "${args[@]}" ${conv[@]+"${conv[@]}"} --algorithms="${part##*_}" \
        --groups="${groups%%_*}" --out="$out/$part" || rc=$? ;;
    host_cpu_t*)
      JAX_PLATFORMS=cpu ${cap[@]+"${cap[@]}"} "$py" vs_pytorch.py "${host[@]}" --strategy=sequential \
        --client_threads="${part#host_cpu_t}" --out="$out/$part" || rc=$? ;;
    plan) ${cap[@]+"${cap[@]}"} "$py" gpu_plan.py ${plan[@]+"${plan[@]}"} --out="$out" || rc=$? ;;
  esac
  if [ ${#cap[@]} -gt 0 ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; }; then
    if compgen -G "$(results_of "$part")" > /dev/null; then
      echo "gpu_sweep.sh: part $part stopped at its share of SWEEP_SECONDS ($share s); the rows it finished are" \
           "kept" >&2
    else
      echo "gpu_sweep.sh: part $part stopped at its share of SWEEP_SECONDS ($share s) before its first row" >&2
      failed+=("$part (stopped before its first row)")
    fi
  elif [ "$rc" != 0 ]; then
    echo "gpu_sweep.sh: part $part failed (exit $rc); the other parts go on" >&2
    failed+=("$part (exit $rc)")
  fi
  left_weight=$((left_weight - w))
done

find "$out" -maxdepth 2 -name '*.tmp' -delete  # a stopped part's unfinished write
report=0
"$py" sweep_report.py "$out" || report=$?
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_sweep.sh: these parts did not finish: ${failed[*]}" >&2
  exit 1
fi
exit "$report"

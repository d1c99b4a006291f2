#!/usr/bin/env bash
# One command for a machine with one CUDA GPU (under 8 minutes), and its CPU rehearsal:
#   scripts/gpu_check.sh [--out DIR]                    # CUDA: pi0's shapes and sizes
#   scripts/gpu_check.sh --device cpu --quick [--out DIR]   # CPU, tiny sizes: checks that every part runs
# Writes DIR/gpu_check.json (every part's results) and prints a short table at the end:
#   1. Newton-Schulz: standard vs Gram vs Gram + Triton SYRK at pi0's shapes, bf16 and fp32
#      (scripts/bench_newton_schulz.py; on CPU: standard vs Gram, fp32)
#   2. the full-pi0 optimizer step on one rank: AdamW / naive Muon / dmuon (scripts/bench_optimizer.py)
#   3. train steps, AdamW vs DMuon, compile off and on, with peak memory: pi0_small, and full pi0 in bf16
#      with gradient checkpointing (scripts/bench_train_step.py; --quick: pi0_tiny only)
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda
quick=0
out=bench_results/gpu_check
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --quick) quick=1; shift ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "gpu_check.sh: --device must be cuda or cpu, got $device" >&2; exit 2 ;; esac
python=${PYTHON:-python}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then python=.venv/bin/python; fi
if [ "$device" = cuda ] && ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no CUDA device here; use --device cpu --quick for the CPU rehearsal" >&2
  exit 1
fi
mkdir -p "$out"
export HF_HUB_OFFLINE=1  # nothing is fetched: the full-pi0 run uses the built-in tokenizer (timing only)
start=$(date +%s)

# Synthetic camera keys -> model cameras (pi0 presets name them base_0_rgb / left_wrist_0_rgb).
pi0_cameras='data.camera_map={observation.images.top: base_0_rgb, observation.images.wrist: left_wrist_0_rgb}'
if [ "$quick" = 1 ]; then
  ns_args=(--shapes 256x1024,512x512 --repeats 1 --steps 2)
  opt_preset=pi0_tiny; opt_steps=(--steps 2 --warmup 1)
  train_models=(pi0_tiny); train_steps=(--steps 2 --warmup 1 --batch 4)
  data_args=(--data-root "$out/data" --train-arg data.synthetic.episodes=4
             --train-arg data.synthetic.episode_length=12 --train-arg data.synthetic.image_size=32
             --train-arg data.num_workers=0)
else
  ns_args=()
  opt_preset=pi0; opt_steps=(--steps 3 --warmup 1)
  train_models=(pi0_small pi0); train_steps=(--steps 5 --warmup 2 --batch 8)
  data_args=(--data-root "$out/data")
fi

echo "== 1/3 Newton-Schulz ($device)"
if [ "$device" = cuda ]; then
  for dtype in bfloat16 float32; do
    "$python" scripts/bench_newton_schulz.py --device cuda --dtype "$dtype" "${ns_args[@]}" --json "$out/ns_$dtype.json"
  done
else
  "$python" scripts/bench_newton_schulz.py --device cpu "${ns_args[@]}" --json "$out/ns_float32.json"
fi

echo "== 2/3 optimizer step, $opt_preset, one rank"
"$python" scripts/bench_optimizer.py --nproc 1 --device "$device" --preset "$opt_preset" \
  --only adamw naive dmuon_lpt "${opt_steps[@]}" --json "$out/optimizer.json"

echo "== 3/3 train steps"
for model in "${train_models[@]}"; do
  extra=()
  if [ "$model" = pi0 ]; then
    extra=(--train-arg trainer.precision=bf16 --train-arg model.gradient_checkpointing=true
           --train-arg data.tokenizer_path=builtin --train-arg data.check_tokenizer_vocab=false
           --train-arg "$pi0_cameras")
  fi
  "$python" scripts/bench_train_step.py --model "$model" --nprocs 1 --optims adamw,dmuon --compile off,on \
    "${train_steps[@]}" "${data_args[@]}" "${extra[@]}" \
    --json "$out/train_$model.json" --plot "$out/train_$model.png"
done

"$python" - "$out" "$device" "$quick" "$(( $(date +%s) - start ))" <<'EOF'
import json, sys
from pathlib import Path
out, device, quick, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
parts = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "gpu_check.json"}
report = {"device": device, "quick": quick, "seconds": seconds, "parts": parts}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(f"\ngpu_check ({device}{', quick' if quick else ''}): {seconds} s, {out / 'gpu_check.json'}")
opt = parts["optimizer"].get("results", parts["optimizer"])
print("  optimizer step, one rank: " + ", ".join(f"{k} {v['median_s'] * 1e3:.1f} ms" for k, v in opt.items()))
for name, part in parts.items():
    if name.startswith("train_"):
        for label, row in part["results"]["1"].items():
            peak = row.get("peak_memory_gib")
            print(f"  {part['model']:<9} {label:<15} step {row['step_s']:.3f} s  peak {peak:.2f} GiB"
                  + (f"  compile {row['compile_s']:.1f} s" if row.get("compile_s") is not None else ""))
EOF

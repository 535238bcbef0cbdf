#!/bin/bash
# The refactor check of issue 25: the same three benchmarks on two source trees, on one
# machine in one run, alternating trees so drift hits both alike.
#
#   bash benchmarks/research/compare_commits.sh OLD_TREE NEW_TREE OUT_DIR
#
# OLD_TREE / NEW_TREE: checkouts (e.g. `git archive <commit> | tar -x -C DIR`); each run's
# JSON and log land in OUT_DIR/<tree name>_<benchmark>.*; the benchmarks stamp their records
# with the tree's commit where it has one (`git archive` trees: pass CCA_COMMIT=...).
set -u
old=$1; new=$2; out=$3
mkdir -p "$out"
run() {   # run TREE NAME COMMAND...
  local tree=$1 name=$2; shift 2
  local tag; tag=$(basename "$tree")_$name
  echo "== $tag: $*"
  (cd "$tree" && timeout 900 "$@" --out "$out/$tag" > "$out/$tag.log" 2>&1)
  echo "   rc $? ($(tail -c 300 "$out/$tag.log" | tr '\n' ' ' | cut -c1-200))"
}
for tree in "$old" "$new"; do
  run "$tree" attention python3 benchmarks/attention.py --impls cca_pallas_gpu,full_cudnn \
      --lengths 131072 --hkv 8 --iters 20
done
for tree in "$new" "$old"; do
  run "$tree" inference python3 benchmarks/inference.py --impl cca --contexts 131072
done
for tree in "$old" "$new"; do
  run "$tree" train python3 benchmarks/train_bench.py --preset llama2-7b-shape \
      --attention cca --seq-len 131072 --trainable qkv --steps 4
done

#!/usr/bin/env bash
# ingest.sh JOB_TGZ SUFFIX: unpack a chain's job.tgz and copy its results (job/out) into
# benchmarks/results/research as NAME_SUFFIX.EXT (e.g. SUFFIX h100_bdff88d), with the chain's
# paths (/root/job/out/) dropped from their text; the step logs go to /tmp/ingest/job.
set -eu
tgz=$1; suffix=$2
dest=benchmarks/results/research
rm -rf /tmp/ingest && mkdir -p /tmp/ingest && tar xzf "$tgz" -C /tmp/ingest
for f in /tmp/ingest/job/out/*; do
  [ -f "$f" ] || continue
  base=$(basename "$f"); stem=${base%.*}; ext=${base##*.}
  [ "$stem" = "$base" ] && ext="" || ext=".$ext"
  stem=${stem%_h200}; stem=${stem%_h100}
  out="$dest/${stem}_${suffix}${ext}"
  if [ -e "$out" ]; then echo "exists, skipped: $out"; continue; fi
  if grep -Iq . "$f"; then sed 's#/root/job/out/##g' "$f" > "$out"; else cp "$f" "$out"; fi
  echo "$out"
done
cat /tmp/ingest/job/steps.log

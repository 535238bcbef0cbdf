#!/usr/bin/env bash
# start.sh COMMIT [STEPS]: install carried wheels, copy the tree to /root/srv, start the chain of
# STEPS (a file beside this one; steps.txt by default; `auto` picks by card) in the background;
# `.whl/tree_<commit>.tgz` (an older source tree) is unpacked to /root/trees/<commit>.
set -u
COMMIT=${1:-unknown}
STEPS=${2:-steps.txt}
if [ "$STEPS" = auto ]; then  # the full H200 chain on an H200, the steps that fit 80 GB elsewhere
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then STEPS=steps.txt; else STEPS=steps_h100.txt; fi
fi
if [ ! -f /root/job/started ]; then
  mkdir -p /root/job/out /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /root/job/pip.log 2>&1
  rm -rf /root/srv && mkdir -p /root/srv && cp -r . /root/srv/ && rm -rf /root/srv/.whl /root/srv/.git
  for tree in .whl/tree_*.tgz; do   # older source trees carried for A/B steps: /root/trees/<commit>
    [ -f "$tree" ] || continue
    name=$(basename "$tree" .tgz); mkdir -p /root/trees/${name#tree_}
    tar xzf "$tree" -C /root/trees/${name#tree_}
  done
  echo "$COMMIT" > /root/job/commit
  echo "$STEPS" > /root/job/steps_file
  date -u +%FT%TZ > /root/job/started
  setsid nohup bash /root/srv/benchmarks/device_chain/chain.sh > /root/job/chain.log 2>&1 < /dev/null &
fi
exit 0

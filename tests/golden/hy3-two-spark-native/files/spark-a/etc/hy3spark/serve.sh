#!/bin/bash
# Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file.
# Runs inside this node's container, where Ray (or the native launcher's holder) is PID 1, so the engine's output
# goes both to the serve log and to PID 1's stdout (`docker logs` shows it):
# /var/log/hy3spark/serve.log
# Or on the host, from an operator's engine venv (one node, no container): there a transient systemd unit runs it
# (systemd sets INVOCATION_ID), and its own stdout is the unit's journal.
# The secrets (API key, Hub token) come on stdin, from the node's 0600 file
# /etc/hy3spark-secrets/secrets.env, which no container mounts:
# `docker exec -i` pipes it in, a host unit reads it as StandardInput=file:. No file in the container holds them,
# no command line, and not the log's tee: only the engine's environment.
set -euo pipefail
secrets=
if [ ! -t 0 ]; then
  secrets=$(cat)
  if [ -z "${INVOCATION_ID:-}" ] && [ "${1-}" != --detached ]; then
    # In the container: carry on in a copy of this script in a session of its own, so that `docker exec` returns
    # and the engine stays. The secrets cross to it through a pipe. (Run by hand from a terminal, the script stays
    # in the foreground.)
    printf '%s' "$secrets" | setsid --fork "$0" --detached > /dev/null 2>&1
    exit 0
  fi
fi
if [ -n "${INVOCATION_ID:-}" ]; then
  exec > >(tee -a /var/log/hy3spark/serve.log) 2>&1 < /dev/null
else
  exec > >(tee -a /var/log/hy3spark/serve.log > /proc/1/fd/1) 2>&1 < /dev/null
fi
if [ -n "$secrets" ]; then
  # After the log's tee has started, so that only the engine holds them.
  set -a
  eval "$secrets"
  set +a
fi
unset secrets
echo 'hy3spark: starting vllm for hy3-pair-native (spec 95225a4c89ea)'
exec vllm serve kodelow/Hy3-NVFP4-W4A16 --revision main --served-model-name hy3 --port 8888 --tensor-parallel-size 2 --distributed-executor-backend mp --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29501 --max-model-len 131072 --max-num-seqs 6 --max-num-batched-tokens 2048 --kv-cache-dtype fp8_e4m3 --gpu-memory-utilization 0.90 --speculative-config '{"method":"mtp","num_speculative_tokens":1}' --tool-call-parser hy_v3 --reasoning-parser hy_v3 --enable-auto-tool-choice --trust-remote-code --enforce-eager

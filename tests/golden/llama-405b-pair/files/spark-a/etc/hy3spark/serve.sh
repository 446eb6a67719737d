#!/bin/bash
# Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file.
# Runs inside this node's container (docker exec -d), where Ray (or the native launcher's holder) is PID 1, so
# the engine's output goes both to the serve log and to PID 1's stdout (`docker logs` shows it):
# /var/log/hy3spark/serve.log
# Or on the host, from an operator's engine venv (one node, no container): there a transient systemd unit runs it
# (systemd sets INVOCATION_ID), and its own stdout is the unit's journal.
set -euo pipefail
if [ -n "${INVOCATION_ID:-}" ]; then
  exec > >(tee -a /var/log/hy3spark/serve.log) 2>&1
else
  exec > >(tee -a /var/log/hy3spark/serve.log > /proc/1/fd/1) 2>&1
fi
if [ -r /etc/hy3spark/secrets.env ]; then
  # Secrets reach the engine's environment from a 0600 file, never its command line; after the log's tee has
  # started, so that only the engine holds them.
  set -a
  . /etc/hy3spark/secrets.env
  set +a
fi
echo 'hy3spark: starting vllm for llama405-pair (spec 040b9523be08)'
exec vllm serve hugging-quants/Meta-Llama-3.1-405B-Instruct-AWQ-INT4 --revision main --served-model-name llama-405b --port 8888 --tensor-parallel-size 2 --distributed-executor-backend ray --max-model-len 32768 --max-num-seqs 4 --max-num-batched-tokens 2048 --kv-cache-dtype fp8 --gpu-memory-utilization 0.90 --tool-call-parser llama3_json --enable-auto-tool-choice --enforce-eager

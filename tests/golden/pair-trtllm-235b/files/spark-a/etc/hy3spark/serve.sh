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
echo 'hy3spark: starting trtllm for pair-trtllm (spec 959e8e509af8)'
# The API front checks the key in front of an engine that checks none: it answers on the API port, the engine
# behind it on loopback. It reads the key from this environment, exits when the engine's launcher (this process,
# after exec) does, and the engine starts without the key.
python3 /etc/hy3spark/api-front.py --listen 0.0.0.0:8355 --upstream 127.0.0.1:8356 --key-env HY3SPARK_API_KEY &
unset HY3SPARK_API_KEY
exec mpirun --mca plm_rsh_args '-p 2233 -F /etc/hy3spark/mpi/ssh_config' -x MASTER_ADDR -x NCCL_SOCKET_IFNAME -x GLOO_SOCKET_IFNAME -x TP_SOCKET_IFNAME -x UCX_NET_DEVICES -x NCCL_IB_DISABLE -x HF_HUB_CACHE -x HF_HUB_OFFLINE -x HF_HUB_DISABLE_TELEMETRY -x NCCL_IB_HCA -x NCCL_DEBUG -x NCCL_DEBUG_SUBSYS -x HF_TOKEN trtllm-llmapi-launch trtllm-serve nvidia/Qwen3-235B-A22B-FP4 --revision main --tp_size 2 --backend pytorch --max_num_tokens 32768 --max_batch_size 4 --max_seq_len 32768 --extra_llm_api_options /etc/hy3spark/engine-options.yml --port 8356 --host 127.0.0.1

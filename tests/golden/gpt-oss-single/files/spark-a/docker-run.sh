#!/bin/sh
# Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file.
# What the head role starts on spark-a, as one docker run line.
# /dev/infiniband is passed only where it exists.
docker run -d --name gptoss-head --network host --ipc host --gpus all --ulimit memlock=-1 --ulimit stack=67108864 --device /dev/infiniband --env-file /etc/hy3spark/node.env -v /var/lib/hy3spark/hub:/var/lib/hy3spark/hub -v /etc/hy3spark:/etc/hy3spark:ro -v /var/log/hy3spark:/var/log/hy3spark --label io.hy3spark.cluster=gptoss-one --label io.hy3spark.role=head nvcr.io/nvidia/vllm:25.11-py3 ray start --head --port 6379 --ray-client-server-port 10001 --include-dashboard=false --node-ip-address 10.0.0.1 --num-gpus 1 --node-manager-port 6380 --object-manager-port 6381 --min-worker-port 20000 --max-worker-port 20999 --dashboard-agent-listen-port 52365 --dashboard-agent-grpc-port 52366 --runtime-env-agent-port 52368 --metrics-export-port 52367 --disable-usage-stats --block

#!/bin/sh
# Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file.
# What the worker role starts on spark-b, as one docker run line.
# /dev/infiniband is passed only where it exists.
docker run -d --name llama405-worker --network host --ipc host --init --gpus all --ulimit memlock=-1 --ulimit stack=67108864 --device /dev/infiniband --env-file /etc/hy3spark/node.env -v /var/lib/hy3spark/hub:/var/lib/hy3spark/hub -v /etc/hy3spark:/etc/hy3spark:ro -v /var/log/hy3spark:/var/log/hy3spark --label io.hy3spark.cluster=llama405-pair --label io.hy3spark.role=worker nvcr.io/nvidia/vllm:25.11-py3 ray start --address 10.0.0.1:6379 --node-ip-address 10.0.0.2 --num-gpus 1 --node-manager-port 6380 --object-manager-port 6381 --min-worker-port 20000 --max-worker-port 20999 --dashboard-agent-listen-port 52365 --dashboard-agent-grpc-port 52366 --runtime-env-agent-port 52368 --metrics-export-port 52367 --disable-usage-stats --block

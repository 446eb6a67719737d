#!/bin/sh
# Managed by hy3spark from the cluster spec; edit the spec and re-render instead of this file.
# What the head role starts on spark-a, as one docker run line.
# /dev/infiniband is passed only where it exists.
docker run -d --name trtllm-head --network host --ipc host --init --gpus all --ulimit memlock=-1 --ulimit stack=67108864 --device /dev/infiniband --env-file /etc/hy3spark/node.env -v /var/lib/hy3spark/hub:/var/lib/hy3spark/hub -v /etc/hy3spark:/etc/hy3spark:ro -v /var/log/hy3spark:/var/log/hy3spark -v /etc/hy3spark/openmpi-hostfile:/etc/openmpi-hostfile:ro --label io.hy3spark.cluster=pair-trtllm --label io.hy3spark.role=head nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc5 /bin/sh -c 'mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e -p 2233 -f /etc/hy3spark/mpi/sshd_config'

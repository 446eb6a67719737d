#!/usr/bin/env python3
"""Distribution benchmark (a script, not a test): the image and model_sync roles between two test nodes.

What it measures, on a synthetic model of about 2 GB in 40 shards (tests/hubdouble) and a synthetic engine image:
1. model_sync's cold sync to an empty worker beside a plain `rsync -a` of the same snapshot tree over the same SSH
   in the same run (wall time, bytes on the worker's fabric interface, throughput); plain `rsync -a` of
   snapshots/<sha>/ alone also shows what it ships: links, not weights (FIELD-NOTES #6);
2. a re-run when nothing changed: wall time of the whole playbook and bytes moved (goal: 0 bytes, under 3 s);
3. the cold path with image and model transfers concurrent (playbooks/distribute.yml) versus sequential
   (hy3spark_distribute_concurrent=false);
4. download plus distribution (both nodes empty, the whole role) against the download alone (the head empty, the
   head's part of the role), both with the head's venv already in place; twice: with the Hub double behind one
   link of --hub-link-mbps (default 125 MB/s, a 1 Gb/s internet uplink: a real download from the Hub is bound by
   the site's link, far below the fabric), and with the double unthrottled, where the download, the double, the
   hashing and the send's SSH ciphers all compete for the same 2 cores (the box's worst case, not the design's).

Each line of the issue's acceptance is printed with its ratio: cold model_sync at >= 1.0x plain `rsync -a`,
download plus distribution at <= 1.3x the download alone, the re-run under 3 s with 0 bytes moved.

It starts two dnode containers (systemd + Docker, images from scripts/build-images) on their own Docker network,
runs the real playbooks against them with the docker connection, prints a table and writes JSON, then removes
everything it made. Run from the repo root:

    .venv/bin/python bench/distribution.py [--shards 40 --shard-mib 50 --image-mib 1024] [--json out.json]

Numbers depend on this machine (2 cores, one disk shared by both "nodes"): compare the lines with each other,
not with a 200 GbE link between two Sparks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NET, SUBNET = "bench-dist-fabric", "10.94.0.192/26"
HEAD, WORKER = "bench-dist-head", "bench-dist-worker"
IPS = {HEAD: "10.94.0.200", WORKER: "10.94.0.201"}
REPO = "hubdouble/bench-model"
IMAGE = "bench.local/hy3spark/engine:bench"
TOKEN_ENV = "HY3SPARK_HUB_TOKEN"
CACHE = "/var/lib/hy3spark/hub"
REPO_DIR = f"{CACHE}/models--hubdouble--bench-model"


def sh(*args: str, check: bool = True, capture: bool = True, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(args, check=False, capture_output=capture, text=True, env=env)
    if check and proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(args[:6])} ... failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout if capture else ""


def dexec(node: str, script: str, user: str = "root") -> str:
    return sh("docker", "exec", "-u", user, node, "bash", "-c", script)


def rx_bytes(node: str) -> int:
    return int(dexec(node, "cat /sys/class/net/eth0/statistics/rx_bytes").strip())


def images_env() -> dict[str, str]:
    env_file = ROOT / ".cache" / "images.env"
    if not env_file.is_file():
        raise SystemExit("bench: no .cache/images.env: run scripts/build-images first")
    return dict(line.split("=", 1) for line in env_file.read_text().split() if "=" in line)


def start_nodes(image: str) -> None:
    sh("docker", "network", "create", "--subnet", SUBNET, "-o", "com.docker.network.driver.mtu=9000", NET)
    for node in (HEAD, WORKER):
        sh("docker", "run", "-d", "--name", node, "--hostname", node, "--network", NET, "--ip", IPS[node],
           "--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN", "--security-opt", "seccomp=unconfined",
           "--security-opt", "apparmor=unconfined", "--cgroupns", "host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw",
           "-v", "/var/lib/docker", "--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp",
           "--stop-signal", "SIGRTMIN+3", image, "/lib/systemd/systemd")
    for node in (HEAD, WORKER):
        for _ in range(60):
            if subprocess.run(["docker", "exec", node, "docker", "info"], capture_output=True).returncode == 0:
                break
            time.sleep(1)
        else:
            raise SystemExit(f"bench: Docker did not start in {node}")


def stop_nodes() -> None:
    for node in (HEAD, WORKER):
        subprocess.run(["docker", "rm", "-f", "-v", node], capture_output=True)
    subprocess.run(["docker", "network", "rm", NET], capture_output=True)


def write_inventory(work: Path, commit: str, total: int) -> Path:
    spec = work / "cluster.yml"
    spec.write_text(f"""name: bench-dist
profile: hy3-295b-nvfp4-tp2
head: {{name: {HEAD}, fabric_ip: {IPS[HEAD]}/26, ssh_user: ubuntu}}
workers:
  - {{name: {WORKER}, fabric_ip: {IPS[WORKER]}/26, ssh_user: ubuntu}}
fabric: {{interfaces: [eth0], hcas: [], mtu: 9000}}
image: {{ref: {IMAGE}, worker_source: stream}}
model: {{repo: {REPO}, revision: {commit}, size_bytes: {total}, token_env: {TOKEN_ENV}}}
container: {{gpus: false}}
""")
    sh(sys.executable, "-m", "hy3spark", "render", str(spec), "--out", str(work / "rendered"))
    inv = work / "rendered" / "inventory"
    (inv / "hosts.yml").write_text(f"""all:
  vars:
    ansible_connection: community.docker.docker
    ansible_user: root
  children:
    hy3spark_head: {{hosts: {{{HEAD}: {{}}}}}}
    hy3spark_workers: {{hosts: {{{WORKER}: {{}}}}}}
    hy3spark_cluster: {{children: {{hy3spark_head: {{}}, hy3spark_workers: {{}}}}}}
""")
    return inv / "hosts.yml"


def playbook(work: Path, name: str, text: str) -> Path:
    path = work / name
    path.write_text(text)
    return path


class Runner:
    def __init__(self, inventory: Path, token: str) -> None:
        self.inventory = inventory
        self.env = {**os.environ, "ANSIBLE_ROLES_PATH": str(ROOT / "roles"), "LC_ALL": "C.UTF-8",
                    "ANSIBLE_FORCE_COLOR": "0",
                    "ANSIBLE_HOST_KEY_CHECKING": "False", TOKEN_ENV: token,
                    "ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.profile_tasks",
                    "PROFILE_TASKS_TASK_OUTPUT_LIMIT": "100",
                    # hy3spark.cluster (the roles call its plugins by full name) through the checkout's link.
                    "ANSIBLE_COLLECTIONS_PATH": f"{ROOT / 'collections'}:{ROOT / '.venv/lib/python3.11/site-packages'}"}
        self.ansible = str(Path(sys.executable).parent / "ansible-playbook")
        self.tasks: dict[str, float] = {}

    def run(self, play: Path, *extra: str) -> float:
        began = time.monotonic()
        proc = subprocess.run([self.ansible, "-i", str(self.inventory), str(play), *extra], env=self.env,
                              capture_output=True, text=True)
        took = time.monotonic() - began
        if proc.returncode != 0:
            fatal = "\n".join(line for line in proc.stdout.splitlines() if line.startswith(("fatal:", "failed:")))
            raise SystemExit(f"bench: {play.name} failed:\n{fatal}\n...\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
        # profile_tasks' summary: "<role> : <task> ------ 1.23s"
        self.tasks = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^(.+?) -{3,} (\d+\.\d+)s$",
                                                                                   proc.stdout, re.M)}
        return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--shard-mib", type=int, default=50)
    parser.add_argument("--image-mib", type=int, default=1024, help="size of the synthetic engine image")
    parser.add_argument("--streams", type=int, default=0,
                        help="model_sync_streams (transfer streams per worker); 0: the role's default (head's cores)")
    parser.add_argument("--hub-link-mbps", type=float, default=125.0,
                        help="the Hub's link for measure 4, MB/s shared by all downloads (default 125: 1 Gb/s)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="leave the containers running afterwards")
    args = parser.parse_args()
    if shutil.which("docker") is None:
        raise SystemExit("bench: needs docker")
    token = "bench-token-not-a-secret"
    results: dict[str, object] = {"shards": args.shards, "shard_mib": args.shard_mib, "image_mib": args.image_mib,
                                  "hub_link_MBps": args.hub_link_mbps,
                                  "streams": args.streams or f"the head's cores ({os.cpu_count()}), at most 8",
                                  "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    stop_nodes()
    work = Path(tempfile.mkdtemp(prefix="hy3spark-bench-"))
    try:
        start_nodes(images_env()["HY3SPARK_DNODE_IMAGE"])
        # The model: generated on the head, served there by the Hub double, downloaded by the role.
        sh("docker", "cp", str(ROOT / "tests" / "hubdouble"), f"{HEAD}:/opt/hubdouble")
        gen = json.loads(dexec(HEAD, f"cd /opt && python3 -m hubdouble generate --out /srv/hub/repo "
                                     f"--shards {args.shards} --big-shards {args.shards} "
                                     f"--big-kib {args.shard_mib * 1024}").splitlines()[-1])
        results["model_bytes"] = gen["bytes"]
        dexec(HEAD, f"cd /opt && {TOKEN_ENV}={token} nohup python3 -m hubdouble serve --root /srv/hub/repo "
                    f"--repo {REPO} --port 8080 --cdn-port 8081 --token-env {TOKEN_ENV} >/var/log/hub.log 2>&1 &")
        # The same repo behind one internet-like link, for measure 4.
        dexec(HEAD, f"cd /opt && {TOKEN_ENV}={token} nohup python3 -m hubdouble serve --root /srv/hub/repo "
                    f"--repo {REPO} --port 8082 --cdn-port 8083 --token-env {TOKEN_ENV} "
                    f"--link-rate {int(args.hub_link_mbps * 1e6)} >/var/log/hub-link.log 2>&1 &")
        # The engine image: one layer of random bytes, so nothing compresses it away.
        dexec(HEAD, f"mkdir -p /tmp/img && head -c {args.image_mib}M /dev/urandom > /tmp/img/layer && "
                    f"tar -C /tmp/img -c . | docker import - {IMAGE} >/dev/null && rm -rf /tmp/img")
        wheels = ROOT / ".cache" / "wheelhouse"
        wheels.mkdir(parents=True, exist_ok=True)
        import huggingface_hub  # the controller's version is the one the head installs

        if not list(wheels.glob(f"huggingface_hub-{huggingface_hub.__version__}-*.whl")):
            sh(sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(wheels),
               f"huggingface_hub=={huggingface_hub.__version__}")
        sh("docker", "cp", f"{wheels}/.", f"{HEAD}:/opt/wheels")
        inventory = write_inventory(work, gen["commit"], gen["bytes"])
        runner = Runner(inventory, token)
        role_vars = ("-e", json.dumps({"model_sync_hf_endpoint": "http://127.0.0.1:8080",
                                       "model_sync_pip_extra_args": "--no-index --find-links /opt/wheels",
                                       "model_sync_streams": args.streams}))
        prepare = playbook(work, "prepare.yml", """---
- name: Prepare the bench nodes
  hosts: hy3spark_cluster
  gather_facts: false
  tasks:
    - name: Create the deploying user
      ansible.builtin.user: {name: ubuntu, shell: /bin/bash, groups: [docker], append: true}
    - name: Set up SSH from the head to the worker
      ansible.builtin.include_role: {name: network, tasks_from: ssh.yml}
""")
        model = playbook(work, "model.yml", """---
- name: Sync the model
  hosts: hy3spark_cluster
  gather_facts: false
  become: true
  roles: [model_sync]
""")
        runner.run(prepare)
        head_only = playbook(work, "head.yml", """---
- name: Download the model on the head only
  hosts: hy3spark_cluster
  gather_facts: false
  become: true
  roles:
    - role: model_sync
      vars: {model_sync_workers: []}
""")
        results["head_download_s"] = round(runner.run(head_only, *role_vars), 1)

        # 1. model_sync cold vs plain rsync -a of the same tree, same SSH, same run.
        rx = rx_bytes(WORKER)
        t_role = runner.run(model, *role_vars)
        role_bytes = rx_bytes(WORKER) - rx
        phases = {key: round(sum(t for name, t in runner.tasks.items() if any(n in name for n in names)), 1)
                  for key, names in (
                      ("transfer_s", ("Wait for the transfers to the workers", "Send each file to the workers")),
                      ("verify_after_s", ("Verify every file of the model on the worker",)),
                      ("verify_before_s", ("Verify the worker's copy",)))}
        snapshot = f"{REPO_DIR}/snapshots/{gen['commit']}"
        ssh = "ssh -o BatchMode=yes -o StrictHostKeyChecking=yes -o Compression=no"
        dexec(WORKER, "mkdir -p /home/ubuntu/plain /home/ubuntu/plain-snap && chown ubuntu /home/ubuntu/plain*")
        rx = rx_bytes(WORKER)
        began = time.monotonic()
        dexec(HEAD, f"rsync -a -e '{ssh}' {REPO_DIR}/ ubuntu@{IPS[WORKER]}:/home/ubuntu/plain/", user="ubuntu")
        t_plain = time.monotonic() - began
        plain_bytes = rx_bytes(WORKER) - rx
        dexec(HEAD, f"rsync -a -e '{ssh}' {snapshot}/ ubuntu@{IPS[WORKER]}:/home/ubuntu/plain-snap/", user="ubuntu")
        snap_du = int(dexec(WORKER, "du -sb /home/ubuntu/plain-snap | cut -f1"))
        cold_slowest = sorted(runner.tasks.items(), key=lambda kv: -kv[1])[:6]
        results["cold"] = {
            "role_s": round(t_role, 1), "role_wire_bytes": role_bytes, "slowest": cold_slowest,
            "role_MBps": round(gen["bytes"] / t_role / 1e6, 1), **phases,
            "transfer_MBps": round(gen["bytes"] / max(phases["transfer_s"], 0.1) / 1e6, 1),
            "plain_rsync_a_s": round(t_plain, 1), "plain_wire_bytes": plain_bytes,
            "plain_MBps": round(gen["bytes"] / t_plain / 1e6, 1),
            "plain_rsync_a_of_snapshot_dir_bytes_on_worker": snap_du,
            "speed_vs_plain": round(t_plain / t_role, 2),
        }
        dexec(WORKER, "rm -rf /home/ubuntu/plain /home/ubuntu/plain-snap")

        # 2. Nothing changed: the whole playbook again.
        rx = rx_bytes(WORKER)
        t_rerun = runner.run(model, *role_vars)
        work_tasks = ("Verify each node", "Get the hub's listing", "Find what the head lacks",
                      "Verify the worker's copy", "Verify every file of the model")
        role_work = sum(t for name, t in runner.tasks.items() if any(w in name for w in work_tasks))
        results["rerun"] = {"s": round(t_rerun, 1), "wire_bytes": rx_bytes(WORKER) - rx,
                            "role_work_s": round(role_work, 1), "tasks": len(runner.tasks),
                            "slowest": sorted(runner.tasks.items(), key=lambda kv: -kv[1])[:5]}

        # 3. Cold path, image + model: concurrent vs sequential.
        distribute = ROOT / "playbooks" / "distribute.yml"
        for label, concurrent in (("concurrent", "true"), ("sequential", "false")):
            dexec(WORKER, f"rm -rf {REPO_DIR} /var/lib/hy3spark/model_sync; docker image rm -f {IMAGE} >/dev/null 2>&1;"
                          " true")
            rx = rx_bytes(WORKER)
            took = runner.run(distribute, *role_vars, "-e", f"hy3spark_distribute_concurrent={concurrent}")
            results[f"cold_{label}"] = {"s": round(took, 1), "wire_bytes": rx_bytes(WORKER) - rx}

        # 4. Download plus distribution against the download alone: both from an empty cache, the venv in place;
        # behind the internet-like link, then unthrottled.
        wipe = f"rm -rf {REPO_DIR} /var/lib/hy3spark/model_sync"
        for key, endpoint in (("download_and_distribution", "http://127.0.0.1:8082"),
                              ("download_and_distribution_unthrottled", "http://127.0.0.1:8080")):
            these_vars = ("-e", json.dumps({**json.loads(role_vars[1]), "model_sync_hf_endpoint": endpoint}))
            dexec(HEAD, wipe)
            dexec(WORKER, wipe)
            download_alone = runner.run(head_only, *these_vars)
            dexec(HEAD, wipe)
            dexec(WORKER, wipe)
            rx = rx_bytes(WORKER)
            both = runner.run(model, *these_vars)
            results[key] = {
                "download_alone_s": round(download_alone, 1), "download_plus_distribution_s": round(both, 1),
                "ratio": round(both / download_alone, 2), "wire_bytes": rx_bytes(WORKER) - rx,
                "slowest": sorted(runner.tasks.items(), key=lambda kv: -kv[1])[:5]}
        results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        if not args.keep:
            stop_nodes()
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"bench: kept {HEAD}, {WORKER} and the inventory in {work}", file=sys.stderr)

    cold = results["cold"]
    dd = results["download_and_distribution"]
    du = results["download_and_distribution_unthrottled"]
    mb = results["model_bytes"] / 1e6
    rows = [
        ("model", f"{args.shards} shards, {mb:.0f} MB; image {args.image_mib} MiB"),
        ("load average (1, 5, 15 min)", f"before {results['load_average_before']}, after "
                                        f"{results['load_average_after']}"),
        ("transfer streams per worker", str(results["streams"])),
        ("head download (Hub double)", f"{results['head_download_s']} s"),
        ("model_sync, cold", f"{cold['role_s']} s for the playbook, {cold['role_MBps']} MB/s, "
                             f"{cold['role_wire_bytes'] / 1e6:.0f} MB on the wire: {cold['speed_vs_plain']}x plain "
                             "rsync -a (goal >= 1.0x)"),
        ("  of which rsync", f"{cold['transfer_s']} s ({cold['transfer_MBps']} MB/s); verifying the worker "
                             f"afterwards {cold['verify_after_s']} s"),
        ("plain rsync -a, same tree", f"{cold['plain_rsync_a_s']} s, {cold['plain_MBps']} MB/s, "
                                      f"{cold['plain_wire_bytes'] / 1e6:.0f} MB on the wire"),
        ("plain rsync -a of snapshots/<sha>/", f"{cold['plain_rsync_a_of_snapshot_dir_bytes_on_worker']} bytes "
                                               "arrive (links only)"),
        ("model_sync, nothing changed", f"{results['rerun']['s']} s for the playbook ({results['rerun']['tasks']} "
                                        f"tasks), {results['rerun']['wire_bytes']} bytes on the wire (goal < 3 s, 0 "
                                        f"bytes); the role's checks {results['rerun']['role_work_s']} s"),
        ("image + model, concurrent", f"{results['cold_concurrent']['s']} s"),
        ("image + model, sequential", f"{results['cold_sequential']['s']} s"),
        (f"download alone, Hub link {args.hub_link_mbps:g} MB/s", f"{dd['download_alone_s']} s"),
        ("download + distribution, same link", f"{dd['download_plus_distribution_s']} s: {dd['ratio']}x the "
                                               "download alone (goal <= 1.3x)"),
        ("download alone, Hub unthrottled", f"{du['download_alone_s']} s"),
        ("download + distribution, unthrottled", f"{du['download_plus_distribution_s']} s: {du['ratio']}x (the "
                                                 "download and the send share 2 cores)"),
    ]
    width = max(len(r[0]) for r in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
